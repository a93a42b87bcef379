"""SamplingParams validation (hostile values refused with clear messages, greedy below
1e-5, seeds over the full torch range, bounded stop lists and logit_bias) and the
sampler's logit_bias and per-row fault isolation."""

from __future__ import annotations

import math

import pytest
import torch

from prefixserve.replica.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from prefixserve.replica.worker.sampler import SampleSpec, process_logits, sample


@pytest.mark.parametrize(
    "kwargs, words",
    [
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
    ],
)
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
    limits = SamplingParams(
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        logit_bias={i: -100.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
    )
    assert len(limits.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
    assert SamplingParams(logit_bias={}).logit_bias is None  # empty: no per-step work at all
    assert SamplingParams(logit_bias={3: 100}).logit_bias == {3: 100.0}


def test_logit_bias_on_greedy_and_random_rows_and_bans_win():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    top = int(logits.argmax())
    target = (top + 7) % 50
    shared = torch.Generator().manual_seed(1)
    boost = {target: 100.0}
    specs = [
        SampleSpec(SamplingParams(temperature=0.0), None),
        SampleSpec(SamplingParams(temperature=0.0, logit_bias=boost), None),
        SampleSpec(SamplingParams(temperature=1.0, logit_bias=boost), None),
        SampleSpec(SamplingParams(temperature=0.0, logit_bias={top: -100.0}), None),
        SampleSpec(SamplingParams(temperature=0.0, logit_bias=boost), None, banned_ids=(target,)),
    ]
    out = sample(logits.repeat(len(specs), 1), specs, shared)
    assert out[0].token_id == top
    assert out[1].token_id == target and out[2].token_id == target
    assert out[3].token_id != top
    assert out[4].token_id != target
    assert all(r.error is None for r in out)


def test_a_failing_row_fails_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    ok = [
        SampleSpec(SamplingParams(temperature=1.0, seed=5), torch.Generator().manual_seed(5)),
        SampleSpec(SamplingParams(temperature=0.0), None),
    ]
    # An id past the vocabulary (what a validation gap lets through) raises in this row's mask.
    bad = SampleSpec(SamplingParams(temperature=1.0), None, banned_ids=(10**9,))
    out = sample(logits.clone(), [ok[0], bad, ok[1]], torch.Generator().manual_seed(3))
    assert isinstance(out[1].error, IndexError)
    alone = sample(
        logits[[0, 2]].clone(),
        [SampleSpec(ok[0].params, torch.Generator().manual_seed(5)), ok[1]],
        torch.Generator().manual_seed(3),
    )
    assert [out[0].token_id, out[2].token_id] == [r.token_id for r in alone]
    assert out[0].error is None and out[2].error is None


# -- the logits pipeline: each parameter against a direct torch statement of its rule ----------

V = 64


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    out = logits.clone()
    assert process_logits(out, [spec]) == {}
    return out[0]


def test_allowed_token_ids_keep_only_those():
    logits = _logits()
    allowed = [3, 17, 40]
    want = torch.full((V,), float("-inf"))
    want[allowed] = logits[0, allowed]
    assert torch.equal(_processed(logits, SampleSpec(SamplingParams(allowed_token_ids=allowed), None)), want)


def test_bad_words_ban_the_last_token_after_the_rest():
    logits = _logits()
    words = ((5,), (7, 8), (9, 10, 11))
    spec = SampleSpec(
        SamplingParams(bad_words=["x"]),
        None,
        token_ids=[1, 2, 7, 9, 10],
        num_prompt_tokens=2,
        bad_words_token_ids=words,
    )
    want = logits[0].clone()
    want[[5, 11]] = float("-inf")  # (7, 8): the output ends in 10, not 7
    assert torch.equal(_processed(logits, spec), want)
    # The prompt is not the output: a word split across it is not matched.
    spec = SampleSpec(
        SamplingParams(bad_words=["x"]), None, token_ids=[7], num_prompt_tokens=1, bad_words_token_ids=((7, 8),)
    )
    assert torch.equal(_processed(logits, spec), logits[0])


def _penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    """vLLM's apply_penalties, written directly."""
    row = logits[0].clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    seen = counts > 0
    seen[prompt] = True
    factor = torch.where(seen, torch.tensor(rep), torch.tensor(1.0))
    row = torch.where(row > 0, row / factor, row * factor)
    return row - freq * counts - pres * (counts > 0).float()


@pytest.mark.parametrize(
    "rep, freq, pres",
    [(1.0, 0.5, 0.0), (1.0, 0.0, 1.5), (1.3, 0.0, 0.0), (0.7, -2.0, 2.0), (1.0, 2.0, -2.0), (2.0, -0.3, 0.4)],
)
def test_penalties_are_vllms(rep, freq, pres):
    logits = _logits(seed=4)
    prompt, output = [1, 2, 3, 9], [3, 3, 4, 9, 9, 9, 20]
    spec = SampleSpec(
        SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
        None,
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
    )
    torch.testing.assert_close(_processed(logits, spec), _penalized(logits, prompt, output, rep, freq, pres))


def test_penalty_extremes_stay_finite_and_keep_masks():
    logits = _logits(seed=5)
    for rep in (1e-300, 1e-30, 1e30, 1e300):
        spec = SampleSpec(
            SamplingParams(
                repetition_penalty=rep,
                frequency_penalty=2.0,
                presence_penalty=-2.0,
                temperature=1e-5,
                logit_bias={0: -100.0},
            ),
            None,
            banned_ids=(1,),
            token_ids=list(range(V)),
            num_prompt_tokens=V // 2,
        )
        row = _processed(logits, spec)
        assert row[1] == float("-inf") and torch.isfinite(row[2:]).all()
        # Sampling at the smallest temperature gives a token, never the banned one (the logits the
        # penalties squash or inflate may tie: which of them is the generator's).
        out = sample(logits.clone(), [spec], torch.Generator().manual_seed(0))[0]
        assert out.error is None and out.token_id != 1 and torch.isfinite(row[out.token_id])


def test_min_p_keeps_tokens_above_its_share_of_the_top():
    from prefixserve.replica.worker.sampler import _min_p

    logits = _logits(2, seed=6)
    params = [SamplingParams(min_p=0.1), SamplingParams(min_p=1.0)]
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= probs.max(dim=-1, keepdim=True).values * torch.tensor([[0.1], [1.0]])
    assert torch.equal(_min_p(logits, params), logits.masked_fill(~keep, float("-inf")))
    assert int(keep[1].sum()) == 1
    # min_p = 1.0 samples the top token whatever the seed.
    spec = SampleSpec(SamplingParams(min_p=1.0, temperature=2.0), None)
    shared = torch.Generator().manual_seed(7)
    assert {sample(logits[1:].clone(), [spec], shared)[0].token_id for _ in range(20)} == {int(logits[1].argmax())}


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-8])
def test_a_top_p_below_float32_keeps_the_top_token(top_p):
    logits = _logits(seed=8)
    spec = SampleSpec(SamplingParams(top_p=top_p), None)
    shared = torch.Generator().manual_seed(9)
    assert {sample(logits.clone(), [spec], shared)[0].token_id for _ in range(20)} == {int(logits.argmax())}


