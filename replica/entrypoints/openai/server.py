"""The standalone OpenAI HTTP server of one replica (``prefixserve replica``).

Job: host the OpenAI front end (``replica/entrypoints/openai/http_frontend.py``) over one local
:class:`AsyncEngine`: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(SSE streaming and not, ``n > 1``), OpenAI's Responses API (``POST /v1/responses``,
``GET`` and ``DELETE /v1/responses/{id}``, its stored responses in one bounded
store: responses_endpoint.py), ``GET /v1/models``, ``GET /health`` and
``GET /metrics``; vLLM's ``/tokenize``, ``/detokenize``, ``/v1/chat/completions/render``
and ``/version`` (replica/entrypoints/openai/tokenization.py) and SGLang's server and
model info endpoints (server_info.py), which routers probe. This is the replica nginx
routes to on the nginx path; the Ray path reaches the same engine through ``replica/entrypoints/serve/deployment.py``.

Invariants:
* Every answer carries the ``X-Prefixserve-Replica`` header naming this replica.
* With ``max_in_flight`` set, a generation request whose body has been read
  while that many hold a slot is answered 429 (OpenAI error body, code
  ``replica_busy``, ``Retry-After``): nginx's ``proxy_next_upstream http_429``
  then walks the ring to the key's next replica, as the Ray router spills a
  key past a replica over its in-flight cap. The slot is taken only once the
  body is read (a slow or silent client holds none) and held until the last
  byte of the answer is sent.
* Hostile clients are bounded before any application code runs (the API-key
  check included): head size and header count (431), head and body timeouts
  (408), open connections (503), clients that read nothing (closed, their
  request aborted); see replica/entrypoints/openai/http_limits.py and :class:`ServerConfig`.
* SIGTERM (or Ctrl-C) drains: ``/health`` and new generation requests answer
  503 with ``Retry-After``, requests in flight run on for up to
  ``drain_timeout_s``; what is left then ends with an in-band error event and
  ``[DONE]`` (a collected answer: 503); the engine writes its hot cached blocks
  to the shared disk tier (``kv_drain_save_timeout_s``), and the process exits
  0. A second signal stops at once.
* When the engine is dead for good, ``/health`` answers 503 and the process
  stops (after answering the requests in flight) with a non-zero exit status,
  so a supervisor restarts it: never a live process that answers 503 forever.

Knows one replica only: must not import Ray or anything from ``router``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.common.body_limits import DEFAULT_CLIENT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from prefixserve.common.config_util import add_cli_arguments, from_cli_args
from prefixserve.common.endpoint_config import DEFAULT_HOST, REPLICA_PORT, ReplicaEndpointConfig
from prefixserve.common.logs import configure_logging
from prefixserve.common.metric_series import LabeledSeries
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.replica.engine.metrics import ENGINE_INDEX
from prefixserve.replica.engine.request_runner import LocalEngineClient
from prefixserve.replica.entrypoints.openai import http_frontend, lora_endpoints
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import (
    IN_FLIGHT_SLOT_SCOPE_KEY,
    FrontendOptions,
    InFlightCounter,
    InFlightSlot,
)
from prefixserve.replica.entrypoints.openai.http_limits import ConnectionLimits, limited_protocol
from prefixserve.replica.entrypoints.openai.request_fields import IgnoredFields
from prefixserve.replica.entrypoints.openai.response_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    ResponseStore,
)
from prefixserve.replica.entrypoints.openai.responses_endpoint import ResponsesEndpoints
from prefixserve.replica.entrypoints.openai.server_info import ReplicaInfo, package_version
from prefixserve.replica.entrypoints.openai.tokenization import Tokenization
from prefixserve.replica.errors import APIError, ServiceUnavailableError

if TYPE_CHECKING:
    from prefixserve.replica.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

DEFAULT_PORT = REPLICA_PORT
# How often the watchdog looks whether the engine has died for good.
ENGINE_WATCH_PERIOD_S = 0.5
# Exit status of a server stopped because its engine died (a supervisor restarts it).
EXIT_ENGINE_DEAD = 3
# After the drain (or its cut), how long uvicorn waits for the last answers to be written.
FINAL_SHUTDOWN_TIMEOUT_S = 5
RETRY_AFTER_S = 1.0


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class ServerConfig:
    """The standalone server's HTTP limits and timeouts (``prefixserve replica`` options, one per field).

    The defaults are a reverse proxy's: nginx's 60 s ``client_header_timeout``,
    ``client_body_timeout`` and ``send_timeout``, a head the size of nginx's
    ``large_client_header_buffers 4 8k``, Apache's ``LimitRequestFields 100``.
    """

    max_in_flight: int | None = field(
        default=None,
        metadata=_help(
            "answer 429 (Retry-After) to generation requests whose body is read while this many hold a slot, "
            "so nginx tries the key's next ring replica; unset: no cap"
        ),
    )
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=_help("largest accepted request body (413)"))
    h11_max_incomplete_event_size: int = field(
        default=32 * 1024, metadata=_help("largest request line plus headers, in bytes (431); vLLM's knob")
    )
    h11_max_header_count: int = field(default=100, metadata=_help("most header fields a request may carry (431)"))
    limit_concurrency: int | None = field(
        default=1024,
        metadata=_help(
            "most open connections (and requests); a request beyond gets 503 with Retry-After; uvicorn's knob"
        ),
    )
    client_header_timeout_s: float = field(
        default=60.0, metadata=_help("seconds a client may take to send a request head (408)")
    )
    client_body_timeout_s: float = field(
        default=DEFAULT_CLIENT_BODY_TIMEOUT_S,
        metadata=_help("seconds a client may take to send a whole request body (408)"),
    )
    send_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds a client may read nothing while an answer waits for it; then the connection is closed "
            "and its request aborted"
        ),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=_help(
            "on SIGTERM, seconds requests in flight may still run before they are ended with an error event"
        ),
    )
    strict_request_fields: bool = field(
        default=False,
        metadata=_help(
            "refuse (400 unknown_parameter) request fields this server does not know; off: ignore them as vLLM "
            "does (each named once in the log, counted in prefixserve:ignored_request_fields_total)"
        ),
    )
    responses_max_entries: int = field(
        default=DEFAULT_MAX_ENTRIES,
        metadata=_help("most responses /v1/responses keeps for previous_response_id and GET (least recently used go)"),
    )
    responses_max_bytes: int = field(
        default=DEFAULT_MAX_BYTES,
        metadata=_help("most bytes of stored /v1/responses answers and conversations (least recently used go)"),
    )
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=_help(
            "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; also on with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); needs --enable-lora"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "h11_max_incomplete_event_size", "h11_max_header_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("responses_max_entries", "responses_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("max_in_flight", "limit_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None: no limit), got {value!r}")
        for name in ("client_header_timeout_s", "client_body_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            h11_max_incomplete_event_size=self.h11_max_incomplete_event_size,
            h11_max_header_count=self.h11_max_header_count,
            client_header_timeout_s=self.client_header_timeout_s,
            send_timeout_s=self.send_timeout_s,
            limit_concurrency=self.limit_concurrency,
            retry_after_s=RETRY_AFTER_S,
        )


@dataclass
class Drain:
    """The server's shutdown: once begun, no new generation requests; ``open_requests`` are waited for."""

    timeout_s: float
    started_at: float | None = None
    # Generation requests inside the application (reading, queued, running or streaming).
    open_requests: int = 0

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()

    def expired(self) -> bool:
        return self.started_at is not None and time.monotonic() - self.started_at >= self.timeout_s

    def refusal(self) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            "this server is shutting down; retry on another replica",
            code="server_shutting_down",
            retry_after_s=RETRY_AFTER_S,
        )


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


GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def _answer(err: APIError) -> JSONResponse:
    """``err`` as the OpenAI error answer, not logged (an expected refusal, not a failure)."""
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


class GenerationGateMiddleware:
    """Admits generation requests: 503 while draining; else counts them open for the drain and
    hands each an :class:`InFlightSlot` of ``counter`` (taken after its body is read, released here)."""

    def __init__(self, app: ASGIApp, counter: InFlightCounter, drain: Drain) -> None:
        self.app = app
        self.counter = counter
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _answer(self.drain.refusal())(scope, receive, send)
            return
        slot = InFlightSlot(self.counter)
        scope[IN_FLIGHT_SLOT_SCOPE_KEY] = slot
        self.drain.open_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            slot.release()
            self.drain.open_requests -= 1


async def watch_engine(
    engine: AsyncEngine, on_dead: Callable[[], None], period_s: float, stopping: Callable[[], bool] = lambda: False
) -> None:
    """Call ``on_dead`` once the engine is dead for good (``is_running`` False), then return;
    return silently when it stopped while ``stopping()`` (a drain ends the engine on purpose)."""
    while engine.is_running:
        await asyncio.sleep(period_s)
    if stopping():
        return
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
    client_body_timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S,
    drain: Drain | None = None,
    strict_request_fields: bool = False,
    allow_runtime_lora_updating: bool = False,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine``.

    ``api_keys``: when given, ``/v1/*``, ``/openapi.json``, the tokenizer and the info endpoints need
    ``Authorization: Bearer <key>`` with one of them (``/health``, ``/metrics`` and ``/version`` stay
    open for probes and scrapers).
    ``max_body_bytes``: larger request bodies get 413. ``replica_name``: the value
    of the ``X-Prefixserve-Replica`` response header. ``on_engine_dead``: called
    once (while the application runs) when the engine has died for good; the
    CLI stops the server there. ``max_in_flight``: above this many generation
    requests in flight, answer 429 (see the module docstring).
    ``client_body_timeout_s``: a body not whole within this gets 408. ``drain``:
    the shutdown state the server's signal handling drives (while draining,
    ``/health`` and generation requests answer 503). The engine is shut down
    with the application. ``strict_request_fields``: refuse unknown request fields (400)
    instead of ignoring them as vLLM does. ``allow_runtime_lora_updating``: serve vLLM's
    runtime LoRA endpoints (lora_endpoints.py; vLLM's environment variable turns them on too).
    ``response_store``: where ``/v1/responses`` keeps its stored responses (a default-sized store
    when None); its size is exported on ``/metrics``.
    """
    ignored = IgnoredFields(strict=strict_request_fields, count=engine.metrics.observe_ignored_field)
    options = FrontendOptions.build(
        list(api_keys or []), max_body_bytes, client_body_timeout_s=client_body_timeout_s, ignored_fields=ignored
    )
    client = LocalEngineClient(engine)
    tokenization = Tokenization(engine, client, options)
    store = response_store if response_store is not None else ResponseStore()
    responses = ResponsesEndpoints(client, options, store)
    _export_store_size(engine, store)
    info = replica_info(engine)
    drain = drain if drain is not None else Drain(timeout_s=0.0)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watchdog = None
        if on_engine_dead is not None:
            watchdog = asyncio.create_task(
                watch_engine(engine, on_engine_dead, engine_watch_period_s, stopping=lambda: drain.draining)
            )
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            # After a drain the hot cached blocks go to the shared disk tier before the engine stops.
            await engine.shutdown(save_hot_blocks=drain.draining)

    app = FastAPI(title="prefixserve replica", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GenerationGateMiddleware, counter=InFlightCounter(max_in_flight, RETRY_AFTER_S), drain=drain)
    # Added last, so outermost: the 429 of the cap and the drain's 503 name the replica too.
    app.add_middleware(ReplicaHeaderMiddleware, replica_name=replica_name)
    http_frontend.add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:  # a load balancer takes this replica out before it goes
            return _answer(drain.refusal())
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

    responses.add_routes(app)

    if lora_endpoints.runtime_updating_allowed(allow_runtime_lora_updating):

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await lora_endpoints.load_lora_adapter(request, engine, options)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await lora_endpoints.unload_lora_adapter(request, engine, options)

    # vLLM's tokenizer endpoints and the chat render (replica/entrypoints/openai/tokenization.py).
    app.post("/tokenize")(tokenization.tokenize)
    app.post("/detokenize")(tokenization.detokenize)
    app.post("/v1/chat/completions/render")(tokenization.render_chat)
    app.post("/v1/completions/render")(tokenization.render_completion)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": info.version})

    # SGLang's info endpoints, which routers probe when they register a worker; behind the key.
    async def server_info(request: Request) -> JSONResponse:
        http_frontend.check_auth(request, options)
        return JSONResponse(info.server_info())

    async def model_info(request: Request) -> JSONResponse:
        http_frontend.check_auth(request, options)
        return JSONResponse(info.model_info())

    for path in ("/server_info", "/get_server_info"):
        app.get(path)(server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path)(model_info)

    return app


def _export_store_size(engine: AsyncEngine, store: ResponseStore) -> None:
    """The response store's entries and bytes as gauges on the engine's registry (read at each scrape)."""
    series = LabeledSeries(engine.metrics.registry, ["model_name", "engine"], (engine.model_name, ENGINE_INDEX))
    entries = series.gauge(
        "prefixserve:response_store_entries", "Responses /v1/responses holds for previous_response_id."
    )
    entries.set_function(lambda: store.entries)
    size = series.gauge(
        "prefixserve:response_store_bytes", "Bytes of the responses and conversations /v1/responses holds."
    )
    size.set_function(lambda: store.bytes)


def replica_info(engine: AsyncEngine) -> ReplicaInfo:
    """What the info endpoints report of ``engine`` (its configuration and KV cache size)."""
    config = engine.config
    core = engine.engine
    return ReplicaInfo(
        model_name=engine.model_name,
        model_path=config.model,
        max_model_len=int(engine.max_model_len),
        block_size=int(config.block_size),
        num_kv_blocks=int(core.runner.num_blocks),
        tensor_parallel_size=int(config.tensor_parallel_size),
        max_num_seqs=int(config.max_num_seqs),
        max_num_batched_tokens=int(config.max_num_batched_tokens),
        enable_prefix_caching=bool(config.enable_prefix_caching),
        architectures=(core.model_config.architecture,),
        version=package_version(),
    )


# ---------------------------------------------------------------------------
# CLI: prefixserve replica
# ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``prefixserve replica``: the HTTP ones, every ServerConfig knob, then every EngineConfig knob."""
    from prefixserve.replica.config import EngineConfig

    http = add_cli_arguments(parser, ReplicaEndpointConfig, "http")
    http.add_argument(
        "--replica-name", default=None, help="value of the X-Prefixserve-Replica header (default: HOST:PORT)"
    )
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_cli_arguments(parser, ServerConfig, "http limits")
    EngineConfig.add_cli_arguments(parser)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM or SIGINT drains (see the module docstring) and the
    process then exits 0 (uvicorn re-raises a handled signal, which would exit -15)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, end_requests: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.drain = drain
        self._end_requests = end_requests
        self._ended_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        log.info(
            "signal %d: draining %d open requests for up to %g s (drain_timeout_s)",
            sig,
            self.drain.open_requests,
            self.drain.timeout_s,
        )
        self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if self.drain.open_requests == 0:
                log.info("drained: no request open; stopping")
                self.should_exit = True
            elif self._ended_at is None and self.drain.expired():
                self._ended_at = time.monotonic()
                log.warning(
                    "drain timeout (%g s): ending %d open requests with an error",
                    self.drain.timeout_s,
                    self.drain.open_requests,
                )
                await self._end_requests()
            elif self._ended_at is not None and time.monotonic() - self._ended_at >= FINAL_SHUTDOWN_TIMEOUT_S:
                self.should_exit = True  # answers still unsent (a client reading slowly): uvicorn closes them
        return await super().on_tick(counter)


def serve(
    engine: AsyncEngine,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    api_keys: Iterable[str] | None = None,
    replica_name: str | None = None,
    engine_watch_period_s: float = ENGINE_WATCH_PERIOD_S,
    uvicorn_logging: bool = True,
    config: ServerConfig | None = None,
) -> int:
    """Serve ``engine`` over HTTP until a signal drains it or until it dies; the process's exit status.

    0 after a normal stop (a drain included); EXIT_ENGINE_DEAD when the engine
    died for good (the server stops accepting, answers the requests in flight,
    then returns). ``uvicorn_logging``: False leaves uvicorn's loggers to the
    root handler (JSON logs). ``config``: the HTTP limits (ServerConfig's defaults when None).
    """
    config = config or ServerConfig()
    died = False

    def stop_on_dead_engine() -> None:
        nonlocal died
        died = True
        server.should_exit = True

    async def end_requests() -> None:
        # The engine fails every request it holds with this error: a stream sends it in-band, then [DONE].
        await engine.shutdown(
            ServiceUnavailableError(
                f"this server is shutting down and the request did not finish within drain_timeout_s="
                f"{config.drain_timeout_s:g}; retry it",
                code="server_shutting_down",
                retry_after_s=RETRY_AFTER_S,
            )
        )

    drain = Drain(timeout_s=config.drain_timeout_s)
    app = build_app(
        engine,
        api_keys=api_keys,
        max_body_bytes=config.max_body_bytes,
        replica_name=replica_name or f"{host}:{port}",
        on_engine_dead=stop_on_dead_engine,
        engine_watch_period_s=engine_watch_period_s,
        max_in_flight=config.max_in_flight,
        client_body_timeout_s=config.client_body_timeout_s,
        drain=drain,
        strict_request_fields=config.strict_request_fields,
        allow_runtime_lora_updating=config.allow_runtime_lora_updating,
        response_store=ResponseStore(config.responses_max_entries, config.responses_max_bytes),
    )
    extra = {} if uvicorn_logging else {"log_config": None}
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            http=limited_protocol(config.connection_limits()),
            timeout_graceful_shutdown=FINAL_SHUTDOWN_TIMEOUT_S,
            **extra,
        ),
        drain,
        end_requests,
    )
    server.run()
    return EXIT_ENGINE_DEAD if died else 0


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve until drained by a signal (or until the engine dies)."""
    from prefixserve.common.gc_heap import freeze_gc_heap
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.async_engine import AsyncEngine

    replica_name = args.replica_name or f"{args.host}:{args.port}"
    server_config = from_cli_args(ServerConfig, args)  # refuses bad limits before the model loads
    configure_logging(args.log_level, args.log_format, replica_name)
    engine = AsyncEngine(EngineConfig.from_cli_args(args))
    freeze_gc_heap()  # the model, tokenizer and engine live as long as the process: no full collection walks them
    return serve(
        engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        api_keys=args.api_keys,
        replica_name=replica_name,
        uvicorn_logging=args.log_format == "text",
        config=server_config,
    )
