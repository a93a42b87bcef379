"""replica/entrypoints/openai/responses_protocol.py: a Responses request as a chat request, and a chat
answer as Response output items (pure, fast)."""

from __future__ import annotations

import pytest

from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai import responses_protocol as rp
from prefixserve.replica.errors import BadRequestError

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Tomorrow's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def parse(data: dict) -> rp.ResponsesRequest:
    return api.validate_request(rp.ResponsesRequest, data)


def chat_of(data: dict, history: list[dict] | None = None) -> dict:
    body = parse(data)
    chat_data = body.chat_data(body.turn_messages(history or []))
    api.validate_request(api.ChatCompletionRequest, chat_data)  # the chat path takes what it is given
    return chat_data


def test_a_string_input_is_one_user_message_after_the_instructions():
    data = chat_of({"model": "m", "input": "Hi there", "instructions": "Be brief."})
    assert data["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert data["model"] == "m" and data["stream"] is False
    assert "store" not in data  # the chat path refuses store: true; the response's store is the front end's


def test_message_items_with_or_without_type_and_text_parts_become_chat_messages():
    data = chat_of(
        {
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}],
                },
                {"role": "user", "content": "d"},
            ]
        }
    )
    assert data["messages"] == [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "a\nb"},  # parts joined as the chat path joins them
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]


def test_function_calls_join_the_assistant_turn_and_outputs_are_tool_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'}
    second = {**call, "call_id": "call_2", "arguments": '{"city":"Rome"}', "id": "fc_2", "status": "completed"}
    data = chat_of(
        {
            "input": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me look."},
                call,
                second,
                {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "sun"}],
                },
            ],
            "tools": [WEATHER],
        }
    )
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
    ]
    assert data["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    # A call with no assistant text before it is an assistant turn of its own.
    alone = chat_of({"input": [{"role": "user", "content": "q"}, call]})
    assert alone["messages"][1] == {"role": "assistant", "content": None, "tool_calls": calls[:1]}


def test_a_call_output_may_answer_a_call_of_the_stored_conversation_but_not_an_unknown_one():
    history = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    output = {"type": "function_call_output", "call_id": "call_9", "output": "done"}
    data = chat_of({"input": [output], "instructions": "New rules."}, history)
    # The new instructions lead; the stored conversation follows, then the new input.
    assert data["messages"] == [
        {"role": "system", "content": "New rules."},
        *history,
        {"role": "tool", "tool_call_id": "call_9", "content": "done"},
    ]
    with pytest.raises(BadRequestError) as info:
        chat_of({"input": [output]})
    assert info.value.param == "input" and "call_9" in info.value.message


def test_tools_choice_limits_and_text_format_map_onto_the_chat_fields():
    data = chat_of(
        {
            "input": "q",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "max_output_tokens": 32,
            "temperature": 0,
            "top_p": 0.5,
            "prompt_cache_key": "k",
            "service_tier": "auto",
            "metadata": {"a": "b"},
        }
    )
    assert data["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert data["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert data["parallel_tool_calls"] is False and data["max_completion_tokens"] == 32
    assert data["temperature"] == 0 and data["top_p"] == 0.5 and data["prompt_cache_key"] == "k"
    assert "metadata" not in data  # echoed on the Response, nothing for the engine
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    formatted = chat_of(
        {"input": "q", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}}
    )
    assert formatted["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema, "strict": True},
    }
    assert "response_format" not in chat_of({"input": "q", "text": {"format": {"type": "text"}}})
    assert chat_of({"input": "q", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("tools", [{"type": "web_search"}], "tools"),
        ("tools", [WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}], "tools"),
        ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
        ("background", True, "background"),
        ("conversation", "conv_1", "conversation"),
        ("prompt", {"id": "pmpt_1"}, "prompt"),
        ("reasoning", {"effort": "high"}, "reasoning.effort"),
        ("truncation", "auto", "truncation"),
        ("include", ["message.output_text.logprobs"], "include"),
        (
            "input",
            [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
            "input.0.message.content",
        ),
        ("input", [{"type": "reasoning", "id": "rs_1", "summary": []}], "input"),
        (
            "input",
            [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}],
            "input.0.function_call_output.output",
        ),
    ],
)
def test_what_this_server_does_not_implement_is_a_400_naming_the_field(field, value, param):
    with pytest.raises(BadRequestError) as info:
        parse({"input": "q", field: value})
    assert info.value.param == param, info.value.message
    assert info.value.code in ("unsupported_value", "unsupported_parameter"), info.value.code


