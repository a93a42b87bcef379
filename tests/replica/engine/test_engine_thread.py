"""The async engine builds its engine on the thread that steps it, and a failed build fails the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine import async_engine as AE
from prefixserve.replica.sampling_params import SamplingParams


class RecordingEngine(AE.LLMEngine):
    """The real engine, noting which threads built and stepped it."""

    built_on: list[str] = []
    stepped_on: set[str] = set()

    def __init__(self, *args, **kwargs) -> None:
        RecordingEngine.built_on.append(threading.current_thread().name)
        super().__init__(*args, **kwargs)

    def step(self, *args, **kwargs):
        RecordingEngine.stepped_on.add(threading.current_thread().name)
        return super().step(*args, **kwargs)


def test_the_engine_is_built_on_the_thread_that_steps_it(ckpt, monkeypatch):
    """Every OpenMP region of the model then starts from one thread (one worker pool in the process)."""
    monkeypatch.setattr(AE, "LLMEngine", RecordingEngine)
    RecordingEngine.built_on, RecordingEngine.stepped_on = [], set()
    engine = AE.AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_num_seqs=4))

    async def one_request():
        return [d async for d in engine.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3))]

    try:
        deltas = asyncio.run(one_request())
        assert sum(len(d.token_ids) for d in deltas) == 3
        assert RecordingEngine.built_on == ["prefixserve-engine"]
        assert RecordingEngine.stepped_on == {"prefixserve-engine"}
        assert threading.current_thread().name not in RecordingEngine.built_on
    finally:
        asyncio.run(engine.shutdown())


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
