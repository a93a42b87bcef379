"""The engine end to end on a tiny random checkpoint: greedy equality with transformers
under prefix caching on/off, chunked prefill, forced preemption and mixed batches;
seeded n > 1; stop conditions; aborts; the async streaming engine; metrics."""

from __future__ import annotations

import asyncio
import threading

import pytest
from model_helpers import hf_greedy, hf_model, two_tenant_prompts

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.errors import EngineOverloadedError, PromptTooLongError
from prefixserve.replica.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def workload(ckpt):
    """Prompts sharing prefixes (two tenants) and transformers' greedy continuations."""
    prompts = two_tenant_prompts(seed=5, n=6, hi=20)
    hf = hf_model(ckpt)
    return prompts, [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=8),  # chunked prefill at a tiny budget
        dict(num_kv_blocks=9, max_num_batched_tokens=64),  # preemption: the pool holds ~2 requests
    ],
    ids=["caching-on", "caching-off", "chunked-8", "preempt"],
)
def test_greedy_matches_transformers(ckpt, workload, knobs):
    prompts, expected = workload
    knobs = {"num_kv_blocks": 64, "max_num_batched_tokens": 128, **knobs}
    llm = LLM(ckpt, **knobs)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = llm.engine
    assert engine.kv_manager.usage == 0.0
    engine.kv_manager.check_invariants()
    if knobs.get("enable_prefix_caching", True):
        assert sum(o.num_cached_tokens for o in outs) > 0
    else:
        assert all(o.num_cached_tokens == 0 for o in outs)
    if knobs["num_kv_blocks"] == 9:
        assert engine.scheduler.num_preemptions > 0
    assert all(o.ttft_s is not None and o.ttft_s <= o.e2e_s for o in outs)


def test_mixed_batches_requests_join_while_others_decode(ckpt, workload):
    prompts, expected = workload
    engine = LLMEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_batched_tokens=32))
    results = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step: prefills mix with decodes
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for u in engine.step():
            if u.output is not None:
                results[u.request_id] = u.output.outputs[0].token_ids
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected


def test_seeded_n_equals_separate_requests(ckpt, workload):
    prompts, _ = workload
    llm = LLM(ckpt, num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=42, max_tokens=12)
    forked = llm.generate(prompts[:2], params)
    singles = llm.generate(
        [p for p in prompts[:2] for _ in range(3)],
        [SamplingParams(temperature=1.0, top_p=0.9, seed=42 + k, max_tokens=12) for _ in range(2) for k in range(3)],
    )
    got = [[c.token_ids for c in o.outputs] for o in forked]
    want = [[singles[3 * i + k].outputs[0].token_ids for k in range(3)] for i in range(2)]
    assert got == want
    assert len({tuple(t) for t in got[0]}) > 1, "children should differ"
    assert llm.engine.kv_manager.usage == 0.0
    assert llm.engine.kv_manager.stats.num_cow_copies > 0


def test_stop_strings_stop_ids_and_lengths(ckpt, workload):
    prompts, expected = workload
    llm = LLM(ckpt, num_kv_blocks=64)
    full = llm.generate(prompts[0], GREEDY)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    # Stop at a token id in the middle.
    stop_id = full.token_ids[5]
    out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    cut = full.token_ids.index(stop_id)
    assert out.outputs[0].token_ids == full.token_ids[: cut + 1] and out.outputs[0].finish_reason == "stop"
    # Stop at a string: the text is truncated right before it.
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == text[: text.index(stop)]
    with pytest.raises(PromptTooLongError):
        llm.generate([[20] * 1020], GREEDY)


