"""replica/entrypoints/openai/protocol.py: request parsing and validation, SamplingParams, responses, error mapping."""

from __future__ import annotations

import json
import random

import pytest

from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import (
    AuthenticationError,
    BadRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InternalServerError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    PromptTooLongError,
    RequestFailedError,
    RequestRejected,
    ServiceUnavailableError,
)


def chat_body(**overrides) -> bytes:
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    body.update(overrides)
    return json.dumps(body).encode()


def parse_chat(**overrides) -> api.ChatCompletionRequest:
    return api.parse_request(api.ChatCompletionRequest, chat_body(**overrides))


def bad_request(model: type, body: bytes | str) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        api.parse_request(model, body)
    assert info.value.status_code == 400
    assert info.value.error_type == "invalid_request_error"
    return info.value


# -- chat requests -------------------------------------------------------------


def test_chat_request_parses_roles_content_parts_and_harmless_fields():
    req = api.parse_request(
        api.ChatCompletionRequest,
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "system", "content": "c"},
                    {"role": "user", "content": "q", "name": "bob"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "t1"},
                ],
                "stream": True,
                "stream_options": {"include_usage": True, "include_obfuscation": True},
                "logit_bias": {},
                # Harmless fields real clients send: accepted and ignored.
                "user": "u-1",
                "safety_identifier": "s",
                "metadata": {"k": "v"},
                "store": False,
                "service_tier": "auto",
                "prompt_cache_key": "pk",
                "tools": [],
                "tool_choice": "none",
                "response_format": {"type": "text"},
                "modalities": ["text"],
                "presence_penalty": 0,
            }
        ),
    )
    assert req.chat_messages() == [
        {"role": "developer", "content": "a\nb"},
        {"role": "system", "content": "c"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]
    assert req.include_usage
    assert req.stream


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"", None),
        (json.dumps({"model": "m"}), "messages"),
        (json.dumps({"model": "m", "messages": []}), "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role"),
        (json.dumps({"messages": [{"content": "x"}]}), "messages.0.role"),
        (
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages.0.content",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "bad_words": "x"}), "bad_words"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, "prompt_logprobs": 1}),
            "prompt_logprobs",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}), "cache_salt"),
        # vLLM's rule: stream_options only with stream: true.
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}),
            "stream_options",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {}}),
            "stream_options",
        ),
    ],
)
def test_malformed_or_incomplete_chat_bodies_are_400(body, param):
    err = bad_request(api.ChatCompletionRequest, body)
    assert err.param == param
    assert err.message


@pytest.mark.parametrize("field", ["some_future_field", "mini_p", "temprature"])
def test_unknown_fields_are_400_naming_the_field(field):
    err = bad_request(api.ChatCompletionRequest, chat_body(**{field: 1}))
    assert err.code == "unknown_parameter" and err.param == field
    assert repr(field) in err.message
    # Nested objects are as strict: a typo inside a message is named with its path.
    nested = bad_request(
        api.ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "x", "contnet": "y"}]})
    )
    assert nested.code == "unknown_parameter" and nested.param == "messages.0.contnet"
    completion = bad_request(api.CompletionRequest, json.dumps({"prompt": "x", field: 1}))
    assert completion.param == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("reasoning_effort", "low"),
        ("verbosity", "high"),
        ("moderation", {}),
    ],
)
def test_openai_fields_the_engine_does_not_implement_are_400(field, value):
    err = bad_request(api.ChatCompletionRequest, chat_body(**{field: value}))
    assert err.code == "unsupported_parameter" and err.param == field
    assert "not supported" in err.message


@pytest.mark.parametrize("field, value", [("store", True), ("service_tier", "flex"), ("service_tier", "priority")])
def test_unsupported_values_of_harmless_fields_are_400(field, value):
    err = bad_request(api.ChatCompletionRequest, chat_body(**{field: value}))
    assert err.code == "unsupported_value" and err.param == field


def test_function_call_and_audio_turns_in_the_conversation_are_400():
    for field, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a"})):
        body = json.dumps(
            {"messages": [{"role": "assistant", "content": None, field: value}, {"role": "user", "content": "x"}]}
        )
        err = bad_request(api.ChatCompletionRequest, body)
        assert err.code == "unsupported_parameter" and err.param == f"messages.0.{field}"


