"""The sampling parameters through the engine on a tiny random checkpoint: each one changes
the tokens when on and none when off (greedy stays transformers'), prompt_logprobs equal a
direct transformers forward (with prefix caching, chunked prefill, preemption, n > 1),
and the output-text switches (include_stop_str_in_output, skip_special_tokens)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_helpers import hf_greedy, hf_model, shared_prefix_prompts

from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams

MAX_TOKENS = 12
# Every new parameter at the value that turns it off, spelled out.
OFF = dict(
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    min_p=0.0,
    bad_words=[],
    allowed_token_ids=None,
    include_stop_str_in_output=False,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    prompt_logprobs=None,
)


@pytest.fixture(scope="module")
def ckpt_seed11(tiny_ckpts):
    """The shared tiny shape with seed 11's weights: on the shared ``ckpt`` (seed 0) banning the
    bad_words case's word leaves the greedy tokens as they were, and that check fails."""
    return tiny_ckpts(seed=11)


@pytest.fixture(scope="module")
def hf(ckpt_seed11):
    return hf_model(ckpt_seed11)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=7, prefix_len=37, n=4, lo=3, hi=20)


@pytest.fixture(scope="module")
def llm(ckpt_seed11):
    return LLM(ckpt_seed11, num_kv_blocks=64, max_num_batched_tokens=128)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def test_parameters_off_change_nothing(llm, hf, prompts):
    outs = llm.generate(prompts, greedy(**OFF))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert all(o.prompt_logprobs is None for o in outs)


def _greedy_tokens(llm, prompt, **kwargs) -> list[int]:
    return llm.generate([prompt], greedy(**kwargs))[0].outputs[0].token_ids


def test_each_parameter_changes_the_tokens_when_on(llm, prompts):
    prompt = prompts[0]
    base = _greedy_tokens(llm, prompt)
    assert len(set(base)) == len(base)  # a random model seldom repeats: penalties below the ones that favour repeats
    word = llm.engine.tokenizer.decode([base[2]])
    cases = {
        "presence_penalty": dict(presence_penalty=-2.0),
        "frequency_penalty": dict(frequency_penalty=-2.0),
        "repetition_penalty": dict(repetition_penalty=0.01),
        "allowed_token_ids": dict(allowed_token_ids=[t for t in range(100, 200)]),
        "bad_words": dict(bad_words=[word]),
        "logit_bias": dict(logit_bias={base[0]: -100.0}),
    }
    for name, kwargs in cases.items():
        got = _greedy_tokens(llm, prompt, **kwargs)
        assert got != base, name
        if name.endswith("_penalty"):
            assert len(set(got)) < len(got) or (name == "repetition_penalty" and set(got) & set(prompt)), name
        if name == "allowed_token_ids":
            assert all(100 <= t < 200 for t in got)
        if name == "logit_bias":
            assert got[0] != base[0]


def test_bad_words_never_appear_in_the_output(llm, prompts):
    base = _greedy_tokens(llm, prompts[1])
    banned = base[1:3]
    word = llm.engine.tokenizer.decode(banned)
    ids = llm.engine.input_processor.bad_words_token_ids([word])
    got = _greedy_tokens(llm, prompts[1], bad_words=[word])
    for w in ids:
        assert not any(tuple(got[i : i + len(w)]) == w for i in range(len(got) - len(w) + 1))


