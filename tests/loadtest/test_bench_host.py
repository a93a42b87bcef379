"""The host-overhead benchmark on a short setting: it runs, reads the engine's step timers
and writes its JSON, table and plot (a check that it works, not a timed test)."""

from __future__ import annotations

import json

import pytest

from prefixserve.loadtest import bench_host
from prefixserve.replica.engine.step_timer import PHASES


@pytest.mark.slow
def test_bench_host_runs_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert bench_host.main(["--batches", "1,4", "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["steps"] == 3
        assert set(r["parts_ms"]) == set(PHASES)
        assert r["parts_ms"]["forward"] > 0 and 0 < r["host_ms"] < r["step_ms"]
        assert "vllm_step_ms" not in r  # no --vllm-python: vLLM's column is skipped, and says so
    assert result["vllm"].startswith("skipped")
    assert result["input_builders"] == ["persistent"] and result["rows"] == result["builder_rows"]["persistent"]
    for raw in result["raw"]["prefixserve"]["persistent"].values():
        assert len(raw["wall"]) == len(raw["phases"]) == 3
    table = out.with_suffix(".md").read_text()
    assert table.splitlines()[0].startswith("| batch | step | host | forward |")
    assert table in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_host_compares_async_scheduling_off_and_on_on_the_same_requests(tmp_path):
    out = tmp_path / "host.json"
    argv = ["--batches", "2", "--steps", "4", "--warmup", "1", "--async-scheduling", "off,on", "--async-block", "2"]
    assert bench_host.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["async_scheduling"] == ["off", "on"] and result["async_block"] == 2
    for mode in ("off", "on"):
        (row,) = result["async_rows"][mode]
        assert row["batch"] == 2 and row["steps"] == 4 and row["step_ms"] > 0
        assert len(result["raw"]["prefixserve"][mode]["2"]["wall"]) == 4
    assert "| batch | off step / host | on step / host | on ÷ off (step, host) |" in out.with_suffix(".md").read_text()


def test_the_async_block_order_times_each_variant_equally_after_each_switch():
    order = bench_host.schedule_of(2, 5, 2)
    assert [v for v, timed in order if timed].count(0) == 5 == [v for v, timed in order if timed].count(1)
    # Every block starts with one untimed step of its variant (the pipeline fills or drains).
    assert order[:3] == [(0, False), (0, True), (0, True)] and order[3] == (1, False)
    assert bench_host.schedule_of(2, 3, 1) == [(0, True), (1, True)] * 3
