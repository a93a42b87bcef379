"""The numpy step-input builders against the torch reference (step_inputs.build_step_inputs):
the same tensors, values and dtypes, on decode steps, chunked prefills mixed with decodes,
sliding-window tables with freed blocks, forked rows, prompt-logprob spans and COW copies;
and the persistent-table builder (input_builder.StepInputBuilder) step after step of the
real scheduler and KV manager: admissions, prefix hits, forks (copy-on-write), preemption by
recompute and by swap, aborts and finishes."""

from __future__ import annotations

import random

import pytest
import torch

from prefixserve.replica.core.request import PreparedRequest, Request, SeqStatus, Sequence
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager
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
        seq = Sequence(f"r{i}-0", req, 0, prompt + outputs, len(prompt), status=SeqStatus.RUNNING)
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


def _assert_same(ref: step_inputs.StepInputs, got: step_inputs.StepInputs, where: str = "") -> None:
    for name in ref.__dataclass_fields__:
        a, b = getattr(ref, name), getattr(got, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (where, name)
        assert torch.equal(a, b), (where, name)
    assert torch.equal(ref.pack(), got.pack())


@pytest.mark.parametrize("persistent", [False, True], ids=["rebuilt", "persistent"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_numpy_builder_equals_the_reference(decode, sliding, persistent):
    rng = random.Random(7)
    # Every trial's sequences are new to the persistent builder (3 rows: it grows).
    build = input_builder.StepInputBuilder(3, 2) if persistent else input_builder.build_step_inputs
    for trial in range(40):
        scheduled, sample_rows, spans = _plan(rng, rng.randrange(1, 20), decode, sliding)
        copies = [(rng.randrange(1, 99), rng.randrange(100, 199)) for _ in range(trial % 3)]
        args = (scheduled, copies, sample_rows, BLOCK)
        ref = step_inputs.build_step_inputs(*args, sliding=sliding, logit_spans=spans)
        _assert_same(ref, build(*args, sliding=sliding, logit_spans=spans))
        for s in scheduled:
            s.seq.status = SeqStatus.FINISHED  # their rows may be released


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A prompt that often starts with one of a few shared prefixes (prefix hits)."""
    head = rng.choice(prefixes)[: rng.randrange(0, 14)] if rng.random() < 0.7 else []
    return head + [rng.randrange(17, 1000) for _ in range(rng.randrange(1, 12))]


def _drive(mode: str, sliding: bool, seed: int, steps: int = 300) -> dict[str, int]:
    """Random traffic through the real scheduler and KV manager; every step's inputs from the
    persistent builder must equal the reference's. Returns what the run went through."""
    rng = random.Random(seed)
    window = 9 if sliding else None
    host = 48 if mode == "swap" else 0
    kv = KVCacheManager(20 if sliding else 40, block_size=BLOCK, num_host_blocks=host, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, preemption_mode=mode), kv)
    build = input_builder.StepInputBuilder(6, 4)  # narrower than the tables get: it grows
    prefixes = [[rng.randrange(17, 1000) for _ in range(14)] for _ in range(3)]
    live: list[Sequence] = []
    counts = dict(steps=0, aborts=0, finishes=0, forks=0)
    for step in range(steps):
        while len(live) < 9 and rng.random() < 0.5:
            n = 2 if rng.random() < 0.2 else 1
            params = SamplingParams(n=n, temperature=0.0, max_tokens=rng.randrange(1, 30))
            prompt = _prompt(rng, prefixes)
            req = Request(PreparedRequest(f"q{step}-{len(live)}", tuple(prompt), params, None, 0.0))
            seq = Sequence(f"{req.request_id}-0", req, 0, list(prompt), len(prompt))
            req.seqs.append(seq)
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:  # an abort, running or waiting
            seq = rng.choice(live)
            sched.finish(seq)
            live.remove(seq)
            counts["aborts"] += 1
        out = sched.schedule()
        if not out.scheduled:
            continue
        rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        args = (out.scheduled, out.copy_ops, rows, BLOCK)
        ref = step_inputs.build_step_inputs(*args, sliding=sliding)
        _assert_same(ref, build(*args, sliding=sliding), f"step {step}")
        counts["steps"] += 1
        for s in out.scheduled:  # what the engine does after the model
            seq = s.seq
            if not s.samples or seq.status is not SeqStatus.RUNNING:
                continue
            seq.token_ids.append(rng.randrange(17, 1000))
            if seq.awaits_fork:  # the children of an n > 1 request share the parent's blocks
                child = Sequence(
                    f"{seq.request.request_id}-1", seq.request, 1, list(seq.token_ids), seq.num_prompt_tokens
                )
                kv.fork(seq.seq_id, child.seq_id)
                child.num_computed_tokens = seq.num_computed_tokens
                sched.add_forked(seq, [child])
                seq.request.seqs.append(child)
                seq.request.forked = True
                live.append(child)
                counts["forks"] += 1
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
                live.remove(seq)
                counts["finishes"] += 1
        kv.check_invariants()
    stats = kv.stats
    counts.update(
        recompute=sched.num_recompute_preemptions,
        swap=sched.num_swap_preemptions,
        hits=stats.prefix_hit_tokens,
        cow=stats.num_cow_copies,
        window_freed=stats.num_window_freed_blocks,
    )
    return counts


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_persistent_tables_follow_the_scheduler(mode, sliding):
    totals: dict[str, int] = {}
    for seed in range(2):
        for k, v in _drive(mode, sliding, seed).items():
            totals[k] = totals.get(k, 0) + v
    # The run went through every way a table changes.
    for k in ("aborts", "finishes", "forks", "hits", "cow", mode):
        assert totals[k] > 0, (k, totals)
    assert totals["window_freed"] > 0 if sliding else True, totals