def test_min_p_one_at_any_temperature_is_greedy(llm, prompts):
    base = _greedy_tokens(llm, prompts[2])
    hot = (
        llm.generate(
            [prompts[2]], SamplingParams(temperature=2.0, min_p=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert hot == base
    unfiltered = (
        llm.generate([prompts[2]], SamplingParams(temperature=2.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert unfiltered != base


def test_a_top_p_below_float32_is_greedy_not_token_0(llm, prompts):
    base = _greedy_tokens(llm, prompts[3])
    out = llm.generate(
        [prompts[3]], SamplingParams(temperature=1.0, top_p=1e-300, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0].outputs[0]
    assert out.token_ids == base and 0 not in out.token_ids


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_prompt_logprobs(got, hf, prompt, k):
    ref = _hf_prompt_logprobs(hf, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        row, entry = ref[pos - 1], got[pos]
        top = set(row.topk(k).indices.tolist()) if k else set()
        assert set(entry) == top | {prompt[pos]}
        for token, value in entry.items():
            assert math.isclose(value, float(row[token]), abs_tol=2e-4), (pos, token)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # chunked prefill: the rows arrive over several steps
        dict(num_kv_blocks=9, max_num_batched_tokens=64),  # preemption
        dict(num_kv_blocks=9, max_num_batched_tokens=8, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["plain", "chunked-8", "preempt", "swap-chunked"],
)
def test_prompt_logprobs_equal_a_transformers_forward(ckpt_seed11, hf, prompts, knobs):
    llm = LLM(ckpt_seed11, **{"num_kv_blocks": 64, "max_num_batched_tokens": 128, **knobs})
    # Warm the prefix cache with the same prompts: a prompt_logprobs request must not take the hit.
    llm.generate(prompts, greedy())
    outs = llm.generate(prompts, [greedy(prompt_logprobs=k) for k in (0, 1, 5, 20)])
    for out, prompt, k in zip(outs, prompts, (0, 1, 5, 20)):
        _check_prompt_logprobs(out.prompt_logprobs, hf, prompt, k)
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
    if "num_kv_blocks" in knobs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.usage == 0.0
    # Without prompt_logprobs the same prompts hit the cache again.
    assert all(o.num_cached_tokens > 0 for o in llm.generate(prompts, greedy()))


def test_prompt_logprobs_with_n_children(llm, hf, prompts):
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2))[0]
    _check_prompt_logprobs(out.prompt_logprobs, hf, prompts[0], 2)
    assert len(out.outputs) == 3


def test_include_stop_str_in_output(llm, prompts):
    full = llm.generate([prompts[0]], greedy())[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    cut = text.index(stop)
    without = llm.generate([prompts[0]], greedy(stop=[stop]))[0].outputs[0]
    with_ = llm.generate([prompts[0]], greedy(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert without.text == text[:cut] and with_.text == text[: cut + len(stop)]


def test_skip_special_tokens_off_keeps_their_text(llm, prompts):
    tok = llm.engine.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")
    params = dict(allowed_token_ids=[special], max_tokens=3, temperature=0.0, ignore_eos=True)
    kept = llm.generate([prompts[0]], SamplingParams(skip_special_tokens=False, **params))[0].outputs[0]
    skipped = llm.generate([prompts[0]], SamplingParams(**params))[0].outputs[0]
    assert kept.token_ids == skipped.token_ids == [special] * 3
    assert kept.text == "<|im_start|>" * 3 and skipped.text == ""
    # No tokenizer decoder here puts spaces between special tokens: the switch changes nothing, as in vLLM.
    spaced = llm.generate(
        [prompts[0]], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False, **params)
    )[0].outputs[0]
    assert spaced.text == kept.text


def test_prompt_logprobs_of_a_prompt_longer_than_an_lm_head_slice(ckpt_seed11, hf, prompts):
    from prefixserve.replica.worker.model_shard import LOGIT_SLICE_ROWS

    rng = np.random.default_rng(9)
    long_prompt = [int(t) for t in rng.integers(17, 40000, LOGIT_SLICE_ROWS + 45)]
    llm = LLM(ckpt_seed11, num_kv_blocks=128, max_num_batched_tokens=1024)
    # Sampled rows and two spans share the step's slices.
    outs = llm.generate(
        [prompts[0], long_prompt, prompts[1]], [greedy(), greedy(prompt_logprobs=1), greedy(prompt_logprobs=0)]
    )
    _check_prompt_logprobs(outs[1].prompt_logprobs, hf, long_prompt, 1)
    _check_prompt_logprobs(outs[2].prompt_logprobs, hf, prompts[1], 0)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, MAX_TOKENS) for p in (prompts[0], long_prompt, prompts[1])
    ]
