"""The standalone OpenAI HTTP server of one replica (``prefixserve replica``).

Job: expose one :class:`AsyncEngine` over HTTP: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (SSE streaming and not, ``n > 1``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. This is the replica nginx routes to on the
nginx path; the Ray path reaches the same engine through ``replica/deployment.py``.
What is not FastAPI (API key, prompt ids, building the answers) lives in
``replica/openai_serving.py``; the FastAPI plumbing here (body limit,
disconnects, error handlers, :func:`respond`) is reused by the Ray ingress.

Invariants:
* Every answer carries the ``X-Prefixserve-Replica`` header naming this replica.
* Every error is the OpenAI error body with the status ``prefixserve.replica.api`` maps it to
  (the Ray ingress uses the same mapping): no FastAPI 422s, no HTML pages.
* A request whose client goes away is aborted in the engine, so its KV blocks are
  freed: before its first token, while it is collected (non-streaming) and while
  it streams (Starlette cancels the body iterator on ``http.disconnect``; the
  iterator then closes the engine stream and aborts the request).

Knows one replica only: must not import Ray or anything from ``router``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.replica import api, openai_serving
from prefixserve.replica.openai_serving import Generation, OpenAIRequest

log = logging.getLogger(__name__)

REPLICA_HEADER = "X-Prefixserve-Replica"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_PORT = 8001
DEFAULT_HOST = "127.0.0.1"

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


# ---------------------------------------------------------------------------
# Request plumbing
# ---------------------------------------------------------------------------


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


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body, refusing (413) one over ``max_body_bytes``.

    Both the declared Content-Length and the bytes actually received are checked,
    so a chunked or lying client cannot push more than the limit into memory.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_len = int(declared)
        except ValueError:
            raise api.BadRequestError(f"invalid Content-Length header {declared!r}") from None
        if declared_len > max_body_bytes:
            raise api.PayloadTooLargeError(
                f"request body is {declared_len} bytes; this server accepts at most {max_body_bytes}",
                code="payload_too_large",
            )
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_body_bytes:
            raise api.PayloadTooLargeError(
                f"request body exceeds {max_body_bytes} bytes, the most this server accepts",
                code="payload_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call only after the body has been read: from then on the ASGI ``receive``
    channel only ever reports the disconnect.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watch_task.cancel()
    if not work_task.done() or work_task.cancelled():
        # Wait for the cancelled work to unwind (it closes the engine stream).
        with anyio.CancelScope(shield=True):
            await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnected()
    return work_task.result()


def error_response(exc: BaseException) -> JSONResponse:
    err = api.error_from_exception(exc)
    if err.status_code >= 500:
        log.error("request failed: %s", err.message, exc_info=exc if not isinstance(exc, api.APIError) else None)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = api.APIError(str(exc.detail), code=str(exc.status_code))
    err.status_code = exc.status_code
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _api_error(_: Request, exc: api.APIError) -> JSONResponse:
    return error_response(exc)


def add_error_handlers(app: FastAPI) -> None:
    """Answer Starlette's own errors (404, 405, ...) and every APIError with the OpenAI error body."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(api.APIError, _api_error)


async def start_generation(request: Request, gen: Generation) -> None:
    """Wait for ``gen``'s first delta; on an error or a disconnect, close it (aborting the request) and raise."""
    try:
        await until_disconnect(request, gen.start())
    except BaseException:
        await gen.close()
        raise


async def respond(
    request: Request, gen: Generation, body: OpenAIRequest, model: str, token_text: api.TokenText
) -> Response:
    """The answer to a started generation: SSE when ``body.stream``, else the collected JSON (499: client gone)."""
    if body.stream:
        return StreamingResponse(openai_serving.sse_stream(gen, body, model, token_text),
                                 media_type="text/event-stream")
    try:
        response = await until_disconnect(request, openai_serving.collect_response(gen, body, model, token_text))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        return error_response(exc)
    return JSONResponse(response.model_dump())


# ---------------------------------------------------------------------------
# The application
# ---------------------------------------------------------------------------


def build_app(
    engine: Any,
    *,
    api_keys: Iterable[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    replica_name: str = f"{DEFAULT_HOST}:{DEFAULT_PORT}",
) -> FastAPI:
    """The FastAPI application serving ``engine`` (an ``AsyncEngine``).

    ``api_keys``: when given, ``/v1/*`` needs ``Authorization: Bearer <key>`` with
    one of them (``/health`` and ``/metrics`` stay open for probes and scrapers).
    ``max_body_bytes``: larger request bodies get 413. ``replica_name``: the value
    of the ``X-Prefixserve-Replica`` response header. The engine is shut down
    with the application.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    keys = [k.encode() for k in (api_keys or []) if k]

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="prefixserve replica", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(ReplicaHeaderMiddleware, replica_name=replica_name)
    add_error_handlers(app)
    served_names = {engine.model_name, engine.config.model}
    max_model_len = int(engine.max_model_len)

    def check_auth(request: Request) -> None:
        openai_serving.check_api_key(request.headers.get("authorization", ""), keys)

    def check_model(name: str | None) -> str:
        if name is not None and name not in served_names:
            raise api.ModelNotFoundError(
                f"the model {name!r} does not exist on this replica; it serves {engine.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return engine.model_name

    def token_text(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    async def generate(request: Request, body_cls: type[OpenAIRequest]) -> Response:
        try:
            check_auth(request)
            body = api.parse_request(body_cls, await read_body(request, max_body_bytes))
            model = check_model(body.model)
            # Tokenized here (as the engine would) to fit the default max_tokens to the context.
            prompt_ids = openai_serving.prompt_token_ids(engine, **body.prompt_fields())
            default_max = min(body.default_max_tokens(max_model_len), max_model_len - len(prompt_ids))
            params = body.to_sampling_params(default_max_tokens=default_max, max_model_len=max_model_len)
            request_id = api.new_id(body.id_prefix)
            stream = engine.generate(prompt_ids, params, request_id=request_id, cache_salt=body.cache_salt)
            gen = Generation(request_id, stream)
            await start_generation(request, gen)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            return error_response(exc)
        return await respond(request, gen, body, model, token_text)

    # -- endpoints ---------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return error_response(api.ServiceUnavailableError("the engine loop is not running", code="engine_dead"))

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = api.ModelCard(id=engine.model_name, root=engine.config.model, max_model_len=max_model_len)
        return JSONResponse(api.ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, api.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, api.CompletionRequest)

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
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help=f"largest accepted request body (default: {DEFAULT_MAX_BODY_BYTES})")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    EngineConfig.add_cli_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve until interrupted."""
    import uvicorn

    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_cli_args(args)
    engine = AsyncEngine(config)
    app = build_app(
        engine,
        api_keys=args.api_keys,
        max_body_bytes=args.max_body_bytes,
        replica_name=args.replica_name or f"{args.host}:{args.port}",
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
