"""The async engine builds its engine on the thread that steps it, and a failed build fails the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine import async_engine as AE
from prefixserve.replica.sampling_params import SamplingParams


class RecordingEngine(AE.LLMEngine):
    """The real engine, noting which threads built it and ran its forward."""

    built_on: list[str] = []
    ran_on: set[str] = set()

    def __init__(self, *args, **kwargs) -> None:
        RecordingEngine.built_on.append(threading.current_thread().name)
        super().__init__(*args, **kwargs)
        run = self.runner.run

        def recording_run(*a, **k):
            RecordingEngine.ran_on.add(threading.current_thread().name)
            return run(*a, **k)

        self.runner.run = recording_run


@pytest.mark.parametrize("async_scheduling, thread", [(False, "prefixserve-engine"), (True, "prefixserve-device_0")])
def test_the_model_is_built_on_the_thread_that_runs_its_forward(ckpt, monkeypatch, async_scheduling, thread):
    """Every OpenMP region of the model then starts from one thread (one worker pool in the process)."""
    monkeypatch.setattr(AE, "LLMEngine", RecordingEngine)
    RecordingEngine.built_on, RecordingEngine.ran_on = [], set()
    config = EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4, async_scheduling=async_scheduling)
    engine = AE.AsyncEngine(config)

    async def one_request():
        return [d async for d in engine.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3))]

    try:
        deltas = asyncio.run(one_request())
        assert sum(len(d.token_ids) for d in deltas) == 3
        assert RecordingEngine.built_on == [thread]
        assert RecordingEngine.ran_on == {thread}
    finally:
        asyncio.run(engine.shutdown())
    assert thread not in {t.name for t in threading.enumerate()}


def test_a_failed_build_raises_on_the_callers_thread_and_leaves_no_thread(ckpt, monkeypatch):
    class Broken:
        def __init__(self, config) -> None:
            raise ValueError("no such model here")

    monkeypatch.setattr(AE, "LLMEngine", Broken)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no such model here"):
        AE.AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64))
    for t in threading.enumerate():
        if t.name == "prefixserve-engine":
            t.join(timeout=10)
    assert "prefixserve-engine" not in {t.name for t in threading.enumerate() if t.is_alive()} - before


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_offline_llm_builds_its_model_where_the_forward_runs(ckpt, monkeypatch, async_scheduling):
    from prefixserve.replica.entrypoints import llm as offline

    monkeypatch.setattr(offline, "LLMEngine", RecordingEngine)
    RecordingEngine.built_on, RecordingEngine.ran_on = [], set()
    model = offline.LLM(ckpt, num_kv_blocks=64, max_num_seqs=4, async_scheduling=async_scheduling)
    try:
        out = model.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        expected = "prefixserve-device_0" if async_scheduling else threading.current_thread().name
        assert RecordingEngine.built_on == [expected]
        assert RecordingEngine.ran_on == {expected}
    finally:
        model.shutdown()
