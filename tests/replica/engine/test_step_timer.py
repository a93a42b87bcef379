"""The engine's step timers on a tiny random checkpoint: they change no token, their phases
are disjoint parts of the step, the KV manager's time is counted apart, and every step
lands in prefixserve:step_phase_seconds."""

from __future__ import annotations

import math

import pytest
from model_helpers import hf_greedy, hf_model, shared_prefix_prompts

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.engine.step_timer import PHASES, StepPhases
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# A small pool and a small token budget: chunked prefill, prefix hits and preemption in one run.
KNOBS = dict(num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=9, prefix_len=33, n=6, lo=3, hi=14)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[StepPhases]]:
    """Greedy tokens of every prompt (all queued at once) and, with timers on, each step's phases."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        for u in engine.step():
            if u.output is not None:
                tokens[u.request_id] = u.output.outputs[0].token_ids
        if engine.step_timer is not None:
            assert engine.step_timer.last is not None
            steps.append(engine.step_timer.last)
    return [tokens[f"r{i}"] for i in range(len(prompts))], steps


def test_timers_change_no_token_and_phases_partition_the_step(ckpt, prompts):
    timed = LLMEngine(EngineConfig(model=ckpt, **KNOBS))
    untimed = LLMEngine(EngineConfig(model=ckpt, enable_step_timers=False, **KNOBS))
    assert untimed.step_timer is None and type(untimed.kv_manager) is KVCacheManager
    with_timers, steps = _run(timed, prompts)
    without, _ = _run(untimed, prompts)
    assert with_timers == without
    # The same engine is the same model: transformers agrees on every prompt.
    hf = hf_model(ckpt)
    assert with_timers == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert timed.scheduler.num_preemptions > 0  # the KV manager was pressed: frees and reallocations
    assert timed.kv_manager.stats.prefix_hit_tokens > 0
    ran = [s for s in steps if s.num_seqs]
    assert ran and len(steps) == timed.step_timer.steps
    for step in steps:
        assert set(step.seconds) == set(PHASES)
        assert all(v >= 0.0 for v in step.seconds.values())
        # Disjoint phases: together they are the step's wall time (up to float rounding), never more.
        assert math.fsum(step.seconds.values()) <= step.wall * (1 + 1e-9) + 1e-12
    for step in ran:
        assert step.seconds["forward"] > 0.0 and step.seconds["schedule"] > 0.0
        assert step.host == pytest.approx(step.wall - step.seconds["forward"])
    # Every scheduled step allocates slots: the KV manager's own time is counted apart.
    assert all(s.seconds["kv_manager"] > 0.0 for s in ran)


def test_every_step_is_observed_per_phase(ckpt, prompts):
    engine = LLMEngine(EngineConfig(model=ckpt, **KNOBS))
    _, steps = _run(engine, prompts[:3])
    registry = engine.metrics.registry
    labels = {"model_name": engine.config.model_name, "engine": "0"}
    for phase in PHASES:
        count = registry.get_sample_value("prefixserve:step_phase_seconds_count", {**labels, "phase": phase})
        total = registry.get_sample_value("prefixserve:step_phase_seconds_sum", {**labels, "phase": phase})
        assert count == len(steps)
        assert total == pytest.approx(math.fsum(s.seconds[phase] for s in steps))
    untimed = LLMEngine(EngineConfig(model=ckpt, enable_step_timers=False, **KNOBS))
    _run(untimed, prompts[:1])
    sample = untimed.metrics.registry.get_sample_value(
        "prefixserve:step_phase_seconds_count", {**labels, "phase": "forward"}
    )
    assert sample is None
