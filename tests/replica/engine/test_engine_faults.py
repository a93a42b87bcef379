"""Hostile requests and faults inside the engine loop, on a tiny random checkpoint.

Every value that could break the loop is refused before it is queued; a fault in one
request's own work fails that request alone (blocks freed, everyone else served); a
fault in shared state (the model forward) fails the in-flight requests with
EngineDeadError and restarts the engine state, a bounded number of times.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.core.request import PreparedRequest, Request
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.errors import EngineDeadError, PromptTooLongError, RequestFailedError, RequestRejected
from prefixserve.replica.sampling_params import SamplingParams

PROMPTS = [[100 + 7 * i + k for k in range(5 + i)] for i in range(4)]
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, num_kv_blocks=64, max_num_seqs=4, max_model_len=256)


def _step_to_end(engine, never_stalls: bool = False) -> tuple[dict, dict]:
    """Step until nothing is unfinished (with ``never_stalls``, asserting no step stalled): the
    final outputs and the errors, by request id."""
    outputs, errors = {}, {}
    while engine.has_unfinished_requests():
        for u in engine.step():
            if u.error is not None:
                errors[u.request_id] = u.error
            elif u.output is not None:
                outputs[u.request_id] = u.output
        assert not (never_stalls and engine.stalled)
    return outputs, errors


def _free(engine: LLMEngine) -> int:
    engine.kv_manager.check_invariants()
    return engine.kv_manager.num_free_blocks


# --- refused before the queue -------------------------------------------------------------


@pytest.mark.parametrize(
    "params, words",
    [
        # An id past the vocabulary would reach the sampler's ban mask and kill the loop.
        (SamplingParams(stop_token_ids=[1_000_000_000], min_tokens=1), "stop_token_ids must be in [0, 49152)"),
        (SamplingParams(logit_bias={49152: 1.0}), "logit_bias keys must be token ids in [0, 49152)"),
        # n above max_num_seqs could never be admitted and would block the queue.
        (SamplingParams(n=5, temperature=1.0), "n is 5 but this engine runs at most max_num_seqs=4"),
    ],
)
def test_requests_the_loop_cannot_serve_are_refused_up_front(llm, params, words):
    with pytest.raises(RequestRejected) as info:
        llm.engine.add_request(None, PROMPTS[0], params)
    assert words in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_seed_at_the_top_of_the_range_with_n_children_wraps(llm):
    # seed + index must wrap, not overflow torch's manual_seed inside step().
    top = SamplingParams(n=2, temperature=1.0, seed=2**64 - 1, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPTS[1], top)[0]
    wrapped = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[1].token_ids == wrapped.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 8


def test_a_tiny_temperature_is_greedy(llm):
    # 1e-45 is 0 in float32: dividing by it would give NaN and an empty completion.
    greedy = llm.generate(PROMPTS[2], LONG)[0].outputs[0]
    tiny = llm.generate(PROMPTS[2], SamplingParams(temperature=1e-45, max_tokens=24, ignore_eos=True))[0]
    assert tiny.outputs[0].token_ids == greedy.token_ids and len(greedy.token_ids) == 24


def test_logit_bias_steers_generation(llm):
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logit_bias={1234: 100.0})
    )[0]
    assert out.outputs[0].token_ids == [1234] * 6


def test_a_text_prompt_too_long_to_fit_is_refused_before_tokenizing(llm):
    engine = llm.engine
    assert engine.input_processor.max_prompt_chars is not None
    with pytest.raises(PromptTooLongError, match="characters"):
        engine.input_processor.tokenize("a" * (engine.input_processor.max_prompt_chars + 1))
    # The bound is sound: no text packs more characters into a token than the longest vocab string.
    longest = engine.input_processor.max_prompt_chars // engine.max_model_len
    for text in ("\n" + " " * 500 + "x", "hello world " * 50, "é€😀" * 100, "<|im_start|>" * 30):
        assert len(text) <= longest * len(engine.input_processor.tokenize(text))


# --- one request fails alone --------------------------------------------------------------


def test_a_fault_in_one_request_fails_it_alone_offline(llm):
    engine = llm.engine
    free = _free(engine)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(
            f"f{i}", p, SamplingParams(n=2 if i == 1 else 1, temperature=1.0, max_tokens=10, ignore_eos=True)
        )
    engine.step()
    # A validation gap: an id past the vocabulary slipped into a running request.
    engine.requests["f1"].params.stop_token_ids = [10**9]
    engine.requests["f1"].params.min_tokens = 10
    results, errors = _step_to_end(engine)
    assert set(errors) == {"f1"} and isinstance(errors["f1"], RequestFailedError)
    assert isinstance(errors["f1"].__cause__, IndexError) and "IndexError" in str(errors["f1"])
    assert {rid: len(o.outputs[0].token_ids) for rid, o in results.items()} == {"f0": 10, "f2": 10}
    assert _free(engine) == free


def test_a_request_that_can_never_run_does_not_block_the_queue(llm):
    engine = llm.engine
    engine.add_request("wide", PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=4))
    engine.requests["wide"].params.n = 9  # past validation: more seats than max_num_seqs
    engine.add_request("behind", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    outputs, errors = _step_to_end(engine, never_stalls=True)
    assert isinstance(errors["wide"], RequestRejected) and "never be scheduled" in str(errors["wide"])
    assert len(outputs["behind"].outputs[0].token_ids) == 4


# --- the async engine: chaos, restarts, death ---------------------------------------------


async def _collect(engine: AsyncEngine, prompt, params, rid):
    return [d async for d in engine.generate(prompt, params, request_id=rid)]


async def test_chaos_one_stream_fails_alone_and_no_block_leaks(llm, ckpt):
    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4), engine=llm.engine)
    inner = engine.engine
    free = _free(inner)

    def hook(req: Request) -> None:
        if req.request_id == "victim" and req.num_output_tokens >= 6:
            raise RuntimeError("injected")
        if req.request_id == "rude" and req.num_output_tokens >= 2:
            raise RequestRejected("this request is at fault")

    inner.fault_hook = hook
    try:
        victim = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True)
        results = await asyncio.gather(
            _collect(engine, PROMPTS[0], LONG, "a"),
            _collect(engine, PROMPTS[1], victim, "victim"),
            _collect(engine, PROMPTS[2], LONG, "b"),
            _collect(engine, PROMPTS[3], LONG, "rude"),
            return_exceptions=True,
        )
        assert isinstance(results[1], RequestFailedError) and "victim" in str(results[1])
        assert isinstance(results[3], RequestRejected)
        for deltas in (results[0], results[2]):
            assert sum(len(d.token_ids) for d in deltas) == 24
            assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].finish_reason == "length"
        assert not inner.requests and _free(inner) == free
        again = await _collect(engine, PROMPTS[1], LONG, "after")
        assert sum(len(d.token_ids) for d in again) == 24
        assert engine.is_running and engine.num_restarts == 0
    finally:
        inner.fault_hook = None
        await engine.shutdown()


async def test_a_model_failure_restarts_the_engine_until_the_bound(llm, ckpt):
    inner = llm.engine
    real_execute = inner.runner.execute
    fail = threading.Event()

    def execute(*args, **kwargs):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected forward failure")
        return real_execute(*args, **kwargs)

    inner.runner.execute = execute
    engine = AsyncEngine(
        EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4, max_engine_restarts=1), engine=inner
    )
    try:
        streams = [
            engine.generate(p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)) for p in PROMPTS[:2]
        ]
        for s in streams:
            await s.__anext__()  # both running
        fail.set()
        for s in streams:
            with pytest.raises(EngineDeadError, match="restarted"):
                async for _ in s:
                    pass
        after = await _collect(engine, PROMPTS[2], LONG, "after-restart")
        assert sum(len(d.token_ids) for d in after) == 24
        assert engine.num_restarts == 1 and engine.is_running
        assert (
            inner.metrics.registry.get_sample_value(
                "prefixserve:engine_restarts_total", {"model_name": inner.model_name, "engine": "0"}
            )
            == 1
        )
        engine.check_health()
        assert _free(inner) == inner.kv_manager.num_blocks
        # One more failure within the window is past max_engine_restarts=1: dead for good.
        fail.set()
        with pytest.raises(EngineDeadError):
            await _collect(engine, PROMPTS[3], LONG, "fatal")
        for _ in range(500):
            if not engine.is_running:
                break
            await asyncio.sleep(0.01)
        assert not engine.is_running and engine.num_restarts == 1
        with pytest.raises(EngineDeadError, match="max_engine_restarts=1"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, PROMPTS[0], LONG, "refused")
    finally:
        await engine.shutdown()
        del inner.runner.execute
        inner.reset()


async def test_text_prompts_are_tokenized_off_the_event_loop(llm, ckpt):
    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4), engine=llm.engine)
    threads = []
    real = engine.engine.input_processor.tokenize

    def spy(prompt):
        threads.append(threading.get_ident())
        return real(prompt)

    engine.engine.input_processor.tokenize = spy
    try:
        deltas = await _collect(engine, "hello there", SamplingParams(temperature=0.0, max_tokens=3), "text")
        assert sum(len(d.token_ids) for d in deltas) >= 1
        assert threads and threading.get_ident() not in threads
        with pytest.raises(PromptTooLongError):
            await _collect(engine, "a" * (engine.engine.input_processor.max_prompt_chars + 1), LONG, "huge")
    finally:
        del engine.engine.input_processor.tokenize
        await engine.shutdown()


async def test_the_loop_waits_instead_of_spinning_when_nothing_can_progress(llm, ckpt):
    engine = AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4), engine=llm.engine)
    inner = engine.engine
    steps = []
    real_step = inner.step

    def counting_step():
        steps.append(1)
        return real_step()

    inner.step = counting_step
    try:
        # A request the scheduler does not hold (a bookkeeping bug): steps change nothing.
        orphan = Request(PreparedRequest("orphan", (5, 6), SamplingParams(), None, 0.0))
        await engine.abort("nothing")  # the loop is between steps here; it is safe to touch its state
        inner.requests["orphan"] = orphan
        inner.stalled = False
        engine._wake.set()
        for _ in range(500):
            if inner.stalled:
                break
            await asyncio.sleep(0.01)
        assert inner.stalled
        await asyncio.sleep(0.2)
        assert len(steps) <= 2, f"the loop stepped {len(steps)} times on empty plans"
        assert await engine.abort("orphan")
        deltas = await _collect(engine, PROMPTS[0], LONG, "works")
        assert sum(len(d.token_ids) for d in deltas) == 24
    finally:
        del inner.step
        await engine.shutdown()
