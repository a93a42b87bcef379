"""/v1/responses against a real ``prefixserve replica`` serving SmolLM2, through the official ``openai``
client and the ``openai-agents`` SDK.

A response runs as the chat request it translates into, so greedy answers equal the chat
completions of the same conversation; a continuation by ``previous_response_id`` is the stored
conversation plus the new input and hits the prefix cache; stored responses are seen only by
the API key that made them. Greedy, small ``max_output_tokens``; one server for the module.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_helpers import ReplicaProcess, metric
from tool_helpers import WEATHER as CHAT_WEATHER
from tool_helpers import valid_arguments

openai = pytest.importorskip("openai")
# Constrained decoding (the grammar compiler of replica/structured_output/) is what makes the arguments parse.
pytest.importorskip("prefixserve.replica.structured_output.compile")

pytestmark = pytest.mark.slow

KEY, OTHER_KEY = "sk-responses-a", "sk-responses-b"
MODEL = "smollm2"
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And of Italy?"
# The chat tools' weather function, in the Responses shape.
WEATHER = {"type": "function", **CHAT_WEATHER["function"], "strict": True}
RAIN = "Will it rain in Lisbon tomorrow?"
# The order of a streamed text answer's events (the deltas repeat).
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ReplicaProcess(
        MODEL,
        "--max-model-len",
        "2048",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--api-key",
        KEY,
        "--api-key",
        OTHER_KEY,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as proc:
        yield proc
        assert proc.returncode is None, f"the replica died during the tests:\n{proc.log_tail()}"


def make_client(server, key: str = KEY):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture()
def client(server):
    with make_client(server) as c:
        yield c


def chat_text(client, messages: list[dict], max_tokens: int, **kwargs) -> tuple[str | None, object]:
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )
    return answer.choices[0].message.content, answer


def first_turn(client, **kwargs):
    return client.responses.create(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=32, **kwargs
    )


def test_a_response_is_the_greedy_chat_answer_in_openais_shape(client, server):
    response = first_turn(client, metadata={"suite": "responses"})
    text, chat = chat_text(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 32
    )
    assert response.output_text == text and text
    assert response.id.startswith("resp_") and len(response.id) == len("resp_") + 32
    assert response.object == "response" and response.status == "completed" and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The request's settings are echoed.
    assert response.instructions == INSTRUCTIONS and response.metadata == {"suite": "responses"}
    assert response.temperature == 0 and response.max_output_tokens == 32 and response.tool_choice == "auto"
    assert response.previous_response_id is None and response.tools == [] and response.parallel_tool_calls
    raw = httpx.get(f"{server.base_url}/v1/responses/{response.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 200 and raw.json()["store"] is True and raw.json()["text"] == {"format": {"type": "text"}}


def test_a_streamed_response_sends_openais_events_whose_deltas_make_the_text(client):
    collected = first_turn(client)
    events = list(first_turn(client, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [*TEXT_EVENTS, "response.completed"], collapsed
    text = "".join(d.delta for d in deltas)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert text == done.text == final.output_text == collected.output_text
    assert {d.item_id for d in deltas} == {final.output[0].id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "completed" and final.usage.output_tokens == collected.usage.output_tokens


def test_the_length_limit_makes_the_response_incomplete(client):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 2
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text


def test_a_continuation_is_the_chat_of_the_whole_conversation_from_the_prefix_cache(client):
    first = first_turn(client)
    second = client.responses.create(
        model=MODEL,
        input=FOLLOW_UP,
        previous_response_id=first.id,
        instructions=INSTRUCTIONS,
        temperature=0,
        max_output_tokens=32,
    )
    conversation = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    text, chat = chat_text(client, conversation, 32)
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # A streamed continuation of the continuation works the same way.
    third = list(
        client.responses.create(
            model=MODEL,
            input="And of Spain?",
            previous_response_id=second.id,
            temperature=0,
            max_output_tokens=16,
            stream=True,
        )
    )
    assert third[-1].type in ("response.completed", "response.incomplete")
    assert third[-1].response.usage.input_tokens_details.cached_tokens > 0


def previous_not_found(info, response_id: str) -> None:
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": f"Previous response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }


def test_an_unstored_or_unknown_response_cannot_be_continued(client):
    unstored = first_turn(client, store=False)
    assert unstored.to_dict()["store"] is False
    for response_id in (unstored.id, "resp_" + "0" * 32):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model=MODEL, input=FOLLOW_UP, previous_response_id=response_id, max_output_tokens=4)
        previous_not_found(info, response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)


def test_another_keys_response_is_not_found_and_get_and_delete_work_for_its_own(client, server):
    mine = first_turn(client)
    with make_client(server, OTHER_KEY) as other:
        with pytest.raises(openai.NotFoundError) as info:
            other.responses.create(model=MODEL, input=FOLLOW_UP, previous_response_id=mine.id, max_output_tokens=4)
        previous_not_found(info, mine.id)
        with pytest.raises(openai.NotFoundError) as got:
            other.responses.retrieve(mine.id)
        assert "not found" in got.value.message and mine.output_text not in got.value.response.text
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
    stored = client.responses.retrieve(mine.id)
    assert stored.id == mine.id and stored.output_text == mine.output_text and stored.usage == mine.usage
    client.responses.delete(mine.id)
    raw = httpx.delete(f"{server.base_url}/v1/responses/{mine.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input=FOLLOW_UP, previous_response_id=mine.id, max_output_tokens=4)
    # Without a key nothing is answered at all.
    assert httpx.get(f"{server.base_url}/v1/responses/{mine.id}").status_code == 401


def test_delete_answers_openais_deleted_object(client, server):
    response = first_turn(client)
    raw = httpx.delete(f"{server.base_url}/v1/responses/{response.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 200 and raw.json() == {"id": response.id, "object": "response.deleted", "deleted": True}


def required_call(client, **kwargs):
    return client.responses.create(
        model=MODEL,
        input=RAIN,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=64,
        **kwargs,
    )


def test_a_required_tool_call_is_a_function_call_item_and_its_output_continues_it(client):
    response = required_call(client)
    (call,) = response.output
    assert isinstance(call, openai.types.responses.ResponseFunctionToolCall)
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    args = valid_arguments("get_weather", call.arguments)
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"

    result = json.dumps({"forecast": "light rain", "city": args["city"]})
    answer = client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        previous_response_id=response.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=32,
    )
    # The same turn as a chat: the call and its result as messages, the tools, auto tool choice.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ],
    }
    messages = [
        {"role": "user", "content": RAIN},
        assistant,
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    text, chat = chat_text(client, messages, 32, tools=[CHAT_WEATHER])
    calls = chat.choices[0].message.tool_calls or []
    assert [o.type for o in answer.output] == ["message"] * bool(text) + ["function_call"] * len(calls)
    assert answer.output_text == (text or "")
    assert answer.usage.input_tokens_details.cached_tokens > 0

    # Replayed by the client instead of continued: the same prompt, the same answer.
    replayed = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": RAIN},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": result},
        ],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=32,
    )
    assert replayed.output_text == answer.output_text and replayed.usage.input_tokens == answer.usage.input_tokens


def test_a_streamed_tool_call_sends_the_function_call_events(client):
    collected = required_call(client)
    events = list(required_call(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response.output[0]
    assert deltas == done.arguments == final.arguments == collected.output[0].arguments
    assert final.name == "get_weather" and final.status == "completed"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"conversation": "conv_123"}, "conversation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input.0.message.content",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "book"}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **extra})
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert info.value.body["code"]


def test_the_store_size_is_on_metrics(client, server):
    first_turn(client)
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert metric(text, "prefixserve:response_store_entries") >= 1
    assert metric(text, "prefixserve:response_store_bytes") > 0


def test_an_agent_runs_a_tool_and_answers_and_continues_by_previous_response_id(server):
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get tomorrow's weather forecast for a city."""
        cities.append(city)
        return f"Light rain in {city}."

    async def run() -> tuple[object, object]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=300)
        async with client:
            agent = agents.Agent(
                name="travel",
                instructions="You are a travel assistant. Use the tools.",
                model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                tools=[get_weather],
                # The SDK resets tool_choice once the tool ran, so the next turn may answer in text.
                model_settings=agents.ModelSettings(
                    tool_choice="required", temperature=0, max_tokens=96, parallel_tool_calls=False
                ),
            )
            first = await agents.Runner.run(agent, RAIN, max_turns=4)
            second = await agents.Runner.run(
                agent, "And in Oslo?", previous_response_id=first.last_response_id, max_turns=4
            )
            return first, second

    first, second = asyncio.run(run())
    assert cities[0] == "Lisbon" and len(cities) == 2
    assert isinstance(first.final_output, str) and first.final_output
    assert isinstance(second.final_output, str) and second.final_output
    assert first.last_response_id.startswith("resp_") and second.last_response_id != first.last_response_id