def test_top_k_edges():
    from prefixserve.replica.worker.sampler import _top_k_top_p

    logits = _logits(seed=10)
    one = _top_k_top_p(logits, [SamplingParams(top_k=1)])[0]
    assert torch.isfinite(one).sum() == 1 and one.argmax() == logits.argmax()
    assert torch.equal(_top_k_top_p(logits, [SamplingParams(top_k=10**9)]), logits)
    # top_p: keep the smallest set of top tokens whose probability reaches top_p.
    probs = torch.softmax(logits[0], dim=-1)
    order = probs.argsort(descending=True)
    need = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    kept = torch.isfinite(_top_k_top_p(logits, [SamplingParams(top_p=0.5)])[0])
    assert set(kept.nonzero().flatten().tolist()) == set(order[:need].tolist())


def test_temperature_edges_sample_valid_tokens():
    logits = _logits(seed=11)
    logits[0, 5] = 200.0  # far above the rest plus the largest bias
    for t in (1e-5, 2.0):
        spec = SampleSpec(SamplingParams(temperature=t, logit_bias={6: 100.0}), None)
        out = sample(logits.clone(), [spec], torch.Generator().manual_seed(0))[0]
        assert out.error is None and 0 <= out.token_id < V
    spec = SampleSpec(SamplingParams(temperature=1e-5), None)
    assert sample(logits.clone(), [spec], torch.Generator().manual_seed(0))[0].token_id == 5


