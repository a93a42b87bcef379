"""The numpy step-input builder against the torch reference (step_inputs.build_step_inputs):
the same tensors, values and dtypes, on decode steps, chunked prefills mixed with decodes,
sliding-window tables with freed blocks, forked rows, prompt-logprob spans and COW copies."""

from __future__ import annotations

import random

import pytest
import torch

from prefixserve.replica.core.request import PreparedRequest, Request, Sequence
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.worker import input_builder, step_inputs

BLOCK = 4


def _plan(rng: random.Random, n: int, decode: bool, sliding: bool) -> tuple[list[ScheduledSeq], list[int], list]:
    scheduled, sample_rows, spans = [], [], []
    for i in range(n):
        prompt = [rng.randrange(17, 1000) for _ in range(rng.randrange(1, 30))]
        req = Request(
            PreparedRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=8), cache_salt=None, arrival_time=0.0)
        )
        outputs = [rng.randrange(17, 1000) for _ in range(rng.randrange(0, 6))]
        seq = Sequence(f"r{i}-0", req, 0, prompt + outputs, len(prompt))
        total = len(seq.token_ids)
        if decode:
            start, count = total - 1, 1
        else:
            start = rng.randrange(0, total)
            count = rng.randrange(1, total - start + 1)
        blocks = -(-(start + count) // BLOCK)
        table = rng.sample(range(1, 500), blocks)
        if sliding and blocks > 2:
            for j in range(rng.randrange(1, blocks - 1)):  # blocks freed outside the window
                table[j] = -1
        scheduled.append(ScheduledSeq(seq, start, count, table))
        if start + count == total:
            sample_rows += [i] * rng.randrange(1, 3)  # forked children sample the same row
        elif count > 1 and rng.random() < 0.5:
            first = rng.randrange(0, count - 1)
            spans.append((i, first, rng.randrange(1, count - first)))
    return scheduled, sample_rows, spans


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_numpy_builder_equals_the_reference(decode, sliding):
    rng = random.Random(7)
    for trial in range(40):
        scheduled, sample_rows, spans = _plan(rng, rng.randrange(1, 20), decode, sliding)
        copies = [(rng.randrange(1, 99), rng.randrange(100, 199)) for _ in range(trial % 3)]
        args = (scheduled, copies, sample_rows, BLOCK)
        ref = step_inputs.build_step_inputs(*args, sliding=sliding, logit_spans=spans)
        got = input_builder.build_step_inputs(*args, sliding=sliding, logit_spans=spans)
        for name in ref.__dataclass_fields__:
            a, b = getattr(ref, name), getattr(got, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name
        assert torch.equal(ref.pack(), got.pack())
