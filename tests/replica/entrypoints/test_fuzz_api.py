"""Fuzzing the OpenAI front end: hypothesis-generated requests against the real app and a tiny engine.

Valid and invalid shapes and values for /v1/chat/completions and
/v1/completions, plus bodies that are not JSON objects at all. After every
case: the answer is 200 (a well-formed completion or SSE stream ending in
``[DONE]`` with no in-band error) or a 4xx with the OpenAI error body and a
non-null code, never a 5xx; and a normal request still succeeds. At the end of
each test the engine holds no request and no KV block.

Deterministic (``derandomize``): the same cases every run, so a failure
reproduces. Generated ``max_tokens`` stay small to keep the file fast.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_helpers import VOCAB
from server_helpers import InProcessReplica, assert_openai_error

MAX_MODEL_LEN = 96
# conftest's replica: an InProcessReplica on the shared ckpt, with these options.
REPLICA_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, replica_name="fuzz")
CHAT_EXAMPLES = 900
COMPLETION_EXAMPLES = 700
RAW_EXAMPLES = 400
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# -- values ---------------------------------------------------------------------------------

huge_ints = st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.floats(allow_nan=True),
    st.lists(st.integers(-2, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
small_text = st.text(max_size=40)
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, -1), st.integers(VOCAB, VOCAB + 5), huge_ints)
# The float edges every sampling parameter is tried at: subnormals, values that round to 0 or
# overflow in float32, and the last floats inside and outside each range.
TINY = [5e-324, 1e-300, 1e-45, 1e-39, 1.2e-38, 1e-8]
HUGE = [3.5e38, 1e300, 1.7976931348623157e308]


@dataclass(frozen=True)
class Field:
    """A request field's values: ones the API accepts, and ones it must refuse (or that are of the wrong type)."""

    valid: st.SearchStrategy
    invalid: st.SearchStrategy


def field(valid: st.SearchStrategy, invalid: st.SearchStrategy | None = None) -> Field:
    return Field(valid, odd_values if invalid is None else st.one_of(invalid, odd_values))


