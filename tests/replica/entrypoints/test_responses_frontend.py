"""/v1/responses in process (replica/entrypoints/openai/responses_endpoint.py over a real tiny engine): fast tests.

What the slow tests/replica/entrypoints/test_responses_api.py cannot show cheaply: tenants as
owners (the standalone server has none; the ingress has), the record of the replica that
answered, X-Request-Id, a response too large to store, the store's gauges, and how a stream
ends when its client goes or its engine fails.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi import FastAPI
from server_helpers import assert_openai_error

from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.engine.request_runner import LocalEngineClient, LocalStream
from prefixserve.replica.entrypoints.openai import http_frontend
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai import responses_protocol as rp
from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions
from prefixserve.replica.entrypoints.openai.response_store import ResponseStore
from prefixserve.replica.entrypoints.openai.responses_endpoint import ResponsesEndpoints
from prefixserve.replica.entrypoints.openai.responses_stream import response_events
from prefixserve.replica.entrypoints.openai.serving import Generation
from prefixserve.replica.errors import RequestFailedError
from prefixserve.router.flow_control.controller import FlowController
from prefixserve.router.flow_control.tenants import tenants_from_data

# conftest's replica (the standalone server's app in process) with a store of this many bytes.
STORE_BYTES = 4096
REPLICA_OPTIONS = dict(max_model_len=256, response_store=ResponseStore(max_bytes=STORE_BYTES))
TENANTS = {
    "tenant_header": "x-tenant",
    "tenants": [{"name": "acme", "header_value": "A"}, {"name": "globex", "header_value": "G"}],
}
ACME, GLOBEX = {"x-tenant": "A"}, {"x-tenant": "G"}
ENGINE_REPLICA = "app#Engine#rank-7"


def create(replica, headers: dict | None = None, **body) -> httpx.Response:
    return replica.request("POST", "/v1/responses", json={"max_output_tokens": 4, **body}, headers=headers or {})


def sse_events(text: str) -> list[dict]:
    """The events of an SSE body, checking each ``event:`` line names its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def test_a_client_request_id_names_the_response_and_is_echoed(replica):
    ok = create(replica, {"x-request-id": "trace-7"}, input="hi")
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-7"
    assert ok.json()["id"] == "resp_trace-7"
    assert replica.request("GET", "/v1/responses/resp_trace-7").json()["id"] == "resp_trace-7"
    streamed = create(replica, {"x-request-id": "trace-8"}, input="hi", stream=True)
    assert streamed.headers["x-request-id"] == "trace-8"
    assert sse_events(streamed.text)[-1]["response"]["id"] == "resp_trace-8"
    generated = create(replica, input="hi")
    assert generated.headers["x-request-id"] == generated.json()["id"]
    bad = create(replica, {"x-request-id": "a b"}, input="hi")
    assert assert_openai_error(bad)["code"] == "invalid_request_id"


def test_a_response_too_large_to_store_is_answered_and_not_stored(replica):
    # metadata is echoed on the Response: larger than the whole store.
    metadata = {f"k{i}": "x" * 500 for i in range(10)}
    big = create(replica, input="hi", metadata=metadata)
    assert big.status_code == 200 and big.json()["metadata"] == metadata
    assert replica.request("GET", f"/v1/responses/{big.json()['id']}").status_code == 404
    missing = create(replica, input="more", previous_response_id=big.json()["id"])
    assert assert_openai_error(missing)["code"] == "previous_response_not_found"
    small = create(replica, input="hi")
    assert replica.request("GET", f"/v1/responses/{small.json()['id']}").status_code == 200


def test_the_store_size_is_on_metrics_within_its_bound(replica):
    from server_helpers import metric

    for _ in range(3):
        assert create(replica, input="hello there").status_code == 200
    text = replica.request("GET", "/metrics").text
    entries = metric(text, "prefixserve:response_store_entries")
    size = metric(text, "prefixserve:response_store_bytes")
    assert entries >= 1 and 0 < size <= STORE_BYTES


