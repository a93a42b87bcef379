"""Tool calling: the routing key with tools (Contract 1), the static prefix they render into, the chat
templates, the request checks, and the front end on a real tiny engine."""

from __future__ import annotations

import hashlib
import json

import jsonschema
import pytest
from server_helpers import InProcessReplica, assert_openai_error, metric

from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import BadRequestError
from prefixserve.router.routing_key import PrefixKeyConfig, prefix_hash, routing_key

SYSTEM = "You are the travel desk of a small agency. Call a tool when the user asks for facts."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "find_flights",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "max_stops": {"type": "integer"}},
            "required": ["to"],
        },
    },
}
USER = {"role": "user", "content": "Will it rain in Lisbon tomorrow?"}


def chat(**fields) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, USER], **fields}


def streamed_events(replica: InProcessReplica, body: dict) -> list[dict]:
    """The JSON chunks of ``body`` sent as a stream."""
    streamed = replica.request("POST", "/v1/chat/completions", json={**body, "stream": True})
    return [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]


# -- Contract 1: the tools are part of the static prefix ----------------------------------------


def test_the_key_of_a_request_with_tools_hashes_system_text_0x00_and_canonical_tools():
    tool = {"type": "function", "function": {"name": "f", "description": "é"}}
    # The canonical bytes, written out: sorted keys, no spaces, UTF-8 as itself.
    canonical = '[{"function":{"description":"é","name":"f"},"type":"function"}]'.encode()
    expected = hashlib.sha256(SYSTEM.encode() + b"\x00" + canonical).hexdigest()[:16]
    assert routing_key(chat(tools=[tool])) == prefix_hash(SYSTEM, tools=[tool]) == expected
    # With a salt the salt and 0x00 come first, as for any key.
    salted = hashlib.sha256(b"acme\x00" + SYSTEM.encode() + b"\x00" + canonical).hexdigest()[:16]
    assert routing_key(chat(tools=[tool], cache_salt="acme")) == salted


