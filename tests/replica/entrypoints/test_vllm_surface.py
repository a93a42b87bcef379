"""vLLM's server surface on one replica, in process: unknown request fields, tokenizer endpoints, info endpoints.

Routers and clients written for vLLM (vllm-router re-serialises chat requests with SGLang's
fields) or SGLang's gateway (it probes /get_server_info) must work unmodified; a strict server
keeps refusing unknown fields. The last test (slow) runs the same against a real replica process.
"""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest
from server_helpers import InProcessReplica, assert_openai_error

from prefixserve.replica.entrypoints.openai.request_fields import OTHER_FIELD, IgnoredFields
from prefixserve.replica.entrypoints.openai.server import ServerConfig, add_arguments

MAX_MODEL_LEN = 128
KEY = "sk-surface"
AUTH = {"authorization": f"Bearer {KEY}"}
# What vllm-router adds to every chat request it forwards (SGLang's ChatCompletionRequest fields).
SGLANG_FIELDS = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
# continue_final_message is vLLM's own field (declared, refused only when true): not ignored.
IGNORED = sorted(set(SGLANG_FIELDS) - {"continue_final_message"})
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "max_tokens": 2}
METRIC = "prefixserve:ignored_request_fields_total"
# conftest's replica: an InProcessReplica on the shared ckpt, with these options.
REPLICA_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, api_keys=[KEY])


def ignored_count(replica: InProcessReplica, field: str) -> float:
    labels = {"model_name": replica.engine.model_name, "engine": "0", "field": field}
    return replica.engine.metrics.registry.get_sample_value(METRIC, labels) or 0.0


def test_sglang_fields_are_ignored_counted_per_request_and_logged_once(replica, caplog):
    before = {f: ignored_count(replica, f) for f in IGNORED}
    with caplog.at_level(logging.WARNING, logger="prefixserve.replica.entrypoints.openai.request_fields"):
        for _ in range(2):
            response = replica.request("POST", "/v1/chat/completions", json={**CHAT, **SGLANG_FIELDS}, headers=AUTH)
            assert response.status_code == 200, response.text
    for f in IGNORED:
        assert ignored_count(replica, f) == before[f] + 2
        assert sum(repr(f) in r.getMessage() for r in caplog.records) == (0 if before[f] else 1), f
    assert ignored_count(replica, "continue_final_message") == 0


def test_a_strict_server_refuses_unknown_fields(ckpt):
    strict = InProcessReplica(ckpt, max_model_len=MAX_MODEL_LEN, strict_request_fields=True)
    try:
        response = strict.request("POST", "/v1/chat/completions", json={**CHAT, "no_stop_trim": False})
        error = assert_openai_error(response)
        assert error["code"] == "unknown_parameter" and error["param"] == "no_stop_trim"
        assert ignored_count(strict, "no_stop_trim") == 0
        assert strict.request("POST", "/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        strict.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("use_beam_search", True),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("priority", 3),
        ("truncate_prompt_tokens", 8),
        ("echo", True),
    ],
)
def test_vllm_fields_that_would_change_the_answer_stay_refused(replica, field, value):
    error = assert_openai_error(
        replica.request("POST", "/v1/chat/completions", json={**CHAT, field: value}, headers=AUTH)
    )
    assert error["code"] == "unsupported_parameter" and error["param"] == field


def test_unknown_nested_fields_and_bad_values_stay_refused(replica):
    nested = {**CHAT, "messages": [{"role": "user", "content": "x", "contnet": "y"}]}
    error = assert_openai_error(replica.request("POST", "/v1/chat/completions", json=nested, headers=AUTH))
    assert error["code"] == "unknown_parameter"
    bad = assert_openai_error(
        replica.request("POST", "/v1/completions", json={"prompt": "x", "n": "many"}, headers=AUTH)
    )
    assert bad["param"] == "n"


def test_tokenize_a_prompt_as_vllm_does(replica):
    tokenizer = replica.engine.tokenizer
    text = "alpha bravo charlie"
    body = replica.request("POST", "/tokenize", json={"prompt": text, "return_token_strs": True}, headers=AUTH).json()
    assert body["tokens"] == tokenizer(text).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = replica.request("POST", "/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=AUTH)
    assert plain.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert plain.json()["token_strs"] is None


def test_tokenized_and_rendered_chats_are_the_tokens_the_engine_runs(replica):
    tokenized = replica.request("POST", "/tokenize", json={"messages": CHAT["messages"]}, headers=AUTH).json()
    rendered = replica.request("POST", "/v1/chat/completions/render", json={**CHAT, **SGLANG_FIELDS}, headers=AUTH)
    assert rendered.status_code == 200, rendered.text
    render = rendered.json()
    served = replica.request("POST", "/v1/chat/completions", json=CHAT, headers=AUTH).json()
    assert tokenized["tokens"] == render["token_ids"]
    assert len(render["token_ids"]) == served["usage"]["prompt_tokens"]
    assert render["request_id"].startswith("chatcmpl-") and render["stream"] is False and render["priority"] == 0
    assert render["sampling_params"]["max_tokens"] == 2 and render["sampling_params"]["top_k"] == -1
    # Without the generation prompt the template renders fewer tokens.
    bare = {"messages": CHAT["messages"], "add_generation_prompt": False}
    assert replica.request("POST", "/tokenize", json=bare, headers=AUTH).json()["count"] < tokenized["count"]


def test_a_rendered_completion_is_a_list_of_one_with_the_prompt_tokens(replica):
    text = "alpha bravo"
    rendered = replica.request("POST", "/v1/completions/render", json={"prompt": text, "seed": 5}, headers=AUTH)
    assert rendered.status_code == 200, rendered.text
    [render] = rendered.json()
    assert render["token_ids"] == replica.engine.tokenizer(text).input_ids
    assert render["request_id"].startswith("cmpl-") and render["sampling_params"]["seed"] == 5
    assert render["sampling_params"]["max_tokens"] == 16  # OpenAI's completions default
    ids = replica.request("POST", "/v1/completions/render", json={"prompt": [5, 6, 7]}, headers=AUTH).json()
    assert ids[0]["token_ids"] == [5, 6, 7]


def test_tokenize_counts_a_prompt_past_max_model_len_that_generation_refuses(replica):
    long = "alpha " * 200
    for body in ({"prompt": long}, {"messages": [{"role": "user", "content": long}]}):
        response = replica.request("POST", "/tokenize", json=body, headers=AUTH)
        assert response.status_code == 200 and response.json()["count"] > MAX_MODEL_LEN
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 1}
    refused = replica.request("POST", "/v1/chat/completions", json=chat, headers=AUTH)
    assert assert_openai_error(refused)["code"] == "context_length_exceeded"