max_tokens = field(
    st.integers(1, 3), st.one_of(st.integers(-2, 0), st.integers(MAX_MODEL_LEN, MAX_MODEL_LEN + 2), huge_ints)
)
SAMPLING_FIELDS = {
    "temperature": field(
        st.one_of(st.floats(0, 2), st.sampled_from([*TINY, 1e-5, 1.0000001e-5, 2.0, -0.0])),
        st.one_of(
            st.floats(2.0001, 1e6),
            st.floats(-1e6, -0.0001),
            st.sampled_from([2.0000000001, -5e-324, *HUGE, float("nan"), float("inf")]),
        ),
    ),
    "top_p": field(
        st.one_of(st.floats(0.01, 1), st.sampled_from([*TINY, 1.0, 0.9999999999])),
        st.sampled_from([0.0, -0.0, -5e-324, -0.5, 1.0000000001, 1.5, *HUGE, float("nan")]),
    ),
    "top_k": field(
        st.sampled_from([-1, 1, 2, 5, 50, VOCAB - 1, VOCAB, VOCAB + 1, 100000, 2**63 - 1]),
        st.one_of(st.integers(-5, 0), huge_ints),
    ),
    "min_p": field(
        st.one_of(st.floats(0, 1), st.sampled_from([0.0, *TINY, 1.0, 0.9999999999])),
        st.sampled_from([-5e-324, -0.1, 1.0000000001, *HUGE, float("nan"), float("inf")]),
    ),
    "n": field(st.integers(1, 3), st.one_of(st.integers(-1, 0), st.integers(17, 40), huge_ints)),
    "seed": field(
        st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1])),
        st.one_of(st.integers(-(2**63), -1), huge_ints),
    ),
    "stop": field(
        st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
        st.one_of(st.just(""), st.lists(st.text(max_size=300), min_size=17, max_size=20)),
    ),
    "stop_token_ids": field(
        st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(token_ids, min_size=1, max_size=70)
    ),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 1), st.one_of(st.integers(-3, -1), st.integers(4, 10**6), huge_ints)),
    "logit_bias": field(
        st.dictionaries(
            st.integers(0, VOCAB - 1).map(str),
            st.one_of(st.floats(-100, 100), st.sampled_from([-100.0, 100, -5e-324])),
            max_size=4,
        ),
        st.dictionaries(
            st.one_of(token_ids.map(str), st.text(max_size=4)),
            st.one_of(st.floats(), st.integers()),
            min_size=1,
            max_size=4,
        ),
    ),
    "stream": field(st.booleans()),
    "stream_options": field(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "include_obfuscation": st.booleans()})
    ),
    "presence_penalty": field(
        st.one_of(st.floats(-2, 2), st.sampled_from([0, -2, 2.0, *TINY])),
        st.sampled_from([2.0000000001, -2.0000000001, *HUGE, float("nan")]),
    ),
    "frequency_penalty": field(
        st.one_of(st.floats(-2, 2), st.sampled_from([0.0, -2.0, 2, *TINY])),
        st.sampled_from([2.0000000001, -3, *HUGE, float("inf")]),
    ),
    "repetition_penalty": field(
        st.one_of(st.floats(0.5, 2), st.sampled_from([1.0, 1, *TINY, *HUGE])),
        st.sampled_from([0, 0.0, -0.0, -1e-300, -1.0, float("nan"), float("inf")]),
    ),
    "bad_words": field(
        st.lists(st.text(min_size=1, max_size=8).filter(str.strip), max_size=3),
        st.one_of(st.just([""]), st.just([" "]), st.lists(st.just("x"), min_size=129, max_size=129)),
    ),
    "allowed_token_ids": field(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5),
        st.one_of(
            st.just([]),
            st.lists(token_ids, min_size=1, max_size=3).filter(lambda ids: any(not 0 <= t < VOCAB for t in ids)),
        ),
    ),
    "prompt_logprobs": field(st.integers(0, 20), st.one_of(st.integers(21, 100), st.integers(-3, -1), huge_ints)),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "spaces_between_special_tokens": field(st.booleans()),
    "cache_salt": field(st.text(min_size=1, max_size=10), st.just("")),
    "user": field(small_text),
    "model": field(st.sampled_from(["tiny"]), st.sampled_from(["gpt-4o", ""])),
    "some_unknown_field": Field(st.nothing(), odd_values),
    # Structured output: invalid schemas, regexes and grammars are 400s before the engine.
    "response_format": field(
        st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    },
                },
            ]
        ),
        st.sampled_from(
            [
                {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "yaml"},
                "json",
                {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/missing"}}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
            ]
        ),
    ),
    "guided_regex": field(st.just("[a-c]{1,3}"), st.sampled_from(["((", "", "[z-a]"])),
    "guided_choice": field(st.just(["yes", "no"]), st.sampled_from([[], "yes", [1]])),
    "guided_grammar": field(st.just('root ::= "a" | "b"'), st.sampled_from(["root ::= undefined_rule", "::="])),
    "structured_outputs": field(
        st.just({"json": {"type": "string", "maxLength": 4}}),
        st.sampled_from([{"json": {}, "regex": "a"}, {"yaml": "x"}, {"regex": "(("}]),
    ),
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "max_completion_tokens": max_tokens,
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.one_of(st.integers(21, 100), st.integers(-3, -1))),
    "tools": field(st.just([]), st.just([{"type": "function", "function": {"name": "f"}}])),
    "tool_choice": field(st.just("none"), st.sampled_from(["auto", "required"])),
    "modalities": field(st.just(["text"]), st.just(["text", "audio"])),
    "store": field(st.just(False), st.just(True)),
    "service_tier": field(st.sampled_from(["auto", "default"]), st.just("flex")),
    "metadata": field(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
    "parallel_tool_calls": Field(st.nothing(), st.booleans()),
    "reasoning_effort": Field(st.nothing(), st.sampled_from(["low", "high"])),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "logprobs": field(st.integers(0, 5), st.one_of(st.integers(21, 100), st.integers(-3, -1))),
    "echo": field(st.booleans()),
    "suffix": field(st.just(""), st.text(min_size=1, max_size=5)),
    "best_of": field(st.just(1), st.integers(2, 4)),
}

text_part = st.fixed_dictionaries({"type": st.just("text"), "text": small_text})
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={
        "content": st.one_of(small_text, st.lists(text_part, max_size=3), st.none()),
        "name": small_text,
        "tool_call_id": small_text,
    },
)
invalid_message = st.one_of(
    valid_message.map(lambda m: {**m, "role": "function"}),
    valid_message.map(lambda m: {**m, "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    valid_message.map(lambda m: {**m, "content": ["a bare string"]}),
    valid_message.map(lambda m: {**m, "tool_calls": [{"id": "c"}]}),
    valid_message.map(lambda m: {**m, "extra": 1}),
    valid_message.map(lambda m: {k: v for k, v in m.items() if k != "role"}),
    odd_values,
)
# More empty messages than can fit (each renders some template tokens): refused before rendering.
too_many_messages = st.builds(
    lambda n, role: [{"role": role, "content": ""}] * n,
    st.integers(MAX_MODEL_LEN, 5000),
    st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
)
messages = Field(
    st.lists(valid_message, min_size=1, max_size=4),
    st.one_of(
        st.just([]),
        small_text,
        too_many_messages,
        st.tuples(st.lists(valid_message, max_size=2), invalid_message).map(lambda t: [*t[0], t[1]]),
    ),
)
prompt = Field(
    st.one_of(
        st.text(min_size=1, max_size=60),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=1),
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=1),
    ),
    st.one_of(
        st.just(""),
        st.just([]),
        st.lists(token_ids, min_size=1, max_size=4).filter(lambda ids: any(not 0 <= t < VOCAB for t in ids)),
        st.lists(small_text, min_size=2, max_size=3),
        st.lists(st.integers(0, 9), min_size=MAX_MODEL_LEN + 1, max_size=MAX_MODEL_LEN + 1),
        odd_values,
    ),
)


