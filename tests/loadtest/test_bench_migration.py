"""bench_migration's pure parts: the deployments, the option checks, the move's gap, the JSON check
and the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.loadtest import bench_migration as bm
from prefixserve.replica.config import EngineConfig
from prefixserve.router.cluster_config import AppArgs, IngressConfig


def test_the_deployments_are_valid_and_switch_migration_and_the_disk_tier() -> None:
    on = AppArgs.from_dict(bm.app_args("smollm2", 2, "migrate", None, 4.0))
    assert IngressConfig.from_dict(on.ingress_config()).migrate_streams
    assert EngineConfig(**on.engine).kv_disk_path is None
    off = AppArgs.from_dict(bm.app_args("smollm2", 2, "off", Path("/tmp/x"), 4.0))
    assert not IngressConfig.from_dict(off.ingress_config()).migrate_streams
    engine = EngineConfig(**off.engine)
    assert engine.kv_disk_path == "/tmp/x" and engine.kv_offloading_size == 4.0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--replicas", "1"], "replica to move to"),
        (["--kill-after", "200"], "kill-after"),
        (["--json-share", "2"], "json-share"),
        (["--kv-disk-gb", "-1"], "kv-disk-gb"),
    ],
)
def test_options_that_cannot_make_a_run_are_refused(argv, match) -> None:
    with pytest.raises(ValueError, match=match):
        bm.plan(bm.build_parser().parse_args(argv))
    bm.plan(bm.build_parser().parse_args([]))


def test_the_move_costs_its_gap_across_the_kill_less_the_usual_one() -> None:
    s = bm.Stream(0, False, chunk_times=[0.0, 0.1, 0.2, 0.3, 2.3, 2.4])
    assert bm.move_gap(s, killed_at=0.35) == pytest.approx(2.0 - 0.1 + 0.0)  # 2.3 - 0.3 - 0.1
    assert bm.move_gap(s, killed_at=5.0) is None  # nothing after the kill
    assert bm.move_gap(bm.Stream(1, False, chunk_times=[0.0, 1.0]), killed_at=0.5) is None  # one gap before


def test_a_json_answer_must_follow_the_schema_and_the_table_shows_the_ratios() -> None:
    assert bm.json_valid(json.dumps([1] * 30)) and not bm.json_valid(json.dumps([1] * 29))
    assert not bm.json_valid("[1, 2")
    run = bm.RunResult("migrate", 0, 20, 11, 20, 20, 5, 5, 11.0, 0.5, 5.5, [1.0, 2.0], [2.0, 4.0], [400, 448])
    assert run.extra_over_prefill_p99 == 4.0
    table = bm.render([run])
    assert "20/20" in table and "4.00" in table and "0.36" in table  # 2.0 / 5.5