def test_detokenize_inverts_tokenize(replica):
    text = "hello there, general"
    ids = replica.request("POST", "/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=AUTH)
    back = replica.request("POST", "/detokenize", json={"tokens": ids.json()["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": text}
    error = assert_openai_error(replica.request("POST", "/detokenize", json={"tokens": [1, 10**7]}, headers=AUTH))
    assert error["param"] == "tokens.1"


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model_not_found"),
        ("/tokenize", {"messages": []}, 400, None),
        ("/tokenize", {**CHAT, "continue_final_message": True}, 400, "unsupported_parameter"),
        ("/tokenize", {"prompt": "x" * 100_000}, 400, "context_length_exceeded"),
        ("/detokenize", {"tokens": "abc"}, 400, None),
        ("/v1/chat/completions/render", {**CHAT, "continue_final_message": True}, 400, "unsupported_parameter"),
        ("/v1/chat/completions/render", {**CHAT, "model": "nope"}, 404, "model_not_found"),
    ],
)
def test_tokenizer_endpoints_answer_errors_in_the_openai_body(replica, path, body, status, code):
    response = replica.request("POST", path, json=body, headers=AUTH)
    error = assert_openai_error(response)
    assert response.status_code == status and (code is None or error["code"] == code)


def test_tokenizer_and_info_endpoints_need_the_key_but_version_does_not(replica):
    for method, path in [("POST", "/tokenize"), ("POST", "/v1/chat/completions/render"), ("GET", "/get_server_info")]:
        assert replica.request(method, path, json={"prompt": "x"}).status_code == 401
    assert replica.request("GET", "/version").status_code == 200


def test_info_endpoints_have_the_fields_routers_read(replica):
    version = replica.request("GET", "/version").json()["version"]
    assert isinstance(version, str) and version
    for path in ("/server_info", "/get_server_info"):
        info = replica.request("GET", path, headers=AUTH).json()
        assert info["dp_size"] == 1 and info["version"] == version
        assert info["page_size"] == replica.engine.config.block_size
        assert info["context_length"] == MAX_MODEL_LEN and info["served_model_name"] == replica.engine.model_name
        assert info["internal_states"][0]["max_total_num_tokens"] > 0
        assert "api_key" not in info and KEY not in str(info)
    for path in ("/model_info", "/get_model_info"):
        model = replica.request("GET", path, headers=AUTH).json()
        assert model["is_generation"] is True and model["model_path"] == replica.engine.config.model
        assert model["architectures"] == ["LlamaForCausalLM"]


def test_the_ignored_field_names_are_bounded():
    seen: list[str] = []
    fields = IgnoredFields(count=seen.append, max_names=2)
    from prefixserve.replica.entrypoints.openai.protocol import CompletionRequest

    kept = fields.filter(CompletionRequest, {"prompt": "x", "a": 1, "b": 2, "c": 3, "d": 4})
    assert kept == {"prompt": "x"}
    assert seen == ["a", "b", OTHER_FIELD, OTHER_FIELD]
    strict = IgnoredFields(strict=True)
    body = {"prompt": "x", "a": 1}
    assert strict.filter(CompletionRequest, body) is body


def test_the_strict_flag_is_a_replica_option():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--strict-request-fields"]).strict_request_fields is True
    assert parser.parse_args([]).strict_request_fields is False
    assert ServerConfig().strict_request_fields is False


@pytest.mark.slow
def test_a_real_replica_serves_what_vllm_router_sends(ckpt, tmp_path):
    """A ``prefixserve replica`` process: chat requests with every SGLang field vllm-router adds,
    /tokenize and the render call; the fields are counted per request and logged once."""
    from server_helpers import ReplicaProcess, metric

    with ReplicaProcess(ckpt, "--max-model-len", "256", log_dir=tmp_path) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=120) as http:
            for _ in range(3):
                answer = http.post("/v1/chat/completions", json={**CHAT, **SGLANG_FIELDS})
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["role"] == "assistant"
            tokens = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()
            render = http.post("/v1/chat/completions/render", json={**CHAT, **SGLANG_FIELDS}).json()
            assert tokens["tokens"] == render["token_ids"]
            assert tokens["count"] == answer.json()["usage"]["prompt_tokens"]
            metrics = http.get("/metrics").text
        # Three chat requests and the render each sent every ignored field.
        for f in IGNORED:
            assert metric(metrics, METRIC, field=f) == 4
        log = proc.log_path.read_text()
        for f in IGNORED:
            assert log.count(f"request field {f!r}") == 1, f
