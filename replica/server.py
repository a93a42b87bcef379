"""The standalone OpenAI HTTP server of one replica (``prefixserve replica``).

Job: host the OpenAI front end (``replica/http_frontend.py``) over one local
:class:`AsyncEngine`: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(SSE streaming and not, ``n > 1``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics``. This is the replica nginx routes to on the nginx path; the Ray
path reaches the same engine through ``replica/deployment.py``.

Invariants:
* Every answer carries the ``X-Prefixserve-Replica`` header naming this replica.
* With ``max_in_flight`` set, a generation request arriving while that many
  are in flight is answered 429 (OpenAI error body, code ``replica_busy``,
  ``Retry-After``) before it is read: nginx's ``proxy_next_upstream http_429``
  then walks the ring to the key's next replica, as the Ray router spills a
  key past a replica over its in-flight cap. A streamed request counts until
  its last byte is sent.
* When the engine is dead for good, ``/health`` answers 503 and the process
  stops (after answering the requests in flight) with a non-zero exit status,
  so a supervisor restarts it: never a live process that answers 503 forever.

Knows one replica only: must not import Ray or anything from ``router``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.replica import api, http_frontend
from prefixserve.replica.engine_client import LocalEngineClient
from prefixserve.replica.http_frontend import DEFAULT_MAX_BODY_BYTES, REPLICA_HEADER, FrontendOptions
from prefixserve.replica.log_json import LOG_FORMATS, configure_logging

if TYPE_CHECKING:
    from prefixserve.replica.engine import AsyncEngine

log = logging.getLogger(__name__)

DEFAULT_PORT = 8001
DEFAULT_HOST = "127.0.0.1"
# How often the watchdog looks whether the engine has died for good.
ENGINE_WATCH_PERIOD_S = 0.5
# Exit status of a server stopped because its engine died (a supervisor restarts it).
EXIT_ENGINE_DEAD = 3


class ReplicaHeaderMiddleware:
    """Adds ``X-Prefixserve-Replica: <name>`` to every response, streamed ones included."""

    def __init__(self, app: ASGIApp, replica_name: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode("latin-1"), replica_name.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class InFlightCapMiddleware:
    """Answers 429 to a generation request while ``cap`` generation requests are in flight."""

    def __init__(self, app: ASGIApp, cap: int, retry_after_s: float = 1.0) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {cap!r}")
        self.app = app
        self.cap = cap
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.cap:
            busy = api.OverloadedError(
                f"this replica has {self.in_flight} requests in flight (max_in_flight={self.cap}); "
                "try the next replica", code="replica_busy", retry_after_s=self.retry_after_s)
            await http_frontend.error_response(busy)(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def watch_engine(engine: AsyncEngine, on_dead: Callable[[], None], period_s: float) -> None:
    """Call ``on_dead`` once the engine is dead for good (``is_running`` False), then return."""
    while engine.is_running:
        await asyncio.sleep(period_s)
    log.error("the engine is dead for good; stopping the server so that it is restarted")
    on_dead()


def build_app(
    engine: AsyncEngine,
    *,
    api_keys: Iterable[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    replica_name: str = f"{DEFAULT_HOST}:{DEFAULT_PORT}",
    on_engine_dead: Callable[[], None] | None = None,
    engine_watch_period_s: float = ENGINE_WATCH_PERIOD_S,
    max_in_flight: int | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine``.

    ``api_keys``: when given, ``/v1/*`` and ``/openapi.json`` need ``Authorization: Bearer <key>`` with
    one of them (``/health`` and ``/metrics`` stay open for probes and scrapers).
    ``max_body_bytes``: larger request bodies get 413. ``replica_name``: the value
    of the ``X-Prefixserve-Replica`` response header. ``on_engine_dead``: called
    once (while the application runs) when the engine has died for good; the
    CLI stops the server there. ``max_in_flight``: above this many generation
    requests in flight, answer 429 (see the module docstring). The engine is
    shut down with the application.
    """
    options = FrontendOptions.build(list(api_keys or []), max_body_bytes)
    client = LocalEngineClient(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watchdog = None
        if on_engine_dead is not None:
            watchdog = asyncio.create_task(watch_engine(engine, on_engine_dead, engine_watch_period_s))
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await engine.shutdown()

    app = FastAPI(title="prefixserve replica", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if max_in_flight is not None:
        app.add_middleware(InFlightCapMiddleware, cap=max_in_flight)
    # Added last, so outermost: the 429 of the cap names the replica too.
    app.add_middleware(ReplicaHeaderMiddleware, replica_name=replica_name)
    http_frontend.add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return await http_frontend.handle_health(client)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        return await http_frontend.handle_openapi(request, app, options)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return await http_frontend.handle_models(request, client, options)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await http_frontend.handle_generate(request, api.ChatCompletionRequest, client, options)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await http_frontend.handle_generate(request, api.CompletionRequest, client, options)

    return app


# ---------------------------------------------------------------------------
# CLI: prefixserve replica
# ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``prefixserve replica``: the HTTP ones, then every EngineConfig knob."""
    from prefixserve.replica.config import EngineConfig

    http = parser.add_argument_group("http")
    http.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default: {DEFAULT_PORT})")
    http.add_argument("--api-key", dest="api_keys", action="append", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys)")
    http.add_argument("--replica-name", default=None,
                      help="value of the X-Prefixserve-Replica header (default: HOST:PORT)")
    http.add_argument("--max-in-flight", type=int, default=None,
                      help="answer 429 (Retry-After) to generation requests above this many in flight, so nginx "
                           "tries the key's next ring replica (default: no cap)")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help=f"largest accepted request body (default: {DEFAULT_MAX_BODY_BYTES})")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    http.add_argument("--log-format", default="text", choices=list(LOG_FORMATS),
                      help="text lines, or one JSON object per line (time, level, request_id, replica, event)")
    EngineConfig.add_cli_arguments(parser)


def serve(engine: AsyncEngine, *, host: str, port: int, log_level: str = "info",
          api_keys: Iterable[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          replica_name: str | None = None, engine_watch_period_s: float = ENGINE_WATCH_PERIOD_S,
          uvicorn_logging: bool = True, max_in_flight: int | None = None) -> int:
    """Serve ``engine`` over HTTP until interrupted or until it dies; the process's exit status.

    0 after a normal stop; EXIT_ENGINE_DEAD when the engine died for good (the
    server stops accepting, answers the requests in flight, then returns).
    ``uvicorn_logging``: False leaves uvicorn's loggers to the root handler (JSON logs).
    """
    import uvicorn

    died = False

    def stop_on_dead_engine() -> None:
        nonlocal died
        died = True
        server.should_exit = True

    app = build_app(engine, api_keys=api_keys, max_body_bytes=max_body_bytes,
                    replica_name=replica_name or f"{host}:{port}", on_engine_dead=stop_on_dead_engine,
                    engine_watch_period_s=engine_watch_period_s, max_in_flight=max_in_flight)
    extra = {} if uvicorn_logging else {"log_config": None}
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5, **extra))
    server.run()
    return EXIT_ENGINE_DEAD if died else 0


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve until interrupted (or until the engine dies)."""
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine import AsyncEngine

    replica_name = args.replica_name or f"{args.host}:{args.port}"
    configure_logging(args.log_level, args.log_format, replica_name)
    engine = AsyncEngine(EngineConfig.from_cli_args(args))
    return serve(engine, host=args.host, port=args.port, log_level=args.log_level, api_keys=args.api_keys,
                 max_body_bytes=args.max_body_bytes, replica_name=replica_name,
                 uvicorn_logging=args.log_format == "text", max_in_flight=args.max_in_flight)
