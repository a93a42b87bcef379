"""The standalone router and OpenAI's Responses API: a Responses body's routing key is its chat
request's (the replica's own translation), the usage and the id of a Responses answer are read off
the relayed bytes (JSON or the event stream), and a continuation goes to the replica that stored
its previous response."""

from __future__ import annotations

import json

import pytest

from prefixserve.replica.entrypoints.openai.responses_protocol import ResponsesRequest
from prefixserve.router.policies import make_policy
from prefixserve.router.routing_key import routing_key
from prefixserve.router.standalone.replica_set import ReplicaSet
from prefixserve.router.standalone.response_homes import ResponseHomes
from prefixserve.router.standalone.routing import StandaloneRouting
from prefixserve.router.standalone.usage import SSE_TAIL_BYTES, AnswerTail, Usage

TOOL = {"type": "function", "name": "lookup", "description": None, "parameters": {"type": "object"}, "strict": True}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "instructions": "Be terse.", "input": "hi"},
        {"model": "m", "instructions": "Be terse.", "input": "hi", "tools": [TOOL]},
        {"model": "m", "input": [{"role": "user", "content": "hi"}], "tools": [TOOL], "cache_salt": "s"},
        {"model": "m", "input": "hi", "prompt_cache_key": "agent-7"},
        {"model": "m", "input": "hi"},
    ],
)
def test_a_responses_body_is_keyed_as_the_chat_request_it_runs_as(body: dict) -> None:
    chat = ResponsesRequest.model_validate(body).chat_data([{"role": "user", "content": "hi"}])
    assert routing_key(body) == routing_key(chat)


def _response(response_id: str, instructions: str = "") -> dict:
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 7}
    return {"id": response_id, "object": "response", "instructions": instructions, "usage": usage}


def test_the_usage_and_id_of_a_json_responses_answer() -> None:
    tail = AnswerTail(sse=False)
    tail.add(json.dumps(_response("resp_1")).encode())
    assert tail.usage() == Usage(40, 32, 7) and tail.response_id() == "resp_1"
    chat = AnswerTail(sse=False)
    chat.add(json.dumps({"id": "chatcmpl-1", "object": "chat.completion"}).encode())
    assert chat.response_id() is None


def _event(kind: str, payload: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


def test_the_usage_and_id_of_a_streamed_responses_answer_whatever_its_length() -> None:
    long = "x" * (4 * SSE_TAIL_BYTES)  # the last event repeats the instructions: longer than the tail
    created = _event("response.created", {"response": _response("resp_2", long)})
    deltas = b"".join(_event("response.output_text.delta", {"delta": "a"}) for _ in range(50))
    completed = _event("response.completed", {"response": _response("resp_2", "short")})
    tail = AnswerTail(sse=True)
    for chunk in (created[:100], created[100:], deltas, completed):
        tail.add(chunk)
    assert tail.response_id() == "resp_2" and tail.usage() == Usage(40, 32, 7)
    cut = AnswerTail(sse=True)
    cut.add(created + _event("response.completed", {"response": _response("resp_2", long)}))
    assert cut.response_id() == "resp_2" and cut.usage() is None  # the last event is cut: no usage


def test_homes_are_bounded_least_recently_used_first_out() -> None:
    homes = ResponseHomes(max_entries=2)
    homes.remember("a", "r1")
    homes.remember("b", "r2")
    assert homes.home("a") == "r1"  # a is now the most recent
    homes.remember("c", "r1")
    assert homes.home("b") is None and homes.home("a") == "r1" and len(homes) == 2
    homes.forget("a")
    assert homes.home("a") is None
    with pytest.raises(ValueError):
        ResponseHomes(0)


@pytest.mark.parametrize("policy", ["placed", "round_robin"])
def test_a_continuation_goes_first_to_the_replica_that_stored_its_previous_response(policy: str) -> None:
    names = ["a:1", "b:2", "c:3"]
    routing = StandaloneRouting(make_policy(policy), ReplicaSet({n: f"http://{n}" for n in names}))
    body = {"model": "m", "instructions": "Be terse.", "input": "more"}
    first = routing.plan(body, {})
    home = next(n for n in names if n != first.first)
    routing.response_homes.remember("resp_9", home)
    plan = routing.plan({**body, "previous_response_id": "resp_9"}, {})
    assert plan.first == home and sorted(plan.ranking) == sorted(first.ranking)
    assert routing.plan({**body, "previous_response_id": "resp_unknown"}, {}).ranking[0] in names