def test_harmless_settings_are_accepted():
    body = parse(
        {
            "input": "q",
            "reasoning": {"effort": "none"},
            "truncation": "disabled",
            "background": False,
            "include": ["reasoning.encrypted_content"],
            "store": None,
            "stream": True,
            "stream_options": {"include_obfuscation": False},
            "top_logprobs": 0,
        }
    )
    assert body.store is True  # OpenAI's default


def test_an_empty_input_is_a_400():
    for data in ({}, {"input": []}):
        with pytest.raises(BadRequestError) as info:
            chat_of(data)
        assert info.value.param == "input"


def answer(content: str | None, calls: list[tuple[str, str, str]] = ()) -> api.ChatResponseMessage:
    tool_calls = [api.ToolCallOut(id=i, function=api.FunctionCall(name=n, arguments=a)) for i, n, a in calls] or None
    return api.ChatResponseMessage(content=content, tool_calls=tool_calls)


def test_a_chat_answer_becomes_a_message_item_then_function_call_items():
    items = rp.output_items(answer("Looking.", [("call_1", "get_weather", '{"city":"Oslo"}')]), "tool_calls")
    message, call = items
    assert isinstance(message, rp.OutputMessage) and isinstance(call, rp.OutputFunctionCall)
    assert message.id.startswith("msg_") and len(message.id) == len("msg_") + 32 and message.status == "completed"
    assert message.model_dump()["content"] == [
        {"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}
    ]
    assert call.id.startswith("fc_") and call.call_id == "call_1" and call.status == "completed"
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Oslo"}')
    # Calls alone: no message item; a length cut leaves the message incomplete.
    assert [i.type for i in rp.output_items(answer(None, [("call_1", "f", "{}")]), "tool_calls")] == ["function_call"]
    (cut,) = rp.output_items(answer("abc"), "length")
    assert cut.status == "incomplete" and rp.finished_status("length") == "incomplete"
    assert rp.finished_status("stop") == "completed"


def test_stored_output_renders_as_the_same_messages_as_its_items_replayed_by_a_client():
    items = rp.output_items(answer("Looking.", [("call_1", "f", "{}"), ("call_2", "f", '{"a":1}')]), "tool_calls")
    replayed = parse({"input": [i.model_dump() for i in items]})
    assert rp.output_messages(items) == rp.messages_of(replayed.input_items())
    assert rp.output_messages(items) == [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
            ],
        }
    ]


def test_the_response_object_echoes_the_request_and_the_openai_client_parses_it():
    responses = pytest.importorskip("openai.types.responses")
    body = parse(
        {
            "input": "q",
            "instructions": "sys",
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_output_tokens": 16,
            "metadata": {"k": "v"},
            "store": False,
            "previous_response_id": "resp_prev",
        }
    )
    usage = rp.ResponseUsage.of(api.Usage.build(prompt_tokens=10, completion_tokens=4, cached_tokens=6))
    items = rp.output_items(answer("hi", [("call_1", "get_weather", '{"city":"Oslo"}')]), "tool_calls")
    response = body.response("resp_" + "0" * 32, "smollm2", status="completed", output=items, usage=usage)
    data = response.model_dump()
    assert data["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 14,
    }
    for name, value in (
        ("instructions", "sys"),
        ("tool_choice", "required"),
        ("max_output_tokens", 16),
        ("metadata", {"k": "v"}),
        ("store", False),
        ("previous_response_id", "resp_prev"),
        ("parallel_tool_calls", True),
        ("temperature", 1.0),
        ("top_p", 1.0),
        ("text", {"format": {"type": "text"}}),
    ):
        assert data[name] == value, name
    assert data["tools"] == [WEATHER]
    parsed = responses.Response.model_validate(data)
    assert parsed.output_text == "hi" == response.output_text()
    assert parsed.output[1].type == "function_call" and parsed.output[1].call_id == "call_1"
    assert parsed.usage.input_tokens_details.cached_tokens == 6
    incomplete = body.response("resp_x", "m", status="incomplete").model_dump()
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}