@st.composite
def request_bodies(draw: st.DrawFn, prompt_field: str, prompt_values: Field, fields: dict[str, Field]) -> dict:
    """A body of valid values for a few fields, then (half the time) one to three of them made invalid."""
    body = {prompt_field: draw(prompt_values.valid), "max_tokens": draw(max_tokens.valid)}
    names = sorted(fields)
    for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        value = draw(st.one_of(fields[name].valid, st.just(_SKIP)))
        if value is not _SKIP:
            body[name] = value
    if "stream_options" in body:
        body["stream"] = True  # stream_options without stream: true is a 400 (vLLM's rule)
    if body.get("stream") or "max_completion_tokens" in body:
        # Sometimes no max_tokens (what fits / 16): kept to streams and max_completion_tokens, as it is long.
        if draw(st.booleans()):
            del body["max_tokens"]
    for name in draw(
        st.lists(st.sampled_from([prompt_field, "max_tokens", *names]), max_size=3, unique=True)
        if draw(st.booleans())
        else st.just([])
    ):
        source = {prompt_field: prompt_values, "max_tokens": max_tokens}.get(name) or fields[name]
        body[name] = draw(source.invalid)
    return body


_SKIP = object()
chat_bodies = request_bodies("messages", messages, CHAT_FIELDS)
completion_bodies = request_bodies("prompt", prompt, COMPLETION_FIELDS)


# -- the invariant --------------------------------------------------------------------------


def check_answer(replica: InProcessReplica, path: str, content: bytes, statuses: Counter[int]) -> None:
    response = replica.request("POST", path, content=content, headers={"content-type": "application/json"})
    statuses[response.status_code] += 1
    if response.status_code != 200:
        error = assert_openai_error(response)
        if error["code"] == "context_length_exceeded":  # names the field that is too long
            assert error["param"] == ("messages" if path.endswith("chat/completions") else "prompt"), error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        answer = response.json()
        assert answer["choices"] and answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0, answer
        assert all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in answer["choices"]), answer


def still_serves(replica: InProcessReplica) -> None:
    ok = replica.request("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def assert_idle(replica: InProcessReplica) -> None:
    stats = replica.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0), stats


def encode(payload: dict) -> bytes:
    return json.dumps(payload).encode()  # NaN and Infinity stay in (json.dumps writes them)


def assert_both_kinds_were_tried(statuses: Counter[int]) -> None:
    """The generator is useful only while it reaches the engine and the validators alike."""
    total = sum(statuses.values())
    assert statuses[200] >= total // 10 and total - statuses[200] >= total // 10, statuses


def fuzz_endpoint(replica, path: str, bodies: st.SearchStrategy[dict], examples: int) -> None:
    """POST ``examples`` generated ``bodies`` to ``path``: each gets a sane answer and the replica
    keeps serving; afterwards it is idle, and both accepted and refused bodies were tried."""
    statuses: Counter[int] = Counter()

    @settings(FUZZ, max_examples=examples)
    @given(bodies)
    def case(payload: dict) -> None:
        check_answer(replica, path, encode(payload), statuses)
        still_serves(replica)

    case()
    assert_idle(replica)
    assert_both_kinds_were_tried(statuses)


def test_fuzz_chat_completions(replica):
    fuzz_endpoint(replica, "/v1/chat/completions", chat_bodies, CHAT_EXAMPLES)


def test_fuzz_completions(replica):
    fuzz_endpoint(replica, "/v1/completions", completion_bodies, COMPLETION_EXAMPLES)


# -- tool calling, on a replica that serves tool_choice="auto" ---------------------------------