def test_a_chat_error_names_the_responses_field(replica):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    duplicate = create(replica, input="hi", tools=[tool, tool])
    assert assert_openai_error(duplicate)["param"] == "tools.1.name"
    schema = create(replica, input="hi", tools=[{**tool, "parameters": {"type": 5}}])
    assert assert_openai_error(schema)["param"] == "tools.0.parameters"
    unknown_call = create(replica, input=[{"type": "function_call_output", "call_id": "call_x", "output": "?"}])
    error = assert_openai_error(unknown_call)
    assert error["param"] == "input" and "call_x" in error["message"]
    too_long = create(replica, input="word " * 400)
    assert assert_openai_error(too_long)["code"] == "context_length_exceeded"
    assert too_long.json()["error"]["param"] == "input"


class NamingClient:
    """The local engine client, its streams naming an engine replica as the ingress's streams do; it keeps
    the engine requests it opened."""

    def __init__(self, client: LocalEngineClient) -> None:
        self.client = client
        self.requests: list[EngineRequest] = []

    async def model_info(self, name: str | None = None) -> ModelInfo:
        return await self.client.model_info(name)

    async def models(self) -> list[ModelInfo]:
        return await self.client.models()

    async def is_healthy(self) -> bool:
        return await self.client.is_healthy()

    def open_stream(self, request: EngineRequest) -> LocalStream:
        self.requests.append(request)
        stream = self.client.open_stream(request)
        headers = stream.response_headers
        stream.response_headers = lambda: {**headers(), REPLICA_HEADER: ENGINE_REPLICA}  # type: ignore[method-assign]
        return stream


@pytest.fixture(scope="module")
def tenant_host(replica):
    """A host of the endpoints with tenants (as the ingress with a tenant file), over the module's engine."""
    controller = FlowController(tenants_from_data(TENANTS))
    options = FrontendOptions(tenant_of=lambda headers: controller.tenant_of(None, headers).name)
    client = NamingClient(LocalEngineClient(replica.engine))
    endpoints = ResponsesEndpoints(client, options, ResponseStore())
    app = FastAPI()
    http_frontend.add_error_handlers(app)

    endpoints.add_routes(app)

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host", timeout=120)

    def request(method: str, path: str, **kwargs: object) -> httpx.Response:
        return replica.loop.run_until_complete(http.request(method, path, **kwargs))  # type: ignore[arg-type]

    yield request, endpoints, client
    replica.loop.run_until_complete(http.aclose())


