"""``prefixserve up``: the whole cluster on this machine until Ctrl-C.

Job: start a local Ray, run the prefixserve Serve application (router/serve/app.py:
N engine replicas on CPU, the prefix-aware request router, the OpenAI
ingress) with Serve's HTTP proxy on ``--host:--port``, print the endpoint, and
on Ctrl-C (or SIGTERM) drain (router/serve/drain.py: new requests 503, requests in
flight run on for up to ``--drain-timeout-s``, then end in-band) and shut
Serve and Ray down cleanly.

Every EngineConfig knob is an option (``--block-size``, ``--num-kv-blocks``,
...), as for ``prefixserve replica``. ``--model`` repeats: each further base model gets
an engine deployment of its own behind the one endpoint, with the same engine options
(but ``--served-model-name`` and ``--lora-modules``, the first model's alone).

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

from prefixserve.common.config_util import add_cli_arguments, from_cli_args
from prefixserve.common.endpoint_config import EndpointConfig
from prefixserve.common.logs import add_verbose_flag, configure_logging, quiet_libraries
from prefixserve.replica.config import EngineConfig
from prefixserve.router.cluster_config import DEFAULT_REPLICA_CPUS, AppArgs, IngressArgs, IngressConfig, RouterArgs
from prefixserve.router.flow_control.tenants import TenantFileError, load_tenants

APP_NAME = "prefixserve"


# The fields of the app args (router/cluster_config.py) that are flags of ``up``, per section.
APP_FLAGS = ("num_replicas", "max_ongoing_requests", "drain_timeout_s")
ROUTER_FLAGS = ("policy",)
INGRESS_FLAGS = ("session_header", "key_turns")
FLOW_FLAGS = ("queue_budget_s",)
RESPONSES_FLAGS = ("responses_max_entries", "responses_max_bytes")
MIGRATION_FLAGS = ("migrate_streams", "max_stream_migrations")
# IngressArgs' flags store under this prefix, beside AppArgs' fields of the same names.
INGRESS_PREFIX = "ingress_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``prefixserve up``, each generated from the config field it sets."""
    cluster = add_cli_arguments(parser, AppArgs, "cluster", only=APP_FLAGS)
    cluster.add_argument(
        "--replica-cpus",
        type=float,
        default=DEFAULT_REPLICA_CPUS,
        help="Ray CPUs per engine replica, per tensor-parallel rank; also its torch threads "
        f"(default: {DEFAULT_REPLICA_CPUS})",
    )
    router = add_cli_arguments(parser, RouterArgs, "router", only=ROUTER_FLAGS)
    # Options of the policy (its Options dataclass): unset leaves the policy's own default.
    router.add_argument(
        "--epsilon", type=float, default=None, help="bounded_load's and placed's epsilon (default: the policy's)"
    )
    router.add_argument(
        "--precise",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="placed: use the replicas' KV events (which replica holds each key's prefix, in which tier); "
        "default: on when a KV tier is (--kv-offloading-size, --kv-disk-path), else off",
    )
    add_cli_arguments(parser, IngressArgs, "ingress", only=("num_replicas",), dest_prefix=INGRESS_PREFIX)
    add_cli_arguments(parser, IngressConfig, "routing keys", only=INGRESS_FLAGS)
    flow = add_cli_arguments(parser, IngressConfig, "flow control", only=FLOW_FLAGS)
    flow.add_argument(
        "--tenants",
        metavar="FILE",
        default=None,
        help="tenant file (YAML or JSON: router/flow_control/tenants.py): quotas, weights and priorities "
        "per tenant, and a fair queue at the ingress; none: no flow control",
    )
    add_cli_arguments(parser, IngressConfig, "responses", only=RESPONSES_FLAGS)
    add_cli_arguments(parser, IngressConfig, "stream migration", only=MIGRATION_FLAGS)
    add_cli_arguments(parser, EndpointConfig, "http")
    EngineConfig.add_cli_arguments(parser, exclude=("model",))
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="a base model to serve: a GGUF file, a checkpoint folder or 'smollm2'; repeat to serve several "
        f"behind the one endpoint, each its own engine deployment (default: {EngineConfig.model})",
    )
    add_verbose_flag(parser)


# Engine options that name one model's things: the first model's alone under several --model.
FIRST_MODEL_ONLY = ("served_model_name", "lora_modules")


def model_names(args: argparse.Namespace) -> list[str]:
    """The base models ``--model`` named, in order (the default model when none)."""
    return list(args.model or [EngineConfig.model])


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """router/serve/app.py's args for the options given."""
    first, *more = model_names(args)
    engine = EngineConfig.from_cli_args(argparse.Namespace(**{**vars(args), "model": first}))
    own = {name: dataclasses.asdict(EngineConfig())[name] for name in FIRST_MODEL_ONLY}
    models = [{**dataclasses.asdict(engine), **own, "model": m} for m in more]
    endpoint = from_cli_args(EndpointConfig, args)
    router: dict[str, Any] = {name: getattr(args, name) for name in ROUTER_FLAGS}
    if args.epsilon is not None:
        router["epsilon"] = args.epsilon
    if args.precise is not None:
        router["precise"] = args.precise
    if engine.otlp_traces_endpoint is not None:  # the router's route spans go where the engines' go
        router["otlp_traces_endpoint"] = engine.otlp_traces_endpoint
    return {
        **{name: getattr(args, name) for name in APP_FLAGS},
        "engine": dataclasses.asdict(engine),
        **({"models": models} if models else {}),
        "ray_actor_options": {"num_cpus": args.replica_cpus},
        "router": router,
        "ingress": {
            "num_replicas": getattr(args, INGRESS_PREFIX + "num_replicas"),
            "api_keys": endpoint.api_keys,
            **{name: getattr(args, name) for name in INGRESS_FLAGS + FLOW_FLAGS + RESPONSES_FLAGS + MIGRATION_FLAGS},
            **({"tenants": load_tenants(args.tenants).to_dict()} if args.tenants is not None else {}),
        },
    }


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from prefixserve.common.serve_shutdown import shutdown_serve
    from prefixserve.router.serve.app import build_app
    from prefixserve.router.serve.drain import drain_app

    if args.num_replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    try:
        app = app_args(args)
    except TenantFileError as exc:
        raise SystemExit(f"--tenants: {exc}") from None
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
    # Ray's logical CPUs: enough for every replica's bundles (one per tensor-parallel rank), of every model.
    engines = len(model_names(args)) * args.num_replicas
    cpus = max(os.cpu_count() or 1, int(engines * args.tensor_parallel_size * args.replica_cpus + 0.999))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    running = False
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=level)
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=serve_logging)
        print(
            f"starting {args.num_replicas} engine replica(s) of {', '.join(model_names(args))} "
            f"with the {args.policy} router...",
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
            served = [EngineConfig.from_dict(m).model_name for m in [app["engine"], *app.get("models", [])]]
            print(
                f"OpenAI endpoint: http://{args.host}:{args.port}/v1 (models: {', '.join(served)}); Ctrl-C to stop",
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
