"""The OpenAI HTTP front end both hosts share: the standalone server and the Ray ingress.

Job: the FastAPI request plumbing and the endpoints' bodies, written once
against an :class:`EngineClient`: read the body (size limit), check the API key
and the model, build the :class:`EngineRequest`, start the engine stream while
watching for a disconnect, and answer (SSE or collected JSON, errors as the
OpenAI error body). ``replica/server.py`` hosts it over a local AsyncEngine,
``router/ingress.py`` over the engine deployment's Serve handle; each host adds
only what is its own (the server's replica header and watchdog, the ingress's
routing key, retries and headers).

Invariants:
* Every error is the OpenAI error body with the status ``replica/api.py`` maps
  it to: no FastAPI 422s, no HTML pages.
* A request whose client goes away is aborted in the engine, so its KV blocks
  are freed: before its first token, while it is collected (non-streaming) and
  while it streams (Starlette cancels the body iterator on ``http.disconnect``;
  the iterator then closes the engine stream and aborts the request).
* The body is parsed once; the routing key is computed from that parse.
* Every generation answer (errors included) carries ``X-Request-Id``: the
  client's own when it sent a valid one, else the id generated here. The
  engine request id is ``<id_prefix>-<client id>`` or the generated id, so the
  engine's and the replica's log lines and the answer's ``id`` name it.

Imports FastAPI and the replica's framework-free modules; never Ray, torch or
``router`` (the ingress passes its routing-key function in).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.replica import api, openai_serving
from prefixserve.replica.api import OpenAIRequest
from prefixserve.replica.engine_client import (
    EngineClient,
    EngineRequest,
    EngineStream,
    ModelInfo,
    is_conversation_turn,
)
from prefixserve.replica.log_json import REQUEST_ID
from prefixserve.replica.openai_serving import Generation
from prefixserve.replica.tools.choice import check_auto_supported
from prefixserve.replica.tracing import trace_headers

log = logging.getLogger(__name__)

# Names the engine replica that served a request (the standalone server: itself).
REPLICA_HEADER = "X-Prefixserve-Replica"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Accepted from the client or generated, carried to the engine, echoed on the answer.
REQUEST_ID_HEADER = "X-Request-Id"
# What a client's request id may be: it reaches log lines and headers, so no spaces or control
# characters, and short (a UUID, a trace id, a ULID all fit).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

# The routing key of a parsed body and its headers (the Ray ingress's Contract 1).
RoutingKeyFn = Callable[[Mapping[str, Any], Mapping[str, str]], str | None]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


@dataclass(frozen=True)
class FrontendOptions:
    """What a host configures of the front end.

    ``api_keys``: the accepted Bearer keys as UTF-8 bytes (none: no check).
    ``max_body_bytes``: larger request bodies get 413.
    ``echo_request_id``: set X-Request-Id on answers (False behind Ray Serve's proxy,
    which already echoes the id it passes in, generating one when the client sent none).
    """

    api_keys: tuple[bytes, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    echo_request_id: bool = True

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    @classmethod
    def build(cls, api_keys: Sequence[str] | None, max_body_bytes: int,
              echo_request_id: bool = True) -> FrontendOptions:
        return cls(tuple(k.encode("utf-8") for k in (api_keys or []) if k), max_body_bytes, echo_request_id)


# ---------------------------------------------------------------------------
# Request plumbing
# ---------------------------------------------------------------------------


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
                f"request body is {declared_len} bytes; this server accepts at most {max_body_bytes}")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_body_bytes:
            raise api.PayloadTooLargeError(
                f"request body exceeds {max_body_bytes} bytes, the most this server accepts")
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


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """The OpenAI error answer to ``exc`` (logged, with ``request_id``, when it is a server error)."""
    err = api.error_from_exception(exc)
    if err.status_code >= 500:
        log.error("request %s failed: %s", request_id or "-", err.message,
                  exc_info=exc if not isinstance(exc, api.APIError) else None)
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
        return error_response(exc, gen.request_id)
    return JSONResponse(response.model_dump())


# ---------------------------------------------------------------------------
# The endpoints
# ---------------------------------------------------------------------------


def check_auth(request: Request, options: FrontendOptions) -> None:
    """Raise AuthenticationError (401) unless the request carries one of the accepted keys."""
    openai_serving.check_api_key(request.headers.get("authorization", ""), options.api_keys)


def check_model(info: ModelInfo, name: str | None) -> str:
    """The served model's name; raise ModelNotFoundError (404) when ``name`` is another model."""
    if name is not None and not info.serves(name):
        raise api.ModelNotFoundError(
            f"the model {name!r} does not exist on this server; it serves {info.model_name!r}", param="model")
    return info.model_name


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``X-Request-Id`` (None when absent); BadRequestError (400) when it is not a valid id."""
    value = headers.get(REQUEST_ID_HEADER.lower())
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise api.BadRequestError(
            f"{REQUEST_ID_HEADER} must be 1 to 128 characters of letters, digits and ._:/+=-",
            code="invalid_request_id")
    return value


def engine_request(body: OpenAIRequest, info: ModelInfo, routing_key: str | None,
                   client_id: str | None = None, headers: Mapping[str, str] | None = None) -> EngineRequest:
    """What the engine is asked: the client's max_tokens, or the default the engine host fits to the prompt.

    ``client_id``: the client's X-Request-Id, which the engine request id then carries.
    ``headers``: the HTTP request's, whose W3C trace context the engine's spans hang under.
    """
    default_max = body.default_max_tokens(info.max_model_len)
    prompt = body.prompt_fields()
    tool_mode = None
    if isinstance(body, api.ChatCompletionRequest):
        tool_mode = body.tool_call_mode()
        if tool_mode is not None and tool_mode.choice == "auto":
            try:
                check_auto_supported(info.enable_auto_tool_choice, info.tool_call_parser)
            except ValueError as exc:
                raise api.BadRequestError(str(exc), param="tool_choice", code="invalid_value") from None
    return EngineRequest(
        request_id=api.new_id(body.id_prefix) if client_id is None else f"{body.id_prefix}-{client_id}",
        **prompt,
        sampling=body.to_sampling_params(default_max_tokens=default_max, max_model_len=info.max_model_len),
        max_tokens_default=None if body.requested_max_tokens() is not None else default_max,
        cache_salt=body.cache_salt,
        routing_key=routing_key,
        tool_mode=tool_mode,
        trace_headers=trace_headers(headers or {}),
        conversation=is_conversation_turn(prompt.get("messages"), headers or {}),
    )


def _with_stream_headers(response: Response, stream: EngineStream | None, request_id: str | None) -> Response:
    if stream is not None:
        response.headers.update(stream.response_headers())
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


async def handle_generate(
    request: Request,
    body_cls: type[OpenAIRequest],
    client: EngineClient,
    options: FrontendOptions,
    routing_key: RoutingKeyFn | None = None,
) -> Response:
    """Serve one ``/v1/chat/completions`` or ``/v1/completions`` request through ``client``.

    ``routing_key``: computes the request's routing key from the parsed body and
    the headers (the ingress); raising ValueError makes the request a 400.
    """
    stream: EngineStream | None = None
    # Echoed on every answer; the generated engine id replaces it once the request is built.
    request_id: str | None = None
    try:
        request_id = client_id = client_request_id(request.headers)
        check_auth(request, options)
        data = api.parse_json_object(await read_body(request, options.max_body_bytes))
        body = api.validate_request(body_cls, data)
        info = await client.model_info()
        model = check_model(info, body.model)
        key = routing_key(data, request.headers) if routing_key is not None else None
        prepared = engine_request(body, info, key, client_id, request.headers)
        request_id = client_id or prepared.request_id
        REQUEST_ID.set(request_id)  # this task's log lines name the request (replica/log_json.py)
        log.info("request %s: %s, routing key %s", request_id, request.url.path, key)
        stream = client.open_stream(prepared)
        gen = Generation(prepared.request_id, stream)
        await start_generation(request, gen)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        echoed = request_id if options.echo_request_id else None
        return _with_stream_headers(error_response(exc, request_id), stream, echoed)
    echoed = request_id if options.echo_request_id else None
    return _with_stream_headers(await respond(request, gen, body, model, stream.token_text), stream, echoed)


async def handle_models(request: Request, client: EngineClient, options: FrontendOptions) -> JSONResponse:
    """``GET /v1/models``: the one served model."""
    check_auth(request, options)
    info = await client.model_info()
    card = api.ModelCard(id=info.model_name, root=info.model, max_model_len=info.max_model_len)
    return JSONResponse(api.ModelList(data=[card]).model_dump())


async def handle_health(client: EngineClient) -> Response:
    """``GET /health``: 200 while the engine can serve, else 503 with the OpenAI error body."""
    if await client.is_healthy():
        return Response(status_code=200)
    return error_response(api.ServiceUnavailableError("no engine is running", code="engine_dead"))
