"""Asynchronous scheduling (EngineConfig.async_scheduling, replica/engine/step_pipeline.py):
the same tokens as the synchronous engine under every stop condition, aborts, preemption,
prefix hits and the fallbacks, on a tiny random checkpoint; no KV block or thread left."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.params import StructuredOutputsParams

KNOBS = dict(block_size=4, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=64)


def prompts(count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Random prompts of 5-12 tokens after ``shared`` common leading tokens."""
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(100, 40000, shared)]
    return [prefix + [int(t) for t in rng.integers(100, 40000, rng.integers(5, 13))] for _ in range(count)]


def assert_clean(engine: LLMEngine) -> None:
    """Nothing in flight, every block free, the KV manager consistent."""
    assert not engine.pipeline.busy and not engine.requests
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def run(ckpt: str, batch: list[list[int]], params, *, on: bool, **knobs):
    """(each output's token ids, text, finish reason; cached tokens; steps the pipeline ran)."""
    with LLM(ckpt, async_scheduling=on, **{**KNOBS, **knobs}) as llm:
        outs = llm.generate(batch, params)
        assert_clean(llm.engine)
        submitted = llm.engine.pipeline.num_submitted
        stats = llm.engine.stats()
    got = [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]
    return got, [o.num_cached_tokens for o in outs], submitted, stats


def first_fresh(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_strings_max_tokens_min_tokens_greedy_and_seeded_give_the_synchronous_tokens(ckpt):
    batch = prompts(6, seed=1)
    free = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.9, seed=40 + i, max_tokens=16, ignore_eos=True) for i in range(3)
    ]
    reference, _, _, _ = run(ckpt, batch, free, on=False)
    params = []
    for i, (p, ref) in enumerate(zip(free, reference)):
        tokens, text = ref[0][0], ref[0][1]
        kind = i % 3
        if kind == 0:  # a stop string from the middle of the text
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            params.append(dataclasses.replace(p, stop=[stop], include_stop_str_in_output=i > 2))
        elif kind == 1:  # min_tokens holds back a stop token that would come at its bound
            k = first_fresh(tokens, 3)
            params.append(dataclasses.replace(p, stop_token_ids=[tokens[k]], min_tokens=k, logprobs=2))
        else:  # max_tokens
            params.append(dataclasses.replace(p, max_tokens=5 + i))
    sync, _, none, _ = run(ckpt, batch, params, on=False)
    overlapped, _, submitted, _ = run(ckpt, batch, params, on=True)
    assert overlapped == sync
    assert none == 0 and submitted > 10
    # The workload ends requests each way: stop strings and stop tokens mid-stream, lengths.
    reasons = [o[0][2] for o in sync]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 2
    assert all(len(o[0][0]) < 16 for o in sync)


def test_a_sequence_is_never_scheduled_past_its_max_tokens(ckpt):
    # The token that ends a request by length is never computed: its placeholder is not scheduled.
    engine = LLMEngine(EngineConfig(model=ckpt, async_scheduling=True, **KNOBS))
    try:
        real = engine.scheduler.schedule
        ends: list[tuple[int, int]] = []

        def schedule():
            plan = real()
            ends.extend((s.start + s.num_new_tokens, s.seq.num_prompt_tokens) for s in plan.scheduled)
            return plan

        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
        for i, p in enumerate(prompts(3, seed=2)):
            engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True))
        limit = {len(p): 4 + i for i, p in enumerate(prompts(3, seed=2))}
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.pipeline.num_submitted > 0
        assert all(end <= prompt + limit[prompt] - 1 for end, prompt in ends)
        assert_clean(engine)
    finally:
        engine.shutdown()


def test_preemption_falls_back_to_the_synchronous_step_and_keeps_the_tokens(ckpt):
    # 14 blocks of 4 tokens for 4 sequences of ~40 tokens: recompute preemption.
    batch = prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sync, _, _, sync_stats = run(ckpt, batch, params, on=False, num_kv_blocks=14)
    overlapped, _, submitted, stats = run(ckpt, batch, params, on=True, num_kv_blocks=14)
    assert overlapped == sync
    assert sync_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert submitted > 0  # the steps that cannot preempt still overlap


