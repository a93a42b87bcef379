"""``prefixserve router``: the standalone router in front of OpenAI-compatible replicas (no Ray, no Serve config).

Job: read the flags (the endpoint's host, port and log format from
common/endpoint_config.py, every other setting from router/standalone/config.py's
fields), build the router and serve it with its own HTTP server (http_server.py) until a signal
stops it: SIGTERM stops accepting, lets the answers in flight run for up to
``--drain-timeout-s``, then exits 0.
"""

from __future__ import annotations

import argparse
import sys

from prefixserve.common.config_util import add_cli_arguments, from_cli_args
from prefixserve.common.endpoint_config import EndpointConfig
from prefixserve.router.standalone.config import StandaloneRouterConfig

_ENDPOINT_FIELDS = ("host", "port", "log_format")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_arguments(parser, EndpointConfig, "http", only=_ENDPOINT_FIELDS)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_cli_arguments(parser, StandaloneRouterConfig, "router")


def run(args: argparse.Namespace) -> int:
    from prefixserve.common.gc_heap import freeze_gc_heap
    from prefixserve.common.logs import configure_logging
    from prefixserve.router.standalone.http_server import run as serve
    from prefixserve.router.standalone.proxy import StandaloneRouter, build_app, refusal_answer

    try:
        endpoint = EndpointConfig(host=args.host, port=args.port, log_format=args.log_format)
        config = from_cli_args(StandaloneRouterConfig, args)
    except ValueError as e:
        print(f"prefixserve router: error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, endpoint.log_format, "router")
    app = build_app(StandaloneRouter(config))
    freeze_gc_heap()  # its modules, tokenizer and tables live as long as the process (common/gc_heap.py)
    serve(app, endpoint.host, endpoint.port, config.server_limits(), config.drain_timeout_s, refusal_answer)
    return 0
