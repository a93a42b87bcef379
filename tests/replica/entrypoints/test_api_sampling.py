"""The sampling parameters through the real front end and a tiny engine: prompt_logprobs in
vLLM's shape on chat and completions, completions' echo (text, logprobs, streamed),
include_stop_str_in_output, and clear 400s for out-of-range values."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_helpers import hf_model
from server_helpers import assert_openai_error

PROMPT = "the quick brown fox jumps over the lazy dog"
REPLICA_OPTIONS = dict(max_model_len=128)  # conftest's replica: an InProcessReplica on the shared ckpt


def post(replica, path: str, **body):
    return replica.request("POST", path, json=body)


def completion(replica, **body) -> dict:
    response = post(replica, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_prompt_logprobs_are_vllms_and_equal_transformers(replica, ckpt):
    tok = replica.engine.engine.tokenizer
    ids = tok(PROMPT).input_ids
    answer = completion(replica, prompt_logprobs=2)
    got = answer["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    hf = hf_model(str(ckpt))
    with torch.no_grad():
        ref = torch.log_softmax(
            hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0].float(), dim=-1
        )
    for pos in range(1, len(ids)):
        entry = got[pos]
        assert str(ids[pos]) in entry
        top = ref[pos - 1].topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entry)
        for token, item in entry.items():
            assert math.isclose(item["logprob"], float(ref[pos - 1, int(token)]), abs_tol=2e-4)
            assert item["decoded_token"] == tok.decode([int(token)])
        assert sorted(item["rank"] for t, item in entry.items() if int(t) in top) == [1, 2]
        assert entry[str(ids[pos])]["rank"] == ref[pos - 1].argsort(descending=True).tolist().index(ids[pos]) + 1
    assert completion(replica)["choices"][0]["prompt_logprobs"] is None


def test_chat_prompt_logprobs_at_the_top_level(replica):
    body = dict(messages=[{"role": "user", "content": "hi there"}], max_tokens=2, prompt_logprobs=0)
    answer = post(replica, "/v1/chat/completions", **body).json()
    lps = answer["prompt_logprobs"]
    assert lps[0] is None and all(len(e) == 1 for e in lps[1:])
    assert answer["usage"]["prompt_tokens"] == len(lps)
    refused = post(replica, "/v1/chat/completions", **{**body, "stream": True, "prompt_logprobs": 1})
    assert refused.status_code == 400 and assert_openai_error(refused)["param"] == "prompt_logprobs"


def test_echo_repeats_the_prompt_with_its_logprobs(replica):
    plain = completion(replica)["choices"][0]
    echoed = completion(replica, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    with_lps = completion(replica, echo=True, logprobs=1)["choices"][0]
    n_prompt = len(replica.engine.engine.tokenizer(PROMPT).input_ids)
    lps = with_lps["logprobs"]
    assert len(lps["tokens"]) == n_prompt + 4
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(v is not None for v in lps["token_logprobs"][1:])
    assert "".join(lps["tokens"]) == with_lps["text"]
    assert lps["text_offset"][n_prompt] == len(PROMPT)


def test_echo_streams_the_prompt_first(replica):
    response = post(
        replica, "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0, stream=True
    )
    events = [
        json.loads(line[6:])
        for line in response.text.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == completion(replica, echo=True)["choices"][0]["text"]


def test_include_stop_str_in_output(replica):
    full = completion(replica, max_tokens=12)["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full.index(stop)
    for stream in (False, True):
        response = post(
            replica,
            "/v1/completions",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            include_stop_str_in_output=True,
            stream=stream,
        )
        if stream:
            text = "".join(
                c["text"]
                for line in response.text.split("\n")
                if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"]
            )
        else:
            text = response.json()["choices"][0]["text"]
        assert text == full[: cut + len(stop)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1),
        ("min_p", 1.01),
        ("top_p", 0),
        ("prompt_logprobs", 21),
        ("allowed_token_ids", [10**6]),
        ("allowed_token_ids", []),
        ("bad_words", [" "]),
        ("logit_bias", {"5": 100.5}),
    ],
)
def test_out_of_range_values_are_400(replica, field, value):
    response = post(replica, "/v1/completions", prompt=PROMPT, max_tokens=2, **{field: value})
    assert response.status_code == 400 and field in assert_openai_error(response)["message"]


def test_a_request_that_masks_every_token_fails_alone_with_400(replica):
    eos = 2
    response = post(replica, "/v1/completions", prompt=PROMPT, max_tokens=3, min_tokens=2, allowed_token_ids=[eos])
    assert response.status_code == 400 and "no token can be sampled" in assert_openai_error(response)["message"]
    assert completion(replica)["choices"][0]["text"] is not None
    stats = replica.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_echo_of_a_token_id_prompt(replica):
    ids = replica.engine.engine.tokenizer(PROMPT).input_ids
    response = post(replica, "/v1/completions", prompt=ids, max_tokens=3, temperature=0, echo=True)
    plain = post(replica, "/v1/completions", prompt=ids, max_tokens=3, temperature=0)
    assert response.status_code == plain.status_code == 200
    assert response.json()["choices"][0]["text"] == PROMPT + plain.json()["choices"][0]["text"]
