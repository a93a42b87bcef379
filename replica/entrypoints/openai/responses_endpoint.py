"""The ``/v1/responses`` endpoints of the OpenAI front end: create, retrieve, delete.

Job: serve OpenAI's Responses API over the chat path of ``http_frontend.py``, written once
against an :class:`EngineClient` and :class:`FrontendOptions` as ``handle_generate`` is, so
that both hosts (the standalone server, the Ray ingress) serve it. A request is translated
into a chat request (responses_protocol.py), which the chat machinery validates, routes and
generates exactly as a ``/v1/chat/completions`` request (auth, tenants, request ids, limits,
priority, tool calling, disconnects); its answer is translated back into a Response object,
collected or streamed (responses_stream.py), and stored in the host's :class:`ResponseStore`
when ``store`` is true (OpenAI's default).

Invariants:
* Every stored response has an owner: the request's tenant when the host has tenants, else
  the digest of its API key when the host checks keys, else none. A ``previous_response_id``
  and GET / DELETE find only the sender's own responses; one that does not exist, was not
  stored, was evicted or is another owner's is the same 404 (OpenAI's body: ``param``
  ``previous_response_id``, code ``previous_response_not_found``), so no answer reveals
  anything of another owner's response.
* A continuation runs as the stored conversation plus its new input, with its own
  ``instructions`` (a stored response's are not carried over, as OpenAI's are not) and its own
  tools; its engine request is a conversation turn. The stored record names the engine
  replica that answered (the stream's ``X-Prefixserve-Replica`` header, when it has one), so
  that a router may send the continuation there.
* The answer's ``id`` is ``resp_`` and 32 hex digits, or ``resp_<client id>`` for a client's
  ``X-Request-Id`` (the rule of handle_generate); the engine request id is the generated id,
  or the client's with a random suffix.
* A host of several replicas, each with its store (the ingress), asks the others (``OtherStores``)
  when its own store misses, so a continuation, GET or DELETE finds a response whichever
  replica took it.
* Errors of the chat translation name the Responses fields (``input``, ``tools.N.parameters``,
  ``max_output_tokens``, ``text.format``), not the chat's.

Imports FastAPI and the front end's framework-free modules; never Ray, torch or ``router``.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixserve.common.logs import REQUEST_ID
from prefixserve.replica.contract.request import EngineClient, EngineStream, ModelInfo
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai import responses_protocol as rp
from prefixserve.replica.entrypoints.openai import serving as openai_serving
from prefixserve.replica.entrypoints.openai.http_frontend import (
    IN_FLIGHT_SLOT_SCOPE_KEY,
    ClientDisconnected,
    FrontendOptions,
    RoutingKeyFn,
    check_auth,
    check_message_count,
    check_model,
    check_tool_count,
    check_tool_schemas,
    client_identity,
    client_request_id,
    engine_request,
    error_response,
    read_body,
    requested_model,
    start_generation,
    until_disconnect,
    with_stream_headers,
)
from prefixserve.replica.entrypoints.openai.response_store import ResponseStore, StoredResponse
from prefixserve.replica.entrypoints.openai.responses_stream import response_events
from prefixserve.replica.entrypoints.openai.serving import Generation
from prefixserve.replica.errors import NotFoundError

log = logging.getLogger(__name__)

RESPONSE_ID_PREFIX = "resp"

# Chat fields in an error's param, and the Responses fields they came from.
_PARAM_NAMES = (
    (re.compile(r"^messages(\.|$).*"), "input"),
    (re.compile(r"^tools\.(\d+)\.function\.(.*)$"), r"tools.\1.\2"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format(\.|$).*"), "text.format"),
)


def previous_not_found(response_id: str) -> NotFoundError:
    """OpenAI's 404 for a previous_response_id this sender cannot continue."""
    return NotFoundError(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def response_not_found(response_id: str) -> NotFoundError:
    """The 404 of GET or DELETE for a response this sender does not have."""
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def owner_of(request: Request, options: FrontendOptions, tenant: str | None) -> str | None:
    """Who owns what ``request`` stores: its tenant, else its API key's digest, else nobody."""
    if tenant is not None:
        return f"tenant:{tenant}"
    if options.api_keys:
        return client_identity(request, options)
    return None


def _responses_error(exc: BaseException) -> BaseException:
    """``exc``, or when it is a client error whose param names a chat field, that error naming the
    Responses field it came from."""
    err = api.error_from_exception(exc)
    if err.status_code >= 500 or err.param is None:
        return exc
    for pattern, name in _PARAM_NAMES:
        if pattern.match(err.param):
            renamed = pattern.sub(name, err.param)
            out = type(err)(err.message.replace(err.param, renamed), param=renamed, code=err.code)
            out.retry_after_s = err.retry_after_s
            return out
    return exc


def _check_counts(data: Mapping[str, Any], info: ModelInfo) -> None:
    """The chat's cheap count checks (items, tools) on the raw body, before its items are validated."""
    items = data.get("input")
    check_message_count(api.ChatCompletionRequest, {"messages": items}, info)
    check_tool_count(api.ChatCompletionRequest, data, info)


class OtherStores(Protocol):
    """The stores of a host's other replicas, asked when its own store misses."""

    async def find(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """``owner``'s response ``response_id`` in another replica's store; None when none has it."""
        ...

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Remove ``owner``'s response ``response_id`` from the other stores; whether one held it."""
        ...


class ResponsesEndpoints:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}`` over one host's store.

    ``routing_key``: the host's routing key of the chat body a response runs as (the ingress's).
    ``others``: the stores of the host's other replicas, when it has some.
    """

    def __init__(
        self,
        client: EngineClient,
        options: FrontendOptions,
        store: ResponseStore,
        routing_key: RoutingKeyFn | None = None,
        others: OtherStores | None = None,
    ) -> None:
        self.client = client
        self.options = options
        self.store = store
        self.routing_key = routing_key
        self.others = others

    def add_routes(self, app: FastAPI) -> None:
        """The three endpoints on ``app`` (a host built as a function; the Ray ingress routes its
        class's methods to them)."""
        app.post("/v1/responses")(self.create)

        @app.get("/v1/responses/{response_id}")
        async def retrieve(request: Request, response_id: str) -> Response:
            return await self.retrieve(request, response_id)

        @app.delete("/v1/responses/{response_id}")
        async def delete(request: Request, response_id: str) -> Response:
            return await self.delete(request, response_id)

    async def _find(self, response_id: str, owner: str | None) -> StoredResponse | None:
        entry = self.store.get(response_id, owner)
        if entry is None and self.others is not None:
            entry = await self.others.find(response_id, owner)
        return entry

    async def create(self, request: Request) -> Response:
        """Serve one ``POST /v1/responses``."""
        options = self.options
        stream: EngineStream | None = None
        request_id: str | None = None
        try:
            request_id = client_id = client_request_id(request.headers)
            check_auth(request, options)
            tenant = options.tenant_of(request.headers) if options.tenant_of is not None else None
            owner = owner_of(request, options, tenant)
            data = api.parse_json_object(
                await read_body(request, options.max_body_bytes, options.client_body_timeout_s)
            )
            slot = request.scope.get(IN_FLIGHT_SLOT_SCOPE_KEY)
            if slot is not None:
                slot.take()
            info = await self.client.model_info(requested_model(data))
            _check_counts(data, info)
            data = options.ignored_fields.filter(rp.ResponsesRequest, data)
            body = api.validate_request(rp.ResponsesRequest, data, scheduling_policy=info.scheduling_policy)
            history: list[dict[str, Any]] = []
            previous: StoredResponse | None = None
            if body.previous_response_id is not None:
                previous = await self._find(body.previous_response_id, owner)
                if previous is None:
                    raise previous_not_found(body.previous_response_id)
                history = previous.conversation()
            conversation = body.turn_messages(history)
            chat_data = body.chat_data(conversation)
            check_message_count(api.ChatCompletionRequest, chat_data, info)
            chat = api.validate_request(
                api.ChatCompletionRequest, chat_data, scheduling_policy=info.scheduling_policy, tool_schemas=False
            )
            await check_tool_schemas(chat, info)
            model = check_model(info, chat.model)
            key = self.routing_key(chat_data, request.headers) if self.routing_key is not None else None
            prepared = engine_request(chat, info, key, client_id, request.headers)
            if client_id is None:
                response_id = prepared.request_id = rp.new_item_id(RESPONSE_ID_PREFIX)
            else:
                response_id = f"{RESPONSE_ID_PREFIX}_{client_id}"
                prepared.request_id = f"{response_id}-{uuid.uuid4().hex[:8]}"
            prepared.client = client_identity(request, options)
            prepared.tenant = tenant
            prepared.conversation = prepared.conversation or body.previous_response_id is not None
            prepared.home_replica = previous.replica if previous is not None else None
            request_id = client_id or prepared.request_id
            REQUEST_ID.set(request_id)
            log.info(
                "request %s (engine %s): %s, routing key %s", request_id, prepared.request_id, request.url.path, key
            )
            stream = self.client.open_stream(prepared)
            gen = Generation(response_id, stream)
            await start_generation(request, gen)
        except ClientDisconnected:
            log.info("request %s: the client disconnected before its answer", request_id or "-")
            return Response(status_code=499)
        except Exception as exc:
            echoed = request_id if options.echo_request_id else None
            return with_stream_headers(error_response(_responses_error(exc), request_id), stream, echoed)
        echoed = request_id if options.echo_request_id else None
        answer = await self._answer(request, gen, body, chat, model, _Turn(conversation, owner, stream))
        return with_stream_headers(answer, stream, echoed)

    async def _answer(
        self,
        request: Request,
        gen: Generation,
        body: rp.ResponsesRequest,
        chat: api.ChatCompletionRequest,
        model: str,
        turn: _Turn,
    ) -> Response:
        """The answer to a started generation: the event stream when ``body.stream``, else the Response."""
        response = body.response(gen.request_id, model, status="in_progress")

        def finished(final: rp.ResponseObject) -> None:
            if body.store:
                self._keep(final, turn)

        if body.stream:
            return StreamingResponse(response_events(gen, response, finished), media_type="text/event-stream")
        try:
            answer = await until_disconnect(
                request, openai_serving.collect_response(gen, chat, model, turn.stream.token_text)
            )
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            return error_response(_responses_error(exc), gen.request_id)
        assert isinstance(answer, api.ChatCompletionResponse)
        choice = answer.choices[0]
        status = rp.finished_status(choice.finish_reason)
        final = response.model_copy(
            update={
                "status": status,
                "incomplete_details": rp.IncompleteDetails() if status == "incomplete" else None,
                "output": rp.output_items(choice.message, choice.finish_reason),
                "usage": rp.ResponseUsage.of(answer.usage),
            }
        )
        finished(final)
        return JSONResponse(final.model_dump())

    def _keep(self, final: rp.ResponseObject, turn: _Turn) -> None:
        """Store ``final`` with the conversation it ended, its owner and the replica that answered it."""
        entry = StoredResponse.build(
            final.id,
            final.model_dump(),
            [*turn.conversation, *rp.output_messages(final.output)],
            owner=turn.owner,
            replica=turn.stream.response_headers().get(REPLICA_HEADER),
        )
        if not self.store.put(entry):
            log.warning(
                "response %s not stored: %d bytes, over the store's bound of %d (or its id is taken)",
                final.id,
                entry.size,
                self.store.max_bytes,
            )

    async def retrieve(self, request: Request, response_id: str) -> Response:
        """Serve ``GET /v1/responses/{response_id}``: the stored Response object."""
        try:
            entry = await self._find(response_id, self._owner(request))
            if entry is None:
                raise response_not_found(response_id)
        except Exception as exc:
            return error_response(exc)
        return Response(entry.response_json, media_type="application/json")

    async def delete(self, request: Request, response_id: str) -> Response:
        """Serve ``DELETE /v1/responses/{response_id}``."""
        try:
            owner = self._owner(request)
            deleted = self.store.delete(response_id, owner)
            if not deleted and self.others is not None:
                deleted = await self.others.delete(response_id, owner)
            if not deleted:
                raise response_not_found(response_id)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _owner(self, request: Request) -> str | None:
        """The owner ``request`` reads as, after its key (and tenant) are checked."""
        check_auth(request, self.options)
        tenant = self.options.tenant_of(request.headers) if self.options.tenant_of is not None else None
        return owner_of(request, self.options, tenant)


@dataclass(frozen=True)
class _Turn:
    """What storing a response needs of its request: the conversation it continued (without
    ``instructions``, with its input), its owner and the engine stream that answered it."""

    conversation: list[dict[str, Any]]
    owner: str | None
    stream: EngineStream