TOOL_EXAMPLES = 300
tool_name = st.sampled_from(["get_weather", "find_flights", "lookup"])
schema = st.one_of(
    st.none(),
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.just(
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        }
    ),
)
tool = st.builds(
    lambda name, params: {
        "type": "function",
        "function": {"name": name, **({"parameters": params} if params is not None else {})},
    },
    tool_name,
    schema,
)
valid_tools = st.lists(tool, min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])
invalid_tools = st.one_of(
    tool.map(lambda t: [t, t]),  # duplicate names
    tool.map(lambda t: [{**t, "function": {**t["function"], "parameters": {"type": "objekt"}}}]),
    tool.map(lambda t: [{**t, "function": {**t["function"], "parameters": {"properties": [1]}}}]),
    tool.map(lambda t: [{**t, "function": {**t["function"], "name": "no spaces allowed"}}]),
    tool.map(lambda t: [{**t, "type": "retrieval"}]),
    st.just([{"type": "function"}]),
)
call = st.builds(
    lambda i, name: {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": '{"city": "Oslo"}'},
    },
    st.integers(0, 3),
    tool_name,
)
tool_turns = st.lists(call, min_size=1, max_size=2, unique_by=lambda c: c["id"]).map(
    lambda calls: [
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "content": "ok", "tool_call_id": c["id"]} for c in calls),
    ]
)
tool_messages = Field(
    st.tuples(st.lists(valid_message.filter(lambda m: m["role"] != "tool"), min_size=1, max_size=2), tool_turns).map(
        lambda t: [*t[0], *t[1], {"role": "user", "content": "and now?"}]
    ),
    st.one_of(
        tool_turns.map(
            lambda turns: [
                {"role": "user", "content": "q"},
                turns[0],
                {"role": "tool", "content": "x", "tool_call_id": "call_unknown"},
            ]
        ),
        st.just([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]),
        call.map(lambda c: [{"role": "user", "content": "q", "tool_calls": [c]}]),
    ),
)
TOOL_FIELDS = {
    "tools": Field(valid_tools, invalid_tools),
    "tool_choice": field(
        st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            tool_name.map(lambda n: {"type": "function", "function": {"name": n}}),
        ),
        st.one_of(
            st.sampled_from(["sometimes", ""]),
            st.just({"type": "function", "function": {"name": "book_hotel"}}),
            st.just({"type": "function"}),
        ),
    ),
    "parallel_tool_calls": field(st.booleans()),
    "stream": field(st.booleans()),
    "temperature": field(st.floats(0, 2)),
}


@st.composite
def tool_bodies(draw: st.DrawFn) -> dict:
    body = draw(request_bodies("messages", tool_messages, TOOL_FIELDS))
    if "tools" not in body and draw(st.integers(0, 3)) > 0:
        body["tools"] = draw(valid_tools)  # without tool_choice: "auto"
        if draw(st.booleans()):
            body["tool_choice"] = draw(TOOL_FIELDS["tool_choice"].valid)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(body.get("tools"), list) and draw(st.booleans()):
        # Mostly a named function that is among the tools, sometimes one that is not.
        names = [t.get("function", {}).get("name") for t in body["tools"] if isinstance(t, dict)]
        if names and isinstance(names[0], str):
            body["tool_choice"] = {"type": "function", "function": {"name": names[0]}}
    return body


@pytest.fixture(scope="module")
def tool_replica(ckpt):
    """A second replica on the shared ckpt: 512 tokens, the hermes tool parser, auto tool choice."""
    r = InProcessReplica(
        ckpt,
        max_model_len=512,
        replica_name="fuzz-tools",
        engine_kwargs={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
    )
    try:
        yield r
    finally:
        r.close()


def test_fuzz_tool_calling(tool_replica):
    fuzz_endpoint(tool_replica, "/v1/chat/completions", tool_bodies(), TOOL_EXAMPLES)


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"{",
            b'{"messages": NaN}',
            b"[" * 5000,
            b'{"prompt": "x"' + b" " * 10,
            b'{"prompt": "\\ud800"}',
            b'\xef\xbb\xbf{"prompt": "x"}',
        ]
    ),
    st.recursive(
        st.one_of(st.none(), st.integers(), st.text(max_size=4)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["messages", "prompt", "role", "content", "n", "x"]), inner, max_size=3),
        ),
        max_leaves=12,
    ).map(lambda v: json.dumps(v).encode()),
)


def test_fuzz_bodies_that_are_not_requests(replica):
    @settings(FUZZ, max_examples=RAW_EXAMPLES)
    @given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), raw_bodies)
    def case(path: str, content: bytes) -> None:
        check_answer(replica, path, content, Counter())

    case()
    still_serves(replica)
    assert_idle(replica)
