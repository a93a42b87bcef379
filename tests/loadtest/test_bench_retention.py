"""bench_retention's and bench_responses' pure parts: the deployments, the option checks, the scripts and
the figures."""

from __future__ import annotations

import argparse

import pytest

from prefixserve.loadtest import bench_responses as bresp
from prefixserve.loadtest import bench_retention as bret
from prefixserve.replica.config import EngineConfig
from prefixserve.router.cluster_config import AppArgs


def test_the_deployments_are_valid_and_give_the_agent_the_whole_pin_budget() -> None:
    args = AppArgs.from_dict(bret.app_args("smollm2", 2, 256, "lru"))
    engine = EngineConfig(**args.engine)
    assert engine.num_kv_blocks == 256 and engine.eviction_policy == "lru"
    assert engine.cache_retention_tenant_budget == 1.0 and engine.cache_retention_budget == 0.5
    assert AppArgs.from_dict(bresp.app_args("smollm2", 2)).num_replicas == 2


def _parsed(module, *argv: str) -> argparse.Namespace:
    return module.build_parser().parse_args(list(argv))


def test_a_burst_too_small_to_fill_the_cache_and_a_single_turn_are_refused() -> None:
    with pytest.raises(ValueError, match="burst"):
        bret.plan(_parsed(bret, "--burst", "10", "--burst-tokens", "100"))
    bret.plan(_parsed(bret))
    with pytest.raises(ValueError, match="turns"):
        bresp.plan(_parsed(bresp, "--turns", "1"))
    bresp.plan(_parsed(bresp))


def test_the_conversations_are_seeded_and_the_figures_are_ratios() -> None:
    assert bresp.script(3, 2, 4, 20, 5) == bresp.script(3, 2, 4, 20, 5) != bresp.script(4, 2, 4, 20, 5)
    assert [len(c) for c in bresp.script(3, 2, 4, 20, 5)] == [5, 5]
    run = bret.RunResult("24h", 0, 900, 1000, 950, 1100, 0.5, 10.0, 40.0, 0.0)
    assert run.resumed_vs_pre_burst == pytest.approx(950 / 900)
    assert "1.056" in bret.render([run])
    chat = bresp.RunResult("chat", 0, 1000, 800, 10, 3.0)
    assert chat.hit_rate == 0.8 and "0.800" in bresp.render([chat])
