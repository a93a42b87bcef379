"""Large ``tools`` lists cannot freeze a replica: the count is capped before validation, the schema
checks are bounded and run off the event loop, and the tools count in the prompt's size bound."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import pytest
from server_helpers import assert_openai_error

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import PromptTooLongError

MAX_MODEL_LEN = 128
REPLICA_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, replica_name="tool-limits")
USER = [{"role": "user", "content": "hi"}]


def tool(i: int, props: int, description: int = 10) -> dict:
    """A function of ``props`` string parameters."""
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "d" * description,
            "parameters": {
                "type": "object",
                "properties": {f"f{j}": {"type": "string", "description": "x" * description} for j in range(props)},
                "required": [f"f{j}" for j in range(props)],
            },
        },
    }


async def race(
    replica, bodies: dict[str, dict], on_answer: dict[str, Callable[[], None]] | None = None
) -> tuple[list[str], dict]:
    """Send every body at once on the replica's loop; the names in the order their answers came, and the
    answers. ``on_answer[name]`` is called when that body's answer arrives."""
    order: list[str] = []

    async def send(name: str, body: dict):
        response = await replica.http.post("/v1/chat/completions", json=body)
        order.append(name)
        (on_answer or {}).get(name, lambda: None)()
        return name, response

    tasks = [asyncio.ensure_future(send(name, body)) for name, body in bodies.items()]
    answers = dict(await asyncio.wait_for(asyncio.gather(*tasks), timeout=600))  # a hang guard
    return order, answers


NORMAL = {"messages": USER, "max_tokens": 2, "temperature": 0}


def test_a_3mb_tools_body_is_400_by_count_and_a_concurrent_request_is_answered(replica):
    tools = [tool(i, 60) for i in range(1000)]
    body = {"messages": USER, "tools": tools, "tool_choice": "none", "max_tokens": 2}
    assert len(json.dumps(body)) > 3_000_000
    _, answers = replica.loop.run_until_complete(race(replica, {"big": body, "normal": NORMAL}))
    err = assert_openai_error(answers["big"])
    assert answers["big"].status_code == 400 and err["code"] == "array_above_max_length", err
    assert err["param"] == "tools" and "maximum length 128" in err["message"]
    assert answers["normal"].status_code == 200, answers["normal"].text


def test_schema_checks_run_off_the_event_loop(replica, monkeypatch):
    # Under every bound (128 tools, 5,632 schema nodes), so every schema is checked. The check is held
    # until the normal request has its answer: that answer can only come while the check waits if the
    # check is off the event loop (on it, the wait would block the loop and time out). Then the tools,
    # over the prompt's character bound, are refused without being rendered.
    normal_answered = threading.Event()
    released: list[bool] = []
    check = api.ChatCompletionRequest.check_tool_schemas

    def held_check(self, max_nodes=None):
        released.append(normal_answered.wait(timeout=60))  # a hang guard, not a timing
        return check(self, max_nodes)

    monkeypatch.setattr(api.ChatCompletionRequest, "check_tool_schemas", held_check)
    tools = [tool(i, 10) for i in range(128)]
    big = {"messages": USER, "tools": tools, "tool_choice": "none", "max_tokens": 2}
    order, answers = replica.loop.run_until_complete(
        race(replica, {"big": big, "normal": NORMAL}, on_answer={"normal": normal_answered.set})
    )
    assert released == [True]
    assert answers["normal"].status_code == 200, answers["normal"].text
    err = assert_openai_error(answers["big"])
    assert answers["big"].status_code == 400 and err["code"] == "context_length_exceeded", err
    assert order == ["normal", "big"]


def test_schema_nodes_are_bounded_before_any_check(replica):
    tools = [tool(i, 60) for i in range(128)]  # 31,232 nodes
    r = replica.request("POST", "/v1/chat/completions", json={**NORMAL, "tools": tools, "tool_choice": "none"})
    err = assert_openai_error(r)
    assert r.status_code == 400 and "max_tool_schema_nodes" in err["message"] and err["param"] == "tools", err


def test_an_invalid_schema_is_still_400_naming_the_tool(replica):
    tools = [tool(0, 2), {"type": "function", "function": {"name": "g", "parameters": {"type": "objekt"}}}]
    r = replica.request("POST", "/v1/chat/completions", json={**NORMAL, "tools": tools, "tool_choice": "none"})
    err = assert_openai_error(r)
    assert r.status_code == 400 and err["param"] == "tools.1.function.parameters", err


def test_required_with_no_tools_is_400(replica):
    r = replica.request("POST", "/v1/chat/completions", json={**NORMAL, "tools": [], "tool_choice": "required"})
    err = assert_openai_error(r)
    assert r.status_code == 400 and err["param"] == "tools", err


def test_the_tools_count_in_the_prompt_size_check(replica):
    processor = replica.engine.engine.input_processor
    assert processor.max_prompt_chars is not None
    long_description = "y" * (processor.max_prompt_chars + 1)
    request = EngineRequest(
        messages=USER, tools=[{"type": "function", "function": {"name": "f", "description": long_description}}]
    )
    with pytest.raises(PromptTooLongError, match="characters"):
        processor.check_prompt_size(request)
    processor.check_prompt_size(EngineRequest(messages=USER, tools=[tool(0, 2)]))  # small tools pass


def test_the_tool_bounds_are_knobs(ckpt):
    from server_helpers import InProcessReplica

    r = InProcessReplica(ckpt, max_model_len=512, engine_kwargs={"max_tools_per_request": 2})
    try:
        body = {**NORMAL, "tools": [tool(i, 1) for i in range(3)], "tool_choice": "none"}
        answer = r.request("POST", "/v1/chat/completions", json=body)
        assert answer.status_code == 400 and "maximum length 2" in answer.json()["error"]["message"]
        body["tools"] = body["tools"][:2]
        answer = r.request("POST", "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
    finally:
        r.close()
