"""SamplingParams validation (hostile values refused with clear messages, greedy below
1e-5, seeds over the full torch range, bounded stop lists and logit_bias) and the
sampler's logit_bias and per-row fault isolation."""

from __future__ import annotations

import math

import pytest
import torch

from prefixserve.replica.sampling import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SampleSpec,
    SamplingParams,
    sample,
)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(n=True), "n must"),
    (dict(n=2.5), "n must"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop strings"),
    (dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), f"at most {MAX_STOP_STRING_CHARS} characters"),
    (dict(stop=[""]), "non-empty"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
    (dict(stop_token_ids=[-3]), "non-negative"),
    (dict(logit_bias={5: math.nan}), "logit_bias[5]"),
    (dict(logit_bias={5: 100.5}), "logit_bias[5]"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), f"at most {MAX_LOGIT_BIAS_ENTRIES}"),
])
def test_hostile_values_are_refused_with_a_clear_message(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)


def test_accepted_edges():
    # Below 1e-5 is greedy: a float32 division by 1e-45 (0 in float32) would give NaN logits.
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=1e-45).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy
    p = SamplingParams(seed=2**64 - 1, n=3)
    assert [p.child_seed(i) for i in range(3)] == [2**64 - 1, 0, 1]
    assert SamplingParams().child_seed(1) is None
    for seed in (p.child_seed(i) for i in range(3)):
        torch.Generator().manual_seed(seed)  # every child seed is one torch takes
    limits = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                            logit_bias={i: -100.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)})
    assert len(limits.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
    assert SamplingParams(logit_bias={}).logit_bias is None  # empty: no per-step work at all
    assert SamplingParams(logit_bias={3: 100}).logit_bias == {3: 100.0}


def test_logit_bias_on_greedy_and_random_rows_and_bans_win():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    top = int(logits.argmax())
    target = (top + 7) % 50
    shared = torch.Generator().manual_seed(1)
    boost = {target: 100.0}
    specs = [SampleSpec(SamplingParams(temperature=0.0), None),
             SampleSpec(SamplingParams(temperature=0.0, logit_bias=boost), None),
             SampleSpec(SamplingParams(temperature=1.0, logit_bias=boost), None),
             SampleSpec(SamplingParams(temperature=0.0, logit_bias={top: -100.0}), None),
             SampleSpec(SamplingParams(temperature=0.0, logit_bias=boost), None, banned_ids=(target,))]
    out = sample(logits.repeat(len(specs), 1), specs, shared)
    assert out[0].token_id == top
    assert out[1].token_id == target and out[2].token_id == target
    assert out[3].token_id != top
    assert out[4].token_id != target
    assert all(r.error is None for r in out)


def test_a_failing_row_fails_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    ok = [SampleSpec(SamplingParams(temperature=1.0, seed=5), torch.Generator().manual_seed(5)),
          SampleSpec(SamplingParams(temperature=0.0), None)]
    # An id past the vocabulary (what a validation gap lets through) raises in this row's mask.
    bad = SampleSpec(SamplingParams(temperature=1.0), None, banned_ids=(10**9,))
    out = sample(logits.clone(), [ok[0], bad, ok[1]], torch.Generator().manual_seed(3))
    assert isinstance(out[1].error, IndexError)
    alone = sample(logits[[0, 2]].clone(), [SampleSpec(ok[0].params, torch.Generator().manual_seed(5)), ok[1]],
                   torch.Generator().manual_seed(3))
    assert [out[0].token_id, out[2].token_id] == [r.token_id for r in alone]
    assert out[0].error is None and out[2].error is None