def test_abort_frees_all_blocks(ckpt, workload):
    prompts, _ = workload
    engine = LLMEngine(EngineConfig(model=ckpt, num_kv_blocks=64))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(n=2, temperature=1.0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.usage > 0
    for i in range(len(prompts)):
        assert engine.abort_request(f"r{i}")
    assert engine.kv_manager.usage == 0.0 and not engine.has_unfinished_requests()
    engine.kv_manager.check_invariants()


async def test_async_engine_streams_aborts_and_refuses(ckpt, workload):
    prompts, expected = workload
    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_waiting_requests=100))
    try:

        async def collect(i):
            deltas = [d async for d in engine.generate(prompts[i], GREEDY, request_id=f"s{i}")]
            return deltas

        streams = await asyncio.gather(*(collect(i) for i in range(4)))
        for i, deltas in enumerate(streams):
            assert [t for d in deltas for t in d.token_ids] == expected[i]
            assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 16
        # A consumer that leaves early aborts its request.
        agen = engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=200))
        await agen.__anext__()
        await agen.aclose()
        assert await engine.abort("no-such-request") is False  # runs after the pending abort
        assert engine.stats().kv_usage == 0.0 and engine.stats().num_running == 0
        with pytest.raises(PromptTooLongError):
            await engine.generate([5] * 2000, GREEDY).__anext__()
        text = (await engine.generate(prompts[1], GREEDY).__anext__()).text
        assert isinstance(text, str)
        body = _exposition(engine)
        for name in (
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:num_preemptions_total",
            "vllm:e2e_request_latency_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:gpu_prefix_cache_hit_rate",
        ):
            assert name in body
        assert 'model_name="tiny"' in body
    finally:
        await engine.shutdown()


async def test_async_engine_hands_a_step_to_the_loop_at_once(ckpt, workload):
    """One step's deltas for every stream reach the event loop in one callback, not one per stream."""
    prompts, expected = workload
    loop = asyncio.get_running_loop()
    handoffs = 0
    threadsafe = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        nonlocal handoffs
        target = getattr(callback, "__self__", None)
        if isinstance(target, asyncio.Queue) or getattr(callback, "__name__", "") == "_deliver":
            handoffs += 1  # a delivery of stream items (any other callback is not counted)
        return threadsafe(callback, *args, **kwargs)

    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4))
    steps = 0
    step = engine.engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.engine.step = counted_step  # type: ignore[method-assign]
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:

        async def collect(i):
            return [t async for d in engine.generate(prompts[i], GREEDY, request_id=f"h{i}") for t in d.token_ids]

        tokens = await asyncio.gather(*(collect(i) for i in range(4)))
        assert tokens == [expected[i] for i in range(4)]
        # 4 streams x 16 tokens: one hand-off per stream per step would be about 4x the steps.
        assert 0 < handoffs <= steps, (handoffs, steps)
    finally:
        del loop.call_soon_threadsafe
        await engine.shutdown()


async def test_async_engine_queue_bound(ckpt):
    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_waiting_requests=1, max_num_seqs=1))
    try:
        # ignore_eos and a long budget: the first request holds the only seat until it is closed
        first = engine.generate([30, 31, 32], SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
        await first.__anext__()  # running: the seat is taken
        second = engine.generate([40, 41], GREEDY)
        task = asyncio.ensure_future(second.__anext__())
        for _ in range(3000):  # second reaches the engine's waiting queue
            if engine.stats().num_waiting >= 1:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the second request never reached the waiting queue")
        # The engine thread held between two steps: the first request keeps its seat, however fast
        # it would otherwise finish.
        held, release = threading.Event(), threading.Event()
        hold = asyncio.ensure_future(engine.call(lambda: (held.set(), release.wait(600))))
        assert await asyncio.to_thread(held.wait, 600)
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting) == (1, 1), stats
        with pytest.raises(EngineOverloadedError):
            await engine.generate([50, 51], GREEDY).__anext__()
        release.set()
        await hold
        await first.aclose()
        assert (await task).token_ids
        await second.aclose()
    finally:
        await engine.shutdown()


def _exposition(engine) -> str:
    from prometheus_client import generate_latest

    return generate_latest(engine.metrics.registry).decode()
