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