def test_a_tenants_response_is_not_found_for_another_tenant(tenant_host):
    request, endpoints, _ = tenant_host
    body = {"input": "hi", "max_output_tokens": 4}
    mine = request("POST", "/v1/responses", json=body, headers=ACME).json()
    continued = {**body, "previous_response_id": mine["id"]}
    theirs = request("POST", "/v1/responses", json=continued, headers=GLOBEX)
    assert theirs.status_code == 404 and theirs.json() == {
        "error": {
            "message": f"Previous response with id '{mine['id']}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    }
    assert request("GET", f"/v1/responses/{mine['id']}", headers=GLOBEX).status_code == 404
    assert request("DELETE", f"/v1/responses/{mine['id']}", headers=GLOBEX).status_code == 404
    # A request naming no tenant is refused before anything is looked up.
    assert request("GET", f"/v1/responses/{mine['id']}").status_code == 403
    assert request("GET", f"/v1/responses/{mine['id']}", headers=ACME).json() == mine
    assert request("POST", "/v1/responses", json=continued, headers=ACME).status_code == 200
    assert endpoints.store.get(mine["id"], "tenant:acme") is not None


def test_the_record_names_the_replica_and_a_continuation_is_a_conversation_turn(tenant_host):
    request, endpoints, client = tenant_host
    first = request("POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 4}, headers=ACME)
    assert first.headers[REPLICA_HEADER] == ENGINE_REPLICA
    record = endpoints.store.get(first.json()["id"], "tenant:acme")
    assert record is not None and record.replica == ENGINE_REPLICA
    assert record.conversation() == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.json()["output"][0]["content"][0]["text"]},
    ]
    assert client.requests[-1].conversation is False and client.requests[-1].tenant == "acme"
    body = {"input": "more", "previous_response_id": first.json()["id"], "max_output_tokens": 4, "stream": True}
    second = request("POST", "/v1/responses", json=body, headers=ACME)
    assert sse_events(second.text)[-1]["type"] in ("response.completed", "response.incomplete")
    assert client.requests[-1].conversation is True
    assert [m["role"] for m in client.requests[-1].messages] == ["user", "assistant", "user"]


class ScriptedStream:
    """An engine stream that sends one text delta, then fails or waits forever; it records its close."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.sent = False
        self.closed = False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self.sent:
            self.sent = True
            return StreamDelta("r", 0, "hi", [5], None, 3, 0, 1)
        if self.fail:
            raise RequestFailedError("the engine failed this request")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


def _response() -> rp.ResponseObject:
    body = api.validate_request(rp.ResponsesRequest, {"input": "x", "stream": True})
    return body.response("resp_test", "m", status="in_progress")


async def _events(fail: bool, drop: bool) -> tuple[ScriptedStream, list[str], list[rp.ResponseObject]]:
    stream = ScriptedStream(fail)
    gen = Generation("resp_test", stream)
    await gen.start()
    stored: list[rp.ResponseObject] = []
    events = response_events(gen, _response(), stored.append)
    sent = []
    async for line in events:
        sent.append(line)
        if drop and "response.output_text.delta" in line:
            await events.aclose()  # the client went away while the engine still generates
            break
    return stream, sent, stored


def test_a_dropped_stream_closes_the_engine_stream_and_stores_nothing(caplog):
    caplog.set_level(logging.INFO)
    stream, sent, stored = asyncio.run(_events(fail=False, drop=True))
    assert stream.closed and not stored
    assert "response.created" in sent[0] and "response.output_text.delta" in sent[-1]
    assert "disconnected mid-stream" in caplog.text and "Traceback" not in caplog.text


def test_an_engine_failure_mid_stream_ends_with_an_error_and_response_failed():
    stream, sent, stored = asyncio.run(_events(fail=True, drop=False))
    events = sse_events("".join(sent))
    assert stream.closed and not stored
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "internal_error" and events[-2]["message"] == "the engine failed this request"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error",
        "message": "the engine failed this request",
    }


def test_text_then_calls_stream_as_items_in_order_each_closed_before_the_next():
    from prefixserve.replica.entrypoints.openai.responses_stream import EventWriter, OutputBuilder
    from prefixserve.replica.tool_calling.stream import ToolCallDelta

    builder = OutputBuilder(EventWriter())
    lines = [
        *builder.text("Let me "),
        *builder.text("look."),
        *builder.call(ToolCallDelta(0, '{"city":', id="call_1", name="get_weather")),
        *builder.call(ToolCallDelta(0, '"Oslo"}')),
        *builder.call(ToolCallDelta(1, "{}", id="call_2", name="now")),
        *builder.close("tool_calls"),
    ]
    events = sse_events("".join(lines))
    assert [(e["type"].removeprefix("response."), e["output_index"]) for e in events] == [
        ("output_item.added", 0),
        ("content_part.added", 0),
        ("output_text.delta", 0),
        ("output_text.delta", 0),
        ("output_text.done", 0),
        ("content_part.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1),
        ("function_call_arguments.delta", 1),
        ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1),
        ("output_item.done", 1),
        ("output_item.added", 2),
        ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2),
        ("output_item.done", 2),
    ]
    message, first, second = builder.items
    assert isinstance(message, rp.OutputMessage) and message.content[0].text == "Let me look."
    assert (first.call_id, first.name, first.arguments) == ("call_1", "get_weather", '{"city":"Oslo"}')
    assert (second.call_id, second.arguments, second.status) == ("call_2", "{}", "completed")
    assert events[10]["arguments"] == '{"city":"Oslo"}' and events[10]["item_id"] == first.id
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
