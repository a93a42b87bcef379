"""OpenAI's ``prompt_cache_retention`` through the real front end and engine: "24h" pins the prompt's
blocks, which then survive a burst that evicts every unpinned prompt; the answer says whether the
budget held them; over the budget a request is served unpinned and counted; another value is a
400; the tokens are the same either way."""

from __future__ import annotations

import random

from server_helpers import assert_openai_error, metric

from prefixserve.replica.contract.retention import CACHE_RETENTION_HEADER, RETENTION_PINNED, RETENTION_UNPINNED

# 32 blocks of 16 tokens: pins may hold 16 of them, one owner 8. LRU (vLLM's order), so that a
# prompt hit twice is not protected from the burst by the default SLRU as well.
REPLICA_OPTIONS = {
    "max_model_len": 512,
    "engine_kwargs": {
        "num_kv_blocks": 32,
        "eviction_policy": "lru",
        "cache_retention_budget": 0.5,
        "cache_retention_tenant_budget": 0.5,
    },
}
WORDS = "alpha beta gamma delta river stone cloud maple ember quartz violet harbor canyon lantern".split()


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _chat(replica, system: str, retention: str | None = None):
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    if retention is not None:
        body["prompt_cache_retention"] = retention
    response = replica.request("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def _cached(response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _burst(replica, seed: int) -> None:
    """One-shot prompts of about 6 blocks each, 12 of them: every unpinned block is reused."""
    for i in range(12):
        answer = replica.request("POST", "/v1/completions", json={"prompt": _text(seed * 100 + i, 90), "max_tokens": 1})
        assert answer.status_code == 200, answer.text


def test_a_value_openai_does_not_define_is_a_400(replica):
    for value in ("1h", "", 24, "24H"):
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt_cache_retention": value}
        error = assert_openai_error(replica.request("POST", "/v1/chat/completions", json=body))
        assert error["param"] == "prompt_cache_retention", error


def test_in_memory_is_the_cache_as_it_is_and_says_nothing(replica):
    response = _chat(replica, _text(1, 30), "in_memory")
    assert CACHE_RETENTION_HEADER not in response.headers


def test_a_pinned_prompt_survives_a_burst_that_evicts_an_unpinned_one(replica):
    kept, dropped = _text(2, 40), _text(3, 40)
    first = _chat(replica, kept, "24h")
    assert first.headers[CACHE_RETENTION_HEADER] == RETENTION_PINNED
    _chat(replica, dropped)
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert _cached(_chat(replica, dropped)) > 0  # cached before the burst
    _burst(replica, seed=4)
    assert _cached(_chat(replica, dropped)) == 0
    again = _chat(replica, kept, "24h")
    assert _cached(again) == prompt_tokens // 16 * 16 - (16 if prompt_tokens % 16 == 0 else 0)
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    metrics = replica.request("GET", "/metrics").text
    assert metric(metrics, "prefixserve:kv_pinned_blocks") >= prompt_tokens // 16


def test_a_prompt_over_the_owners_budget_is_served_unpinned_and_counted(replica):
    before = metric(replica.request("GET", "/metrics").text, "prefixserve:kv_pin_refusals_total")
    large = _chat(replica, _text(5, 200), "24h")  # more than 8 blocks
    assert large.headers[CACHE_RETENTION_HEADER] == RETENTION_UNPINNED
    after = metric(replica.request("GET", "/metrics").text, "prefixserve:kv_pin_refusals_total")
    assert after == before + 1


def test_retention_changes_no_token(replica):
    system = _text(6, 25)
    pinned = _chat(replica, system, "24h").json()["choices"][0]["message"]
    plain = _chat(replica, _text(7, 25)).json()["choices"][0]["message"]
    assert _chat(replica, _text(7, 25), "24h").json()["choices"][0]["message"] == plain
    assert _chat(replica, system).json()["choices"][0]["message"] == pinned