def test_logit_bias_maps_token_id_strings_onto_sampling_params():
    req = parse_chat(logit_bias={"15": 100, "7": -100, "3": 0.5})
    assert req.to_sampling_params(default_max_tokens=4).logit_bias == {15: 100.0, 7: -100.0, 3: 0.5}
    assert parse_chat(logit_bias={}).to_sampling_params(default_max_tokens=4).logit_bias is None
    completion = api.parse_request(api.CompletionRequest, json.dumps({"prompt": "x", "logit_bias": {"2": 1}}))
    assert completion.to_sampling_params(default_max_tokens=4).logit_bias == {2: 1.0}


@pytest.mark.parametrize(
    "logit_bias, param",
    [
        ({"15": 101}, "logit_bias.15"),
        ({"15": -100.5}, "logit_bias.15"),
        ({"abc": 1}, "logit_bias.abc"),
        ({"-1": 1}, "logit_bias.-1"),
        ({str(2**40): 1}, f"logit_bias.{2**40}"),
        ({"1": "x"}, "logit_bias.1"),
    ],
)
def test_bad_logit_bias_is_400(logit_bias, param):
    err = bad_request(api.ChatCompletionRequest, chat_body(logit_bias=logit_bias))
    assert err.param is not None and err.param.startswith("logit_bias") and err.code == "invalid_value"


@pytest.mark.parametrize(
    "overrides",
    [
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"seed": 10**40},
        {"max_tokens": 10**30},
        {"n": 2**70},
        {"stop_token_ids": [2**31]},
        {"stop_token_ids": [10**30]},
        {"top_logprobs": 10**25},
    ],
)
def test_integers_beyond_int64_are_clean_400s(overrides):
    err = bad_request(api.ChatCompletionRequest, chat_body(**overrides))
    assert err.code == "invalid_value" and err.param.split(".")[0] == next(iter(overrides))
    assert "overflow" not in err.message.lower() and "Python" not in err.message
    huge_prompt = bad_request(api.CompletionRequest, json.dumps({"prompt": [1, 10**30]}))
    assert huge_prompt.param is not None and huge_prompt.param.startswith("prompt")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
    ],
)
def test_non_finite_numbers_are_400(raw):
    err = bad_request(api.ChatCompletionRequest, raw)
    assert err.code in ("invalid_json", "invalid_value")


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b"42",
        b'"text"',
        b"null",
        b"\xff\xfe{",
        b"[" * 100_000,
        # A lone surrogate: Python's json accepts it, no tokenizer can encode it
        # (found by tests/replica/entrypoints/test_fuzz_api.py as a 500).
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(raw):
    err = bad_request(api.ChatCompletionRequest, raw)
    assert err.code == "invalid_json"


def test_every_error_has_a_code():
    for cls in (
        BadRequestError,
        AuthenticationError,
        ModelNotFoundError,
        PayloadTooLargeError,
        OverloadedError,
        ServiceUnavailableError,
        InternalServerError,
    ):
        assert cls("x").body()["error"]["code"]


def test_internal_errors_do_not_leak_their_text():
    err = api.error_from_exception(OverflowError("Python int too large to convert to C long"))
    assert err.status_code == 500 and "C long" not in err.message and err.code == "internal_error"


def test_malformed_json_says_so():
    err = bad_request(api.ChatCompletionRequest, b'{"messages": [')
    assert err.code == "invalid_json"
    assert "JSON" in err.message


def test_chat_sampling_params_mapping():
    rng = random.Random(11)
    temperature, top_p, seed = round(rng.uniform(0, 2), 3), round(rng.uniform(0.1, 1), 3), rng.randrange(2**31)
    req = parse_chat(
        temperature=temperature,
        top_p=top_p,
        top_k=7,
        n=3,
        seed=seed,
        stop="END",
        max_completion_tokens=9,
        max_tokens=100,
        logprobs=True,
        top_logprobs=4,
        stop_token_ids=[5],
        ignore_eos=True,
    )
    p = req.to_sampling_params(default_max_tokens=50, max_model_len=200)
    assert (p.temperature, p.top_p, p.top_k, p.n, p.seed) == (temperature, top_p, 7, 3, seed)
    assert p.max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert p.stop == ["END"] and p.stop_token_ids == [5] and p.ignore_eos
    assert p.logprobs == 4


