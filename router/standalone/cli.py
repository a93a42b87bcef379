"""``prefixserve router``: the standalone router in front of OpenAI-compatible replicas (no Ray, no Serve config).

Job: read the flags (the endpoint's host, port and log format from
common/endpoint_config.py, every other setting from router/standalone/config.py's
fields), build the router and serve it with uvicorn until a signal stops it: SIGTERM stops
accepting, lets the answers in flight run for up to ``--drain-timeout-s``, then exits 0.
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
    import uvicorn

    from prefixserve.common.logs import configure_logging
    from prefixserve.router.standalone.proxy import StandaloneRouter, build_app

    try:
        endpoint = EndpointConfig(host=args.host, port=args.port, log_format=args.log_format)
        config = from_cli_args(StandaloneRouterConfig, args)
    except ValueError as e:
        print(f"prefixserve router: error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, endpoint.log_format, "router")
    app = build_app(StandaloneRouter(config))
    uvicorn.run(
        app,
        host=endpoint.host,
        port=endpoint.port,
        log_level=args.log_level,
        h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
        log_config=None,
        # No client address is read (tenants come from keys and headers): no X-Forwarded-* rewriting per request.
        proxy_headers=False,
    )
    return 0