def test_a_row_with_no_token_left_fails_alone():
    from prefixserve.replica.errors import RequestRejected

    logits = _logits(2, seed=12)
    specs = [
        SampleSpec(SamplingParams(allowed_token_ids=[2]), None, banned_ids=(2,)),
        SampleSpec(SamplingParams(temperature=0.0), None),
    ]
    out = sample(logits.clone(), specs, torch.Generator().manual_seed(0))
    assert isinstance(out[0].error, RequestRejected) and "no token" in str(out[0].error)
    assert out[1].error is None and out[1].token_id == int(logits[1].argmax())


def test_defaults_cost_no_tensor_work():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    logits = _logits(4, seed=13)
    specs = [
        SampleSpec(SamplingParams(temperature=t), None, token_ids=[1, 2, 3], num_prompt_tokens=2)
        for t in (0.0, 1.0, 0.5, 0.0)
    ]
    with Count():
        errors = process_logits(logits, specs)
    assert errors == {} and Count.ops == 0
    with Count():
        process_logits(
            logits, [SampleSpec(SamplingParams(presence_penalty=0.5), None, token_ids=[1, 2], num_prompt_tokens=1)]
        )
    assert Count.ops > 0  # the counter sees the work a parameter does


def test_prompt_logprobs_are_the_raw_log_softmax():
    from prefixserve.replica.worker.sampler import prompt_logprobs

    logits = _logits(3, seed=14)
    nxt = [4, 9, 1]
    out, ranks = prompt_logprobs(logits, nxt, 2)
    ref = torch.log_softmax(logits, dim=-1)
    for row, token, entry, rank in zip(ref, nxt, out, ranks):
        top = row.topk(2)
        want = {**dict(zip(top.indices.tolist(), top.values.tolist())), token: float(row[token])}
        assert entry.keys() == want.keys()
        assert all(math.isclose(entry[t], want[t], rel_tol=1e-6) for t in want)
        assert rank == row.argsort(descending=True).tolist().index(token) + 1
    assert [list(e) for e in prompt_logprobs(logits, nxt, 0)[0]] == [[4], [9], [1]]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(frequency_penalty=math.inf), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(min_p=1.0001), "min_p"),
        (dict(min_p=-1e-300), "min_p"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(bad_words=["x"] * 129), "bad_words"),
        (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(temperature=10**400), "temperature"),
    ],
)
def test_new_parameters_refuse_out_of_range_values(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)


def test_new_parameters_accept_their_edges():
    p = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-300,
        min_p=1.0,
        prompt_logprobs=20,
        allowed_token_ids=[0],
        bad_words="word",
    )
    assert p.has_penalties and p.bad_words == ["word"] and p.min_p == 1.0
    assert not SamplingParams(repetition_penalty=1.0).has_penalties


