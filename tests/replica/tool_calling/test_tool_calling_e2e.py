"""Tool calling end to end: the official ``openai`` client against a real standalone replica with SmolLM2.

``tool_choice="required"`` and a named function constrain decoding to the tools'
schemas, so the returned ``tool_calls`` always carry arguments that validate
(jsonschema), collected and streamed; a full agent loop (call, tool result,
answer) runs against the one replica. Greedy, small ``max_tokens``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import ReplicaProcess, metric
from tool_helpers import NAMED, QUESTION, TOOLS, WEATHER, streamed_tool_calls, valid_arguments

openai = pytest.importorskip("openai")
# Constrained decoding (the grammar compiler of replica/structured_output/) is what makes the arguments parse.
pytest.importorskip("prefixserve.replica.structured_output.compile")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_replica(tmp_path_factory):
    """A real replica process serving SmolLM2 with the hermes tool parser (not conftest's in-process tiny replica)."""
    with ReplicaProcess(
        "smollm2",
        "--max-model-len",
        "2048",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as proc:
        yield proc
        assert proc.returncode is None, f"the replica died during the tests:\n{proc.log_tail()}"


@pytest.fixture()
def client(smollm2_replica):
    with openai.OpenAI(base_url=f"{smollm2_replica.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_have_arguments_that_validate_collected_and_streamed(client, tool_choice):
    kwargs = dict(
        model="smollm2",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    # OpenAI's (and vLLM's) finish reasons: "tool_calls" for required, "stop" for a named function.
    finish_reason = "tool_calls" if tool_choice == "required" else "stop"
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == finish_reason, choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    if tool_choice != "required":
        assert calls[0].function.name == "find_flights"
    collected = valid_arguments(calls[0].function.name, calls[0].function.arguments)

    streamed, finish = streamed_tool_calls(client, **kwargs)
    assert finish == finish_reason and len(streamed) == 1
    assert streamed[0]["name"] == calls[0].function.name
    assert valid_arguments(streamed[0]["name"], streamed[0]["arguments"]) == collected


def test_an_agent_loop_calls_a_tool_reads_its_result_and_answers(client, smollm2_replica):
    before = httpx.get(f"{smollm2_replica.base_url}/metrics", timeout=10).text
    messages = list(QUESTION)
    call = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    tool_call = call.choices[0].message.tool_calls[0]
    args = valid_arguments(tool_call.function.name, tool_call.function.arguments)
    messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]})
    result = {"forecast": "light rain", "city": args.get("city") or args.get("to")}
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps(result)})

    answer = client.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, max_tokens=24, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # The system prompt, the tools and the history came from the prefix cache.
    assert answer.usage.prompt_tokens_details.cached_tokens > call.usage.prompt_tokens // 2

    after = httpx.get(f"{smollm2_replica.base_url}/metrics", timeout=10).text
    name = "prefixserve:tool_calls_parsed_total"
    assert metric(after, name) - metric(before, name) >= 1


def test_bad_tool_requests_are_400_and_the_replica_keeps_serving(client):
    cases = [
        dict(tools=[WEATHER, WEATHER]),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book"}}),
        dict(messages=[*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "?"}], tools=TOOLS),
    ]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **case})
        assert info.value.status_code == 400 and info.value.body["param"]
    ok = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