def test_same_system_and_tools_share_a_key_and_another_tool_list_does_not():
    key = routing_key(chat(tools=[WEATHER, FLIGHTS]))
    # Key order inside the definitions does not matter; later turns do not either.
    reordered = json.loads(json.dumps({"tools": [dict(reversed(list(t.items()))) for t in (WEATHER, FLIGHTS)]}))
    assert routing_key(chat(**reordered)) == key
    longer = chat(tools=[WEATHER, FLIGHTS])
    longer["messages"] += [{"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "And?"}]
    assert routing_key(longer) == key
    # Another list (fewer tools, another order, another schema) is another key.
    assert routing_key(chat(tools=[WEATHER])) != key
    assert routing_key(chat(tools=[FLIGHTS, WEATHER])) != key
    changed = json.loads(json.dumps(WEATHER))
    changed["function"]["parameters"]["required"] = []
    assert routing_key(chat(tools=[changed, FLIGHTS])) != key


def test_without_tools_the_key_is_unchanged():
    plain = hashlib.sha256(SYSTEM.encode()).hexdigest()[:16]
    assert routing_key(chat()) == routing_key(chat(tools=[])) == routing_key(chat(tools=None)) == plain
    assert prefix_hash(SYSTEM) == prefix_hash(SYSTEM, tools=[]) == plain


def test_tools_alone_are_a_static_prefix():
    body = {"messages": [USER], "tools": [WEATHER]}
    canonical = json.dumps([WEATHER], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert routing_key(body) == hashlib.sha256(b"\x00" + canonical).hexdigest()[:16]
    assert routing_key({"messages": [USER]}) is None
    with pytest.raises(ValueError, match="tools must be a list"):
        routing_key({"messages": [USER], "tools": {"a": 1}})


def test_multi_turn_keys_include_the_tools():
    config = PrefixKeyConfig(session_header=True, key_turns=1)
    headers = {"X-Session-Id": "s1"}
    with_tools = routing_key(chat(tools=[WEATHER]), headers, config)
    assert with_tools != routing_key(chat(), headers, config)
    assert routing_key(chat(tools=[WEATHER]), None, config) != routing_key(chat(), None, config)


def test_route_cli_takes_the_tools_file(tmp_path, capsys):
    from prefixserve.router import cli

    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER, FLIGHTS]))
    base = ["route", "--replica", "127.0.0.1:18001", "--replica", "127.0.0.1:18002", "--json"]
    assert cli.main([*base, "--system", SYSTEM, "--tools", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["key"] == routing_key(chat(tools=[WEATHER, FLIGHTS]))
    path.write_text('{"not": "a list"}')
    assert cli.main([*base, "--system", SYSTEM, "--tools", str(path)]) == 2
    assert "expected a JSON array" in capsys.readouterr().err
    assert cli.main([*base, "--key", "k1", "--tools", str(path)]) == 2


# -- the static prefix the engine protects: what the template renders before the first user turn --


@pytest.fixture(scope="module")
def llm(ckpt):
    from prefixserve.replica.entrypoints.llm import LLM

    with LLM(ckpt, block_size=4, num_kv_blocks=64) as llm:
        yield llm


def _before_first_user(engine, messages, **kwargs) -> list[int]:
    """The tokens of the rendered conversation's text up to the first user turn."""
    from prefixserve.replica.tool_calling.templates import template_for

    template = template_for(engine.tokenizer.chat_template, None, bool(kwargs.get("tools")))
    extra = {"chat_template": template} if template else {}
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs, **extra)
    return engine.input_processor.tokenize(text[: text.index("<|im_start|>user")])


@pytest.mark.parametrize("tools", [None, [WEATHER], [WEATHER, FLIGHTS]])
@pytest.mark.parametrize("with_system", [True, False])
def test_static_prefix_tokens_are_what_the_template_renders_before_the_first_user_message(llm, tools, with_system):
    engine = llm.engine
    messages = ([{"role": "system", "content": SYSTEM}] if with_system else []) + [USER]
    kwargs = {"tools": tools} if tools else {}
    ids = engine.input_processor.encode_chat(messages, **kwargs)
    n = engine.input_processor.static_prefix_tokens(messages, ids, **kwargs)
    if not with_system and not tools:
        assert n == 0  # nothing static: SmolLM2's default system turn is not the client's prefix
        return
    prefix = _before_first_user(engine, messages, **kwargs)
    assert n == len(prefix) > 0 and ids[:n] == prefix
    assert engine.input_processor.static_prefix_tokens(messages, ids, **kwargs) == n  # memoized, tools and all


def test_tools_render_in_the_static_prefix_and_change_it(llm):
    engine = llm.engine
    messages = [{"role": "system", "content": SYSTEM}, USER]
    plain = engine.input_processor.encode_chat(messages)
    with_tools = engine.input_processor.encode_chat(messages, tools=[WEATHER])
    n_plain = engine.input_processor.static_prefix_tokens(messages, plain)
    n_tools = engine.input_processor.static_prefix_tokens(messages, with_tools, tools=[WEATHER])
    assert n_tools > n_plain
    text = engine.tokenizer.decode(with_tools[:n_tools])
    assert SYSTEM in text and '"name": "get_weather"' in text and "<tool_call>" in text


def test_tool_turns_render_as_tool_call_and_tool_response_blocks(llm):
    engine = llm.engine
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}}
    messages = [
        {"role": "system", "content": SYSTEM},
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"rain": 0.2}', "tool_call_id": "call_1"},
    ]
    text = engine.tokenizer.decode(engine.input_processor.encode_chat(messages, tools=[WEATHER]))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n'
        "</tool_call><|im_end|>"
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"rain": 0.2}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_chat_template_flag_renders_every_request(ckpt, tmp_path):
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.entrypoints.llm import LLM

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if tools %}TOOLS {{ tools | length }}\n{% endif %}"
    )
    with LLM(ckpt, block_size=4, num_kv_blocks=16, chat_template=str(template)) as offline:
        engine = offline.engine
        assert engine.input_processor.encode_chat([USER]) == engine.input_processor.tokenize(
            f"[user] {USER['content']}\n"
        )
        assert engine.input_processor.encode_chat([USER], tools=[WEATHER]) == engine.input_processor.tokenize(
            f"[user] {USER['content']}\nTOOLS 1\n"
        )
    with pytest.raises(ValueError, match="chat_template .* cannot be read"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_engine_config_checks_the_tool_knobs():
    from prefixserve.replica.config import EngineConfig

    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        EngineConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        EngineConfig(enable_auto_tool_choice=True)
    assert EngineConfig(tool_call_parser="llama3_json", enable_auto_tool_choice=True).tool_call_parser == "llama3_json"


# -- the request checks (400 naming the field) --------------------------------------------------


def _bad(body: dict) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        api.parse_request(api.ChatCompletionRequest, json.dumps(body))
    return info.value


CALL = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


@pytest.mark.parametrize(
    "body, param, words",
    [
        (chat(tools=[WEATHER, WEATHER]), "tools.1.function.name", "must be unique"),
        (
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "book_hotel"}}),
            "tool_choice",
            "does not match any of the specified `tools`",
        ),
        (chat(tool_choice="required"), "tool_choice", "When using `tool_choice`, `tools` must be set."),
        (chat(tools=[], tool_choice="required"), "tools", '"required" needs at least one tool'),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_b"},
                ],
                "tools": [WEATHER],
            },
            "messages.2.tool_call_id",
            "no earlier assistant message called",
        ),
        ({"messages": [USER, {"role": "tool", "content": "sunny"}]}, "messages.1", "needs the tool_call_id"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
            "tools.0.function.parameters",
            "not a valid JSON Schema",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]),
            "tools.0.function.parameters",
            "not a valid JSON Schema",
        ),
        (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name", "pattern"),
        (chat(tools=[{"type": "retrieval"}]), "tools.0.type", "function"),
        (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", ""),
        (chat(tools=[WEATHER], parallel_tool_calls="maybe"), "parallel_tool_calls", ""),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0", "only assistant"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(body, param, words):
    err = _bad(body)
    assert err.status_code == 400 and err.code
    assert err.param is not None and err.param.startswith(param), (err.param, err.message)
    assert words in err.message


def test_tool_history_with_matching_ids_is_accepted():
    body = {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        ],
        "tools": [WEATHER],
        "tool_choice": "none",
    }
    request = api.parse_request(api.ChatCompletionRequest, json.dumps(body))
    assert request.chat_messages()[1]["tool_calls"] == [CALL]
    assert request.tool_call_mode() is None and request.prompt_fields()["tools"] == [WEATHER]


def test_required_and_named_constrain_decoding_to_the_tools_schemas():
    required = api.parse_request(
        api.ChatCompletionRequest, json.dumps(chat(tools=[WEATHER, FLIGHTS], tool_choice="required"))
    )
    schema = required.to_sampling_params(default_max_tokens=8).structured_outputs.json
    jsonschema.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "find_flights", "parameters": {"to": "Rome", "max_stops": 1}},
        ],
        schema,
    )
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "c"}}],
        [{"name": "book_hotel", "parameters": {}}],
        [{"name": "find_flights", "parameters": {"to": 3}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert required.tool_call_mode().choice == "required"
    single = api.parse_request(
        api.ChatCompletionRequest, json.dumps(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    )
    assert single.to_sampling_params(default_max_tokens=8).structured_outputs.json["maxItems"] == 1
    named = api.parse_request(
        api.ChatCompletionRequest,
        json.dumps(
            chat(tools=[WEATHER, FLIGHTS], tool_choice={"type": "function", "function": {"name": "find_flights"}})
        ),
    )
    assert named.to_sampling_params(default_max_tokens=8).structured_outputs.json == FLIGHTS["function"]["parameters"]
    assert (named.tool_call_mode().choice, named.tool_call_mode().name) == ("named", "find_flights")
    for choice in (None, "auto", "none"):
        body = chat(tools=[WEATHER]) if choice is None else chat(tools=[WEATHER], tool_choice=choice)
        plain = api.parse_request(api.ChatCompletionRequest, json.dumps(body))
        assert plain.to_sampling_params(default_max_tokens=8).structured_outputs is None


def test_required_schema_lifts_the_tools_defs_to_the_top():
    from prefixserve.replica.tool_calling.choice import required_schema

    params = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    }
    schema = required_schema([("f", params)])
    assert "$defs" in schema and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": {"y": 1}}}], schema)
    other = {**params, "$defs": {"point": {"type": "string"}}}
    with pytest.raises(ValueError, match="more than one schema"):
        required_schema([("f", params), ("g", other)])


# -- the front end on a real tiny engine ---------------------------------------------------------


def test_auto_needs_enable_auto_tool_choice_as_vllm_answers(ckpt):
    replica = InProcessReplica(ckpt, max_model_len=512)
    try:
        for body in (chat(tools=[WEATHER], max_tokens=2), chat(tools=[WEATHER], tool_choice="auto", max_tokens=2)):
            error = assert_openai_error(replica.request("POST", "/v1/chat/completions", json=body))
            assert error["param"] == "tool_choice"
            assert error["message"] == (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        # tool_choice "none" with tools: rendered, not parsed.
        ok = replica.request(
            "POST", "/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice="none", max_tokens=3)
        )
        assert ok.status_code == 200 and "tool_calls" not in ok.json()["choices"][0]["message"]
    finally:
        replica.close()


def test_auto_reads_the_output_with_the_parser_and_counts_it(ckpt):
    replica = InProcessReplica(
        ckpt, max_model_len=512, engine_kwargs={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    )
    try:
        body = chat(tools=[WEATHER], max_tokens=6, temperature=0)
        collected = replica.request("POST", "/v1/chat/completions", json=body)
        assert collected.status_code == 200, collected.text
        message = collected.json()["choices"][0]["message"]
        # A random tiny model writes no <tool_call>: its text is the content, unchanged.
        plain = replica.request(
            "POST", "/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice="none", max_tokens=6, temperature=0)
        )
        assert message["content"] == plain.json()["choices"][0]["message"]["content"]
        events = streamed_events(replica, body)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert text == message["content"]
        metrics = replica.request("GET", "/metrics").text
        assert "prefixserve:tool_calls_parsed_total" in metrics
        assert "prefixserve:tool_call_parse_failures_total" in metrics
    finally:
        replica.close()


# -- the engine reads the output: collected, streamed, counted, traced --------------------------

# SmolLM2's token "{}": with a +100 bias a random model writes exactly it, an empty arguments object.
EMPTY_OBJECT_TOKEN, CLOSE_BRACE_TOKEN, OPEN_BRACE_TOKEN = 6150, 109, 107
NOOP = {"type": "function", "function": {"name": "ping", "description": "Check the service is up."}}


def ping_forced(tools: list[dict], token: int) -> dict:
    """A chat whose one sampled token is ``token`` (a +100 bias), under tool_choice naming ``ping``."""
    return chat(
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "ping"}},
        max_tokens=1,
        temperature=0,
        logit_bias={str(token): 100},
    )


def test_a_named_function_call_comes_back_collected_and_streamed(ckpt):
    replica = InProcessReplica(ckpt, max_model_len=512)
    try:
        body = ping_forced([NOOP, WEATHER], EMPTY_OBJECT_TOKEN)
        answer = replica.request("POST", "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
        assert [(c["type"], c["function"]) for c in calls] == [("function", {"name": "ping", "arguments": "{}"})]
        assert calls[0]["id"].startswith("call_")

        events = streamed_events(replica, body)
        pieces = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or ()]
        assert pieces[0]["index"] == 0 and pieces[0]["type"] == "function" and pieces[0]["id"].startswith("call_")
        assert pieces[0]["function"] == {"name": "ping", "arguments": ""}
        assert "".join(p["function"].get("arguments", "") for p in pieces) == "{}"
        assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]

        assert metric(replica.request("GET", "/metrics").text, "prefixserve:tool_calls_parsed_total") == 2
    finally:
        replica.close()


def test_a_call_cut_by_max_tokens_is_never_streamed_and_the_answer_is_its_text(ckpt):
    """max_tokens ends a named function's arguments at "{": no call goes out, in a stream or collected;
    the text is the content and the finish reason "length"."""
    replica = InProcessReplica(ckpt, max_model_len=512)
    try:
        body = ping_forced([NOOP], OPEN_BRACE_TOKEN)
        answer = replica.request("POST", "/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["message"]["content"] == "{" and not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "length"
        events = streamed_events(replica, body)
        assert not [c for e in events for c in e["choices"] if c["delta"].get("tool_calls")]
        assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == "{"
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    finally:
        replica.close()


def test_tool_calls_and_parse_failures_are_counted_and_on_the_span(ckpt):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from prefixserve.common.tracing import RequestTracer, build_tracer
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.core import LLMEngine
    from prefixserve.replica.sampling_params import SamplingParams
    from prefixserve.replica.tool_calling.choice import ToolCallMode

    engine = LLMEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_model_len=256))
    exporter = InMemorySpanExporter()
    engine.tracer = RequestTracer(build_tracer("test", exporter=exporter), engine.model_name)
    mode = ToolCallMode("named", "ping")
    for token, n in ((EMPTY_OBJECT_TOKEN, 2), (CLOSE_BRACE_TOKEN, 1)):
        params = SamplingParams(temperature=0, max_tokens=1, n=n, logit_bias={token: 100.0})
        engine.add_request(None, list(range(5, 30)), params, tool_mode=mode)
        while engine.has_unfinished_requests():
            engine.step()
    spans = [s.attributes for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert [
        (a["prefixserve.tool_choice"], a["prefixserve.tool_calls"], a["prefixserve.tool_call_parse_failures"])
        for a in spans
    ] == [("named", 2, 0), ("named", 0, 1)]
    assert engine.metrics.tool_calls_parsed._value.get() == 2
    assert engine.metrics.tool_call_parse_failures._value.get() == 1
    engine.shutdown()