def test_chat_defaults_use_openai_defaults_and_the_given_max_tokens():
    p = parse_chat().to_sampling_params(default_max_tokens=77, max_model_len=100)
    assert (p.temperature, p.top_p, p.top_k, p.n, p.max_tokens, p.logprobs) == (1.0, 1.0, None, 1, 77, None)
    assert parse_chat(logprobs=True).to_sampling_params(default_max_tokens=1).logprobs == 0
    # A prompt that already fills the context still yields valid params; the engine refuses it.
    assert parse_chat().to_sampling_params(default_max_tokens=-3).max_tokens == 1


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"max_completion_tokens": -1},
        {"max_tokens": 10**9},
        {"max_tokens": 101},
        {"temperature": 2.5},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"n": 0},
        {"n": 1000},
        {"top_logprobs": 3},  # without logprobs=true
        {"logprobs": True, "top_logprobs": 50},
        {"stop": [""]},
    ],
)
def test_out_of_range_sampling_values_raise_value_error_mapped_to_400(overrides):
    req = parse_chat(**overrides)
    with pytest.raises(ValueError) as info:
        req.to_sampling_params(default_max_tokens=10, max_model_len=100)
    err = api.error_from_exception(info.value)
    assert err.status_code == 400 and err.error_type == "invalid_request_error"
    assert str(info.value) == err.message


def test_max_tokens_equal_to_max_model_len_is_left_to_the_engine():
    assert parse_chat(max_tokens=100).to_sampling_params(default_max_tokens=1, max_model_len=100).max_tokens == 100


# -- completions requests ------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["only one"], "only one"), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt, expected):
    req = api.parse_request(api.CompletionRequest, json.dumps({"model": "m", "prompt": prompt}))
    assert req.prompt == expected
    p = req.to_sampling_params(default_max_tokens=api.DEFAULT_COMPLETION_MAX_TOKENS)
    assert p.max_tokens == 16 and p.logprobs is None


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": ["a", "b"]},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [1, -2]},
        {"prompt": "x", "suffix": "tail"},
        {"prompt": "x", "n": 2, "best_of": 3},
        {},
    ],
)
def test_bad_completion_bodies_are_400(extra):
    bad_request(api.CompletionRequest, json.dumps({"model": "m", **extra}))


def test_completion_logprobs_and_best_of_equal_to_n():
    req = api.parse_request(api.CompletionRequest, json.dumps({"prompt": "x", "logprobs": 2, "n": 2, "best_of": 2}))
    p = req.to_sampling_params(default_max_tokens=4)
    assert p.logprobs == 2 and p.n == 2


# -- responses ------------------------------------------------------------------


def test_usage_always_carries_cached_tokens():
    dumped = api.Usage.build(10, 4, 0).model_dump()
    assert dumped == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert api.Usage(prompt_tokens=3).model_dump()["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_response_and_chunk_round_trip_through_the_openai_client_types():
    openai_types = pytest.importorskip("openai.types.chat")
    response = api.ChatCompletionResponse(
        id="chatcmpl-1",
        model="m",
        choices=[api.ChatChoice(index=0, message=api.ChatResponseMessage(content="hey"), finish_reason="stop")],
        usage=api.Usage.build(12, 1, 8),
    )
    parsed = openai_types.ChatCompletion.model_validate(response.model_dump())
    assert parsed.choices[0].message.content == "hey"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    chunk = api.ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[api.ChatChunkChoice(index=1, delta=api.DeltaMessage(content="x"), finish_reason="length")],
    )
    parsed_chunk = openai_types.ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert parsed_chunk.choices[0].delta.content == "x" and parsed_chunk.choices[0].index == 1


