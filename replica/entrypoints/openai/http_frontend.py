"""The OpenAI HTTP front end both hosts share: the standalone server and the Ray ingress.

Job: the FastAPI request plumbing and the endpoints' bodies, written once
against an :class:`EngineClient`: read the body (size limit), check the API key
and the model, build the :class:`EngineRequest`, start the engine stream while
watching for a disconnect, and answer (SSE or collected JSON, errors as the
OpenAI error body). ``replica/entrypoints/openai/server.py`` hosts it over a local AsyncEngine,
``router/serve/ingress.py`` over the engine deployment's Serve handle; each host adds
only what is its own (the server's replica header and watchdog, the ingress's
routing key, retries and headers).

Invariants:
* Every error is the OpenAI error body with the status ``replica/entrypoints/openai/protocol.py`` maps
  it to: no FastAPI 422s, no HTML pages.
* A request whose client goes away is aborted in the engine, so its KV blocks
  are freed: before its first token, while it is collected (non-streaming) and
  while it streams (Starlette cancels the body iterator on ``http.disconnect``;
  the iterator then closes the engine stream and aborts the request).
* The body is parsed once; the routing key is computed from that parse.
* A body not received whole within ``client_body_timeout_s`` is 408; a host's
  in-flight slot (:class:`InFlightSlot`) is taken only after the body is read.
* Every generation answer (errors included) carries ``X-Request-Id``: the
  client's own when it sent a valid one, else the id generated here. The
  answer's ``id`` is ``<id_prefix>-<client id>`` or the generated id; the
  engine request id adds a random suffix to the client's (as vLLM does), so
  concurrent requests with the same client id all run. Log lines name both.
* A client error (4xx, a client gone while its body is read) logs one line at
  info, never a traceback; only server errors (5xx) log at error.

Imports FastAPI and the replica's framework-free modules; never Ray, torch or
``router`` (the ingress passes its routing-key function in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from prefixserve.common.body_limits import DEFAULT_CLIENT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from prefixserve.common.logs import REQUEST_ID
from prefixserve.common.tracing import trace_headers
from prefixserve.replica.contract.continuation import STREAM_PROGRESS_HEADER
from prefixserve.replica.contract.request import EngineClient, EngineRequest, EngineStream, ModelInfo
from prefixserve.replica.engine.request_runner import is_conversation_turn
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai import serving as openai_serving
from prefixserve.replica.entrypoints.openai.protocol import OpenAIRequest
from prefixserve.replica.entrypoints.openai.request_fields import IgnoredFields
from prefixserve.replica.entrypoints.openai.serving import Generation
from prefixserve.replica.errors import (
    APIError,
    BadRequestError,
    HeaderFieldsTooLargeError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    PromptTooLongError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from prefixserve.replica.tool_calling.choice import check_auto_supported

log = logging.getLogger(__name__)

# Where a host that caps generation requests in flight puts the request's InFlightSlot (the ASGI scope).
IN_FLIGHT_SLOT_SCOPE_KEY = "prefixserve.in_flight_slot"
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
    ``client_body_timeout_s``: a body not received whole within this gets 408.
    ``max_header_count`` / ``max_header_bytes``: more header fields, or a request line
    and headers larger than this, get 431 before the API key is checked (None: not
    checked here; the standalone server refuses them in its HTTP protocol already).
    ``ignored_fields``: what becomes of a body's unknown top-level fields (ignored, logged
    once and counted, as vLLM does; refused when strict).
    ``tenant_of``: the host's tenants (its flow control): the name of the tenant a request's
    headers name, checked right after its API key, raising APIError when they name none;
    None: no tenants.
    """

    api_keys: tuple[bytes, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    echo_request_id: bool = True
    client_body_timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S
    max_header_count: int | None = None
    max_header_bytes: int | None = None
    ignored_fields: IgnoredFields = field(default_factory=IgnoredFields)
    tenant_of: Callable[[Mapping[str, str]], str] | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not self.client_body_timeout_s > 0:
            raise ValueError(f"client_body_timeout_s must be positive, got {self.client_body_timeout_s}")

    @classmethod
    def build(
        cls,
        api_keys: Sequence[str] | None,
        max_body_bytes: int,
        echo_request_id: bool = True,
        client_body_timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S,
        max_header_count: int | None = None,
        max_header_bytes: int | None = None,
        ignored_fields: IgnoredFields | None = None,
        tenant_of: Callable[[Mapping[str, str]], str] | None = None,
    ) -> FrontendOptions:
        return cls(
            tuple(k.encode("utf-8") for k in (api_keys or []) if k),
            max_body_bytes,
            echo_request_id,
            client_body_timeout_s,
            max_header_count,
            max_header_bytes,
            ignored_fields or IgnoredFields(),
            tenant_of,
        )


class InFlightSlot:
    """One generation request's claim on its host's in-flight cap, taken once its body is read.

    A host that caps generation requests (replica/entrypoints/openai/server.py) puts one in the
    request's ASGI scope under ``IN_FLIGHT_SLOT_SCOPE_KEY`` and releases it when
    the answer is sent; :func:`handle_generate` takes it after reading the body,
    so a client that sends its body slowly (or never) holds no slot.
    """

    def __init__(self, counter: InFlightCounter) -> None:
        self._counter = counter
        self.taken = False

    def take(self) -> None:
        """Take the slot, or raise OverloadedError (429, ``replica_busy``) when the cap is reached."""
        counter = self._counter
        if counter.cap is not None and counter.running >= counter.cap:
            raise OverloadedError(
                f"this replica has {counter.running} requests in flight (max_in_flight={counter.cap}); "
                "try the next replica",
                code="replica_busy",
                retry_after_s=counter.retry_after_s,
            )
        counter.running += 1
        self.taken = True

    def release(self) -> None:
        if self.taken:
            self.taken = False
            self._counter.running -= 1


@dataclass
class InFlightCounter:
    """Generation requests holding a slot (``running``), at most ``cap`` (None: no cap)."""

    cap: int | None = None
    retry_after_s: float = 1.0
    running: int = 0

    def __post_init__(self) -> None:
        if self.cap is not None and (isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1):
            raise ValueError(f"max_in_flight must be an integer >= 1, got {self.cap!r}")


# ---------------------------------------------------------------------------
# Request plumbing
# ---------------------------------------------------------------------------


async def read_body(request: Request, max_body_bytes: int, timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S) -> bytes:
    """The request body, refusing (413) one over ``max_body_bytes`` and (408) one not whole within ``timeout_s``.

    Both the declared Content-Length and the bytes actually received are checked,
    so a chunked or lying client cannot push more than the limit into memory.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, max_body_bytes)
    except TimeoutError:
        log.info("request body not received within %g s (client_body_timeout_s)", timeout_s)
        raise RequestTimeoutError(f"the request body did not arrive within {timeout_s:g} s") from None


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_len = int(declared)
        except ValueError:
            raise BadRequestError(f"invalid Content-Length header {declared!r}") from None
        if declared_len > max_body_bytes:
            raise PayloadTooLargeError(
                f"request body is {declared_len} bytes; this server accepts at most {max_body_bytes}"
            )
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_body_bytes:
                raise PayloadTooLargeError(f"request body exceeds {max_body_bytes} bytes, the most this server accepts")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected() from None
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
    try:
        return work_task.result()
    finally:
        # A raised error's traceback holds this frame, and the task holds the error: without the
        # del that cycle keeps the error and every frame below it (the prompt's token ids of a
        # refused request, megabytes) until the cyclic garbage collector runs.
        del work_task, watch_task


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """The OpenAI error answer to ``exc``, logged with ``request_id``: a server error at error
    (with its traceback unless it is an APIError), a client error as one line at info."""
    err = api.error_from_exception(exc)
    if err.status_code >= 500:
        log.error(
            "request %s failed: %s",
            request_id or "-",
            err.message,
            exc_info=exc if not isinstance(exc, APIError) else None,
        )
    else:
        log.info("request %s refused: %d %s: %s", request_id or "-", err.status_code, err.code, err.message)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(str(exc.detail), code=str(exc.status_code))
    err.status_code = exc.status_code
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


def add_error_handlers(app: FastAPI) -> None:
    """Answer Starlette's own errors (404, 405, ...) and every APIError with the OpenAI error body."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)


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
        progress = request.headers.get(STREAM_PROGRESS_HEADER) == "1"
        return StreamingResponse(
            openai_serving.sse_stream(gen, body, model, token_text, progress=progress), media_type="text/event-stream"
        )
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


def check_headers(request: Request, options: FrontendOptions) -> None:
    """Raise HeaderFieldsTooLargeError (431) when the request has more or larger headers than ``options`` allow."""
    headers = request.scope.get("headers") or []
    if options.max_header_count is not None and len(headers) > options.max_header_count:
        raise HeaderFieldsTooLargeError(
            f"the request has {len(headers)} header fields; this server accepts at most {options.max_header_count}"
        )
    if options.max_header_bytes is not None:
        size = len(request.scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in headers)
        if size > options.max_header_bytes:
            raise HeaderFieldsTooLargeError(
                f"the request line and headers exceed {options.max_header_bytes} bytes, the most this server accepts"
            )


def check_auth(request: Request, options: FrontendOptions) -> None:
    """Raise AuthenticationError (401) unless the request carries one of the accepted keys."""
    check_headers(request, options)
    openai_serving.check_api_key(request.headers.get("authorization", ""), options.api_keys)


def requested_model(data: Mapping[str, Any]) -> str | None:
    """The ``model`` a parsed request body names (None when it names none, or not as a string)."""
    model = data.get("model")
    return model if isinstance(model, str) else None


def check_model(info: ModelInfo, name: str | None) -> str:
    """The name answers carry: the adapter's when ``name`` is a served LoRA adapter, else the served
    model's; raise ModelNotFoundError (404) when ``name`` is neither."""
    if name is not None and not info.serves(name):
        served = ", ".join(repr(n) for n in [info.model_name, *(a for a, _ in info.adapters)])
        raise ModelNotFoundError(f"the model {name!r} does not exist on this server; it serves {served}", param="model")
    return info.adapter(name) or info.model_name


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``X-Request-Id`` (None when absent); BadRequestError (400) when it is not a valid id."""
    value = headers.get(REQUEST_ID_HEADER.lower())
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise BadRequestError(
            f"{REQUEST_ID_HEADER} must be 1 to 128 characters of letters, digits and ._:/+=-", code="invalid_request_id"
        )
    return value


def check_message_count(body_cls: type[OpenAIRequest], data: Mapping[str, Any], info: ModelInfo) -> None:
    """Refuse (400 context_length_exceeded) a chat of more messages than can fit, before validating them.

    Validating and rendering a message costs far more than counting it, so a chat of
    100,000 empty messages costs one ``len`` (``ModelInfo.max_messages``).
    """
    messages = data.get("messages")
    limit = info.max_messages
    if (
        "messages" in body_cls.model_fields
        and isinstance(messages, list)
        and limit is not None
        and len(messages) > limit
    ):
        raise api.error_from_exception(
            PromptTooLongError(
                f"the chat has {len(messages)} messages; at most {limit} fit this model's maximum context "
                f"length of {info.max_model_len} tokens (each renders some template tokens): send fewer"
            )
        )


def client_identity(request: Request, options: FrontendOptions) -> str | None:
    """Who sent ``request``, for per-client shares of the engine's shared work (EngineRequest.client).

    With API keys: a digest of the key (never the key itself: it travels to the engine
    and may be logged); requests under one key share one share, wherever they come from.
    Without: the connection's address (behind a proxy, the proxy's). None when neither is known.
    """
    if options.api_keys:
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return "key:" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    peer = request.client
    return f"addr:{peer.host}" if peer is not None and peer.host else None


def check_tool_count(body_cls: type[OpenAIRequest], data: Mapping[str, Any], info: ModelInfo) -> None:
    """Refuse (400) more tools than the engine takes (``max_tools_per_request``), before validating them.

    Every tool is a schema to validate and text to render: a count is all it costs to refuse
    1,000 of them (OpenAI's limit and message: 128).
    """
    tools = data.get("tools")
    limit = info.max_tools
    if "tools" in body_cls.model_fields and isinstance(tools, list) and limit is not None and len(tools) > limit:
        raise BadRequestError(
            f"Invalid 'tools': array too long. Expected an array with maximum length {limit}, but got an "
            f"array with length {len(tools)} instead (max_tools_per_request).",
            param="tools",
            code="array_above_max_length",
        )


# Tool schema checks (jsonschema, pure Python) run here, never on the event loop; two at a time, so
# many large tool lists queue for these threads instead of taking every thread of the process.
_TOOL_SCHEMA_CHECKS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefixserve-tools")


async def check_tool_schemas(body: OpenAIRequest, info: ModelInfo) -> None:
    """``ChatCompletionRequest.check_tool_schemas`` in a worker thread (the event loop keeps serving),
    bounded by ``info.max_tool_schema_nodes``."""
    if isinstance(body, api.ChatCompletionRequest) and body.tools:
        check = functools.partial(body.check_tool_schemas, info.max_tool_schema_nodes)
        await asyncio.get_running_loop().run_in_executor(_TOOL_SCHEMA_CHECKS, check)


def answer_id(body: OpenAIRequest, client_id: str | None, prepared: EngineRequest) -> str:
    """The answer's ``id``: a continued stream's own; ``<id_prefix>-<client id>`` for a client's
    X-Request-Id; else the engine's."""
    if body.prefixserve_continuation is not None:
        return body.prefixserve_continuation.id
    return prepared.request_id if client_id is None else f"{body.id_prefix}-{client_id}"


def engine_request(
    body: OpenAIRequest,
    info: ModelInfo,
    routing_key: str | None,
    client_id: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> EngineRequest:
    """What the engine is asked: the client's max_tokens, or the default the engine host fits to the prompt.

    ``client_id``: the client's X-Request-Id, which the engine request id then carries, with a
    random suffix: engine ids stay unique when clients reuse theirs.
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
                raise BadRequestError(str(exc), param="tool_choice", code="invalid_value") from None
    return EngineRequest(
        request_id=(
            api.new_id(body.id_prefix) if client_id is None else f"{body.id_prefix}-{client_id}-{uuid.uuid4().hex[:8]}"
        ),
        **prompt,
        sampling=body.to_sampling_params(default_max_tokens=default_max, max_model_len=info.max_model_len),
        max_tokens_default=None if body.requested_max_tokens() is not None else default_max,
        cache_salt=body.cache_salt,
        routing_key=routing_key,
        tool_mode=tool_mode,
        trace_headers=trace_headers(headers or {}),
        conversation=is_conversation_turn(prompt.get("messages"), headers or {}),
        priority=body.scheduling_priority(),
        lora_name=info.adapter(body.model),
        model=info.model_name,
        cache_retention=body.cache_retention(),
        continuation=(
            body.prefixserve_continuation.continuation() if body.prefixserve_continuation is not None else None
        ),
    )


def with_stream_headers(response: Response, stream: EngineStream | None, request_id: str | None) -> Response:
    """``response`` with the engine stream's headers (the replica that served it, ...) and ``X-Request-Id``."""
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
        tenant = options.tenant_of(request.headers) if options.tenant_of is not None else None
        data = api.parse_json_object(await read_body(request, options.max_body_bytes, options.client_body_timeout_s))
        slot = request.scope.get(IN_FLIGHT_SLOT_SCOPE_KEY)
        if slot is not None:
            slot.take()
        info = await client.model_info(requested_model(data))
        check_message_count(body_cls, data, info)
        check_tool_count(body_cls, data, info)
        data = options.ignored_fields.filter(body_cls, data)
        body = api.validate_request(body_cls, data, scheduling_policy=info.scheduling_policy, tool_schemas=False)
        await check_tool_schemas(body, info)
        model = check_model(info, body.model)
        key = routing_key(data, request.headers) if routing_key is not None else None
        prepared = engine_request(body, info, key, client_id, request.headers)
        prepared.client = client_identity(request, options)
        prepared.tenant = tenant
        request_id = client_id or prepared.request_id
        REQUEST_ID.set(request_id)  # this task's log lines name the request (common/logs.py)
        log.info("request %s (engine %s): %s, routing key %s", request_id, prepared.request_id, request.url.path, key)
        stream = client.open_stream(prepared)
        gen = Generation(answer_id(body, client_id, prepared), stream)
        await start_generation(request, gen)
    except ClientDisconnected:
        log.info("request %s: the client disconnected before its answer", request_id or "-")
        return Response(status_code=499)
    except Exception as exc:
        echoed = request_id if options.echo_request_id else None
        return with_stream_headers(error_response(exc, request_id), stream, echoed)
    echoed = request_id if options.echo_request_id else None
    return with_stream_headers(await respond(request, gen, body, model, stream.token_text), stream, echoed)


async def handle_models(request: Request, client: EngineClient, options: FrontendOptions) -> JSONResponse:
    """``GET /v1/models``: the served model, then its LoRA adapters (``parent``: the model), as vLLM lists them."""
    check_auth(request, options)
    cards = []
    for info in await client.models():
        cards.append(api.ModelCard(id=info.model_name, root=info.model, max_model_len=info.max_model_len))
        cards += [
            api.ModelCard(id=name, root=path, parent=info.model_name, max_model_len=info.max_model_len)
            for name, path in info.adapters
        ]
    return JSONResponse(api.ModelList(data=cards).model_dump())


async def handle_openapi(request: Request, app: FastAPI, options: FrontendOptions) -> JSONResponse:
    """``GET /openapi.json``: the application's OpenAPI schema, behind the API key like ``/v1/*``.

    Hosts build their app with ``openapi_url=None`` (and no /docs, /redoc) and route this instead,
    so that a key-protected server does not describe itself to anyone who asks.
    """
    check_auth(request, options)
    return JSONResponse(app.openapi())


async def handle_health(client: EngineClient) -> Response:
    """``GET /health``: 200 while the engine can serve, else 503 with the OpenAI error body."""
    if await client.is_healthy():
        return Response(status_code=200)
    return error_response(ServiceUnavailableError("no engine is running", code="engine_dead"))