def test_prefix_hits_and_the_blocks_a_turn_ends_with_are_those_of_the_synchronous_engine(ckpt):
    # Prompts of 10 tokens (8 shared) and 7 output tokens: the last computed position closes
    # a block (10 + 7 - 1 = 16), which the next turn's prompt hits.
    first = [p[:10] for p in prompts(4, seed=4, shared=8)]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    results = {}
    for on in (False, True):
        with LLM(ckpt, async_scheduling=on, **KNOBS) as llm:
            turn1 = llm.generate(first, params)
            follow = [p + o.outputs[0].token_ids + [501, 502, 503] for p, o in zip(first, turn1)]
            turn2 = llm.generate(follow, params)
            assert_clean(llm.engine)
            assert on is (llm.engine.pipeline.num_submitted > 0)
        results[on] = [(o.outputs[0].token_ids, o.num_cached_tokens) for o in turn1 + turn2]
    assert results[True] == results[False]
    cached = [c for _, c in results[False]]
    assert sum(cached[:4]) > 0 and all(c == 16 for c in cached[4:])


@pytest.mark.parametrize(
    "extra",
    [
        dict(n=2, temperature=0.8, seed=3),
        dict(repetition_penalty=1.5, frequency_penalty=0.5),
        dict(bad_words=["the", "ing"]),
        dict(prompt_logprobs=2),
        dict(structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"])),
    ],
    ids=["n2", "penalties", "bad-words", "prompt-logprobs", "grammar"],
)
def test_what_needs_the_last_tokens_on_the_host_runs_synchronously(ckpt, extra):
    batch = prompts(3, seed=5)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    special = SamplingParams(**{"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, **extra})
    params = [plain, special, plain]
    sync, _, _, _ = run(ckpt, batch, params, on=False)
    with LLM(ckpt, async_scheduling=True, **KNOBS) as llm:
        engine = llm.engine
        real_step = engine.step
        overlapped_with_it = []

        def step():
            present, before = "special" in engine.requests, engine.pipeline.num_submitted
            updates = real_step()
            overlapped_with_it.append(present and engine.pipeline.num_submitted > before)
            return updates

        engine.step = step  # type: ignore[method-assign]
        for i, (prompt, sp) in enumerate(zip(batch, params)):
            engine.add_request("special" if i == 1 else f"r{i}", prompt, sp)
        outs = {}
        while engine.has_unfinished_requests():
            for u in engine.step():
                assert u.error is None
                if u.output is not None:
                    outs[u.request_id] = u.output
        assert not any(overlapped_with_it)
        after = llm.generate(batch[::2], plain)  # gone: the pipeline serves the rest
        assert engine.pipeline.num_submitted > 0
        assert_clean(engine)
    ordered = [outs["r0"], outs["special"], outs["r2"]]
    got = [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in ordered]
    assert got == sync
    assert [o.outputs[0].token_ids for o in after] == [sync[0][0][0], sync[2][0][0]]
    if "prompt_logprobs" in extra:
        assert ordered[1].prompt_logprobs is not None and len(ordered[1].prompt_logprobs) == len(batch[1])


def test_an_abort_while_its_step_is_in_flight_frees_its_blocks_after_that_step(ckpt):
    engine = LLMEngine(EngineConfig(model=ckpt, async_scheduling=True, **KNOBS))
    try:
        batch = prompts(3, seed=6)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", p, params)
        emitted: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}

        def step() -> None:
            for u in engine.step():
                for d in u.deltas:
                    emitted[u.request_id] += d.token_ids

        for _ in range(5):
            step()
        seq = engine.requests["r1"].seqs[0]
        free = engine.kv_manager.num_free_blocks
        assert engine.pipeline.holds(seq)
        assert engine.abort_request("r1")
        # Its row is still in flight: the blocks stay until that step is done.
        assert engine.kv_manager.has_request("r1") and engine.kv_manager.num_free_blocks == free
        cut = len(emitted["r1"])
        step()
        assert not engine.kv_manager.has_request("r1")
        while engine.has_unfinished_requests():
            step()
        assert len(emitted["r1"]) == cut  # nothing of it after the abort
        assert_clean(engine)
    finally:
        engine.shutdown()
    with LLM(ckpt, **KNOBS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert emitted["r0"] == reference[0] and emitted["r2"] == reference[2]
    assert emitted["r1"] == reference[1][:cut] and 0 < cut < 20


def test_the_knob_flipping_between_steps_keeps_the_tokens(ckpt):
    batch = prompts(4, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=1.0, seed=9 + i, max_tokens=14, ignore_eos=True) for i in range(2)
    ]
    sync, _, _, _ = run(ckpt, batch, params, on=False)
    engine = LLMEngine(EngineConfig(model=ckpt, async_scheduling=True, **KNOBS))
    try:
        for i, (p, sp) in enumerate(zip(batch, params)):
            engine.add_request(f"r{i}", p, sp)
        done = {}
        k = 0
        while engine.has_unfinished_requests():
            engine.config.async_scheduling = (k // 3) % 2 == 0  # three steps each way
            for u in engine.step():
                if u.output is not None:
                    done[u.request_id] = u.output.outputs[0].token_ids
            k += 1
        assert engine.pipeline.num_submitted > 0
        assert_clean(engine)
    finally:
        engine.shutdown()
    assert [done[f"r{i}"] for i in range(4)] == [o[0][0] for o in sync]


def test_off_the_pipeline_never_runs_and_on_its_thread_ends_with_the_engine(ckpt):
    def device_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("prefixserve-device")]

    before = len(device_threads())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(ckpt, **KNOBS) as llm:
        llm.generate(prompts(2, seed=8), params)
        assert llm.engine.pipeline.num_submitted == 0 and llm.engine.pipeline._executor is None
    with LLM(ckpt, async_scheduling=True, **KNOBS) as llm:
        llm.generate(prompts(2, seed=8), params)
        assert len(device_threads()) == before + 1
    assert len(device_threads()) == before


async def test_async_engine_streams_the_synchronous_tokens_and_an_abort_mid_stream_frees_its_blocks(ckpt):
    batch = prompts(4, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    with LLM(ckpt, **KNOBS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    engine = AsyncEngine(EngineConfig(model=ckpt, async_scheduling=True, **KNOBS))
    try:

        async def collect(prompt: list[int], stop_after: int | None = None) -> list[int]:
            tokens: list[int] = []
            async for delta in engine.generate(prompt, params):
                tokens += delta.token_ids
                if stop_after is not None and len(tokens) >= stop_after:
                    break  # leaving the stream aborts the request
            return tokens

        got = await asyncio.gather(*(collect(p, 4 if i == 1 else None) for i, p in enumerate(batch)))
        assert [got[i] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
        assert 4 <= len(got[1]) < 18 and got[1] == reference[1][: len(got[1])]
        inner = engine.engine
        for _ in range(500):
            if not inner.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert inner.pipeline.num_submitted > 0
        assert_clean(inner)
    finally:
        await engine.shutdown()


@pytest.mark.slow
def test_tensor_parallel_2_overlapped_gives_one_synchronous_process_tokens(gqa_ckpt):
    gqa = gqa_ckpt
    batch = prompts(4, seed=10, shared=8)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=5 + i, max_tokens=12, stop=["e"]) for i in range(2)
    ]
    sync, cached, _, _ = run(gqa, batch, params, on=False)
    overlapped, tp_cached, submitted, _ = run(gqa, batch, params, on=True, tensor_parallel_size=2)
    assert overlapped == sync and tp_cached == cached
    assert submitted > 0