def test_logprob_rendering():
    text = {1: "a", 2: "bb", 3: "c"}.__getitem__
    entries = [{1: -0.1, 2: -2.0, 3: -3.0}, {3: -0.5, 1: -0.7}]
    chat = api.chat_logprobs([1, 3], entries, 1, text)
    assert [(c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in chat.content] == [
        ("a", -0.1, ["a"]),
        ("c", -0.5, ["c"]),
    ]
    # Sampled token outside the top-k: the top list still holds the true top-k.
    comp = api.completion_logprobs([2, 1], entries, 1, text, text_offset=5)
    assert comp.tokens == ["bb", "a"]
    assert comp.token_logprobs == [-2.0, -0.7]
    assert comp.top_logprobs == [{"a": -0.1}, {"c": -0.5}]
    assert comp.text_offset == [5, 7]


# -- error mapping --------------------------------------------------------------


@pytest.mark.parametrize(
    "exc, status, type_",
    [
        (ValueError("bad"), 400, "invalid_request_error"),
        (RequestRejected("never"), 400, "invalid_request_error"),
        (PromptTooLongError("too long"), 400, "invalid_request_error"),
        (AuthenticationError("key"), 401, "authentication_error"),
        (ModelNotFoundError("nope"), 404, "invalid_request_error"),
        (PayloadTooLargeError("big"), 413, "invalid_request_error"),
        (EngineOverloadedError("full", retry_after_s=2.2), 429, "rate_limit_error"),
        (EngineDeadError("dead"), 503, "service_unavailable"),
        (RuntimeError("boom"), 500, "server_error"),
    ],
)
def test_error_mapping(exc, status, type_):
    err = api.error_from_exception(exc)
    assert (err.status_code, err.error_type) == (status, type_)
    body = err.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    api.ErrorResponse.model_validate(body)


@pytest.mark.parametrize(
    "exc",
    [
        RequestRejected("never"),
        PromptTooLongError("too long"),
        EngineOverloadedError("full"),
        RequestFailedError("failed"),
        EngineDeadError("dead"),
    ],
)
def test_engine_errors_are_answered_with_the_status_they_carry(exc):
    assert api.error_from_exception(exc).status_code == type(exc).status_code


def test_overload_carries_retry_after_rounded_up():
    err = api.error_from_exception(EngineOverloadedError("full", retry_after_s=2.2))
    assert err.headers() == {"Retry-After": "3"}
    assert api.error_from_exception(EngineOverloadedError("full", retry_after_s=0.01)).headers() == {"Retry-After": "1"}
    assert api.error_from_exception(ValueError("x")).headers() == {}


def test_prompt_too_long_has_openai_code():
    err = api.error_from_exception(PromptTooLongError("prompt of 5000 tokens exceeds max_model_len 4096"))
    assert err.code == "context_length_exceeded"
    assert "5000" in err.message and err.param == "messages"


def test_vllm_sampling_fields_map_onto_sampling_params():
    p = parse_chat(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.1,
        bad_words=["no"],
        allowed_token_ids=[3, 4],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        prompt_logprobs=2,
    ).to_sampling_params(default_max_tokens=8)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert p.bad_words == ["no"] and p.allowed_token_ids == [3, 4] and p.prompt_logprobs == 2
    assert p.include_stop_str_in_output and not p.skip_special_tokens and not p.spaces_between_special_tokens
    # Their defaults (and repetition_penalty=1.0, which vLLM's own benchmark client sends) are no-ops.
    off = parse_chat(repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0).to_sampling_params(
        default_max_tokens=8
    )
    assert not off.has_penalties and off.min_p == 0.0 and off.prompt_logprobs is None
    # Completions: an echoed prompt brings its logprobs when logprobs are asked (vLLM's rule).
    echo = api.parse_request(api.CompletionRequest, json.dumps({"prompt": "x", "echo": True, "logprobs": 3}))
    assert echo.to_sampling_params(default_max_tokens=4).prompt_logprobs == 3
    plain = api.parse_request(api.CompletionRequest, json.dumps({"prompt": "x", "echo": True}))
    assert plain.to_sampling_params(default_max_tokens=4).prompt_logprobs is None
    # prompt_logprobs=0 may stream (vLLM: only positive values are refused with stream).
    assert parse_chat(stream=True, prompt_logprobs=0).prompt_logprobs == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("prompt_logprobs", 21),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
    ],
)
def test_out_of_range_sampling_fields_are_400(field, value):
    with pytest.raises(ValueError, match=field):
        parse_chat(**{field: value}).to_sampling_params(default_max_tokens=8)
    err = api.error_from_exception(ValueError(f"{field} ..."))
    assert err.status_code == 400 and err.code == "invalid_value"
