"""``prefixserve up``: the whole cluster on this machine until Ctrl-C.

Job: start a local Ray, run the prefixserve Serve application (router/app.py:
N engine replicas on CPU, the prefix-aware request router, the OpenAI
ingress) with Serve's HTTP proxy on ``--host:--port``, print the endpoint, and
on Ctrl-C (or SIGTERM) drain (router/drain.py: new requests 503, requests in
flight run on for up to ``--drain-timeout-s``, then end in-band) and shut
Serve and Ray down cleanly.

Every EngineConfig knob is an option (``--block-size``, ``--num-kv-blocks``,
...), as for ``prefixserve replica``.

Imports Ray Serve lazily (in ``run``), so ``prefixserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from typing import Any

from prefixserve.common.logs import LOG_FORMATS, add_verbose_flag, configure_logging, quiet_libraries
from prefixserve.replica.config import EngineConfig
from prefixserve.router.policies import DEFAULT_POLICY, POLICIES

APP_NAME = "prefixserve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--replicas", type=int, default=2, help="engine replicas (default: 2)")
    cluster.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs per engine replica, per tensor-parallel rank; also its torch threads (default: 1)",
    )
    cluster.add_argument(
        "--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), help=f"routing policy (default: {DEFAULT_POLICY})"
    )
    cluster.add_argument(
        "--epsilon", type=float, default=None, help="bounded_load's and placed's epsilon (default: the policy's)"
    )
    cluster.add_argument(
        "--precise",
        action="store_true",
        help="placed: use the replicas' KV events (which replica holds each key's prefix)",
    )
    cluster.add_argument(
        "--session-header", action="store_true", help="multi-turn affinity: key chat requests by X-Session-Id too"
    )
    cluster.add_argument(
        "--key-turns",
        type=int,
        default=0,
        help="multi-turn affinity: key chat requests by their first N turns too (default: 0, off)",
    )
    cluster.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=64,
        help="requests per engine replica before Serve tries the key's next replica (default: 64)",
    )
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address of the OpenAI endpoint (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port of the OpenAI endpoint (default: 8000)")
    http.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys)",
    )
    http.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (default: 1)")
    http.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="on Ctrl-C or SIGTERM, seconds requests in flight may still run before they end with "
        "an error event (default: the app's drain_timeout_s, 30)",
    )
    http.add_argument(
        "--log-format",
        default="text",
        choices=list(LOG_FORMATS),
        help="text, or json: one object per line here and in Serve's own logs (its JSON "
        "encoding, which names each line's request id: the X-Request-Id)",
    )
    EngineConfig.add_cli_arguments(parser)
    add_verbose_flag(parser)


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """router/app.py's args for the options given."""
    engine = EngineConfig.from_cli_args(args)
    router: dict[str, Any] = {"policy": args.policy}
    if args.epsilon is not None:
        router["epsilon"] = args.epsilon
    if args.precise:
        router["precise"] = True
    if engine.otlp_traces_endpoint is not None:  # the router's route spans go where the engines' go
        router["otlp_traces_endpoint"] = engine.otlp_traces_endpoint
    drain = {} if args.drain_timeout_s is None else {"drain_timeout_s": args.drain_timeout_s}
    return {
        **drain,
        "engine": dataclasses.asdict(engine),
        "num_replicas": args.replicas,
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.replica_cpus},
        "router": router,
        "ingress": {
            "num_replicas": args.ingress_replicas,
            "api_keys": list(args.api_keys or []),
            "session_header": bool(args.session_header),
            "key_turns": args.key_turns,
        },
    }


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from prefixserve.common.serve_shutdown import shutdown_serve
    from prefixserve.router.app import AppArgs, build_app
    from prefixserve.router.drain import drain_app

    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    app = app_args(args)
    drain_timeout_s = AppArgs.from_dict(app).drain_timeout_s  # refuse bad options before starting anything
    configure_logging(logging.INFO, args.log_format)
    level = quiet_libraries(args.verbose)
    # Serve's controller, proxies and replicas log each request and step at INFO.
    serve_logging = {
        "log_level": logging.getLevelName(level),
        "enable_access_log": args.verbose,
        "encoding": args.log_format.upper(),
    }
    # Replicas inherit the environment: nothing from a model hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray's logical CPUs: enough for every replica's bundles (one per tensor-parallel rank).
    cpus = max(os.cpu_count() or 1, int(args.replicas * args.tensor_parallel_size * args.replica_cpus + 0.999))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    running = False
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=level)
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=serve_logging)
        print(
            f"starting {args.replicas} engine replica(s) of {app['engine']['model']} with the {args.policy} router...",
            flush=True,
        )
        serve.run(build_app(app), name=APP_NAME, route_prefix="/", blocking=False, logging_config=serve_logging)
        while not stop.is_set():
            status = serve.status().applications.get(APP_NAME)
            if status is not None and status.status == "RUNNING":
                break
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                print(f"the app failed to start: {status.message}", flush=True)
                return 1
            stop.wait(1.0)
        if not stop.is_set():
            running = True
            print(
                f"OpenAI endpoint: http://{args.host}:{args.port}/v1 "
                f"(models: {EngineConfig.from_cli_args(args).model_name}); Ctrl-C to stop",
                flush=True,
            )
        stop.wait()
        print("shutting down...", flush=True)
        return 0
    finally:
        try:
            if running:
                try:
                    drain_app(APP_NAME, drain_timeout_s)
                except Exception:  # the stop must go on
                    logging.getLogger(__name__).exception("draining failed; stopping now")
            shutdown_serve()
        finally:
            ray.shutdown()