def test_greedy_tokens_equal_torchs_first_maximum():
    from prefixserve.replica.worker.sampler import greedy_tokens

    logits = _logits(8, seed=14)
    logits[1] = 0.0  # all tied: the first index
    logits[2, [3, 9, 40]] = 1e30  # tied maxima: the first of them
    logits[3] = float("-inf")  # a dead row
    logits[4, 7] = float("nan")  # NaN wins, as in torch
    wide = torch.cat([logits, logits], dim=1)[:, ::2]  # a strided view
    for rows in (logits, wide, logits[:0]):
        indices, values = greedy_tokens(rows)
        expected = rows.max(dim=-1)
        assert indices.dtype == torch.int64 and indices.tolist() == expected.indices.tolist()
        assert torch.equal(values.isnan(), expected.values.isnan())
        assert values.nan_to_num().tolist() == expected.values.nan_to_num().tolist()
    half = logits.to(torch.bfloat16)  # other dtypes take torch's reduction
    assert greedy_tokens(half)[0].tolist() == half.max(dim=-1).indices.tolist()


def _lp_specs() -> list[SampleSpec]:
    """A greedy row with a penalty and a bias, and a seeded random row with temperature and top-k."""
    return [
        SampleSpec(
            SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.7, logit_bias={3: 4.0}),
            None,
            token_ids=[2, 3, 4, 5],
            num_prompt_tokens=2,
        ),
        SampleSpec(
            SamplingParams(temperature=0.4, top_k=6, frequency_penalty=1.5, logprobs=5),
            torch.Generator().manual_seed(3),
            token_ids=[1, 6, 6, 7],
            num_prompt_tokens=1,
        ),
    ]


def _entries_close(got: dict[int, float], want_row: torch.Tensor, k: int, token: int) -> None:
    top = want_row.topk(k)
    want = {t: v for t, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")}
    want[token] = float(want_row[token])
    assert got.keys() == want.keys()
    assert all(math.isclose(got[t], want[t], rel_tol=1e-5, abs_tol=1e-6) for t in want)


def test_logprobs_are_the_raw_log_softmax_by_default_and_processed_on_request():
    raw = _logits(2, seed=15)
    results = {
        mode: sample(raw.clone(), _lp_specs(), torch.Generator().manual_seed(0), mode)
        for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
    }
    default = sample(raw.clone(), _lp_specs(), torch.Generator().manual_seed(0))
    # The mode changes what is reported, never the tokens.
    tokens = [r.token_id for r in default]
    assert all([r.token_id for r in rs] == tokens for rs in results.values())
    for i in range(2):
        assert default[i].logprobs == results["raw_logprobs"][i].logprobs
        _entries_close(results["raw_logprobs"][i].logprobs, torch.log_softmax(raw[i], dim=-1), 5, tokens[i])
        _entries_close(results["raw_logits"][i].logprobs, raw[i], 5, tokens[i])
    # Processed: the greedy row after its penalty and bias; the random row also after temperature and top-k.
    processed = raw.clone()
    process_logits(processed, _lp_specs())
    greedy_row = processed[0]
    random_row = processed[1] / 0.4
    random_row = random_row.masked_fill(random_row < random_row.topk(6).values[-1], float("-inf"))
    for row, i in ((greedy_row, 0), (random_row, 1)):
        _entries_close(results["processed_logits"][i].logprobs, row, 5, tokens[i])
        _entries_close(results["processed_logprobs"][i].logprobs, torch.log_softmax(row, dim=-1), 5, tokens[i])
        raw_lp, proc_lp = results["raw_logprobs"][i].logprobs, results["processed_logprobs"][i].logprobs
        assert not math.isclose(raw_lp[tokens[i]], proc_lp[tokens[i]], rel_tol=1e-3)
    with pytest.raises(ValueError, match="logprobs_mode"):
        sample(raw.clone(), _lp_specs(), torch.Generator(), "final_logprobs")


def test_engine_config_takes_vllms_logprobs_modes():
    from prefixserve.replica.config import EngineConfig

    assert EngineConfig(model="smollm2").logprobs_mode == "raw_logprobs"
    assert EngineConfig(model="smollm2", logprobs_mode="processed_logits").logprobs_mode == "processed_logits"
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(model="smollm2", logprobs_mode="processed")
