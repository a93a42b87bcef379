"""The GPU engine benchmark's every measurement, run on the CPU with a 2-layer model
(``--device cpu --shapes tiny``), so the one-command GPU run is known to work."""

from __future__ import annotations

import json

import pytest

from prefixserve.loadtest import bench_engine_gpu


@pytest.mark.slow
def test_the_gpu_benchmark_runs_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert (
        bench_engine_gpu.main(
            [
                "--device",
                "cpu",
                "--shapes",
                "tiny",
                "--batches",
                "1",
                "4",
                "--max-num-seqs",
                "4",
                "--steps",
                "3",
                "--prefix-len",
                "120",
                "--tenants",
                "2",
                "--per-tenant",
                "3",
                "--hf-batch",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (result,) = json.loads(out.read_text())["results"]
    assert [d["batch"] for d in result["decode"]["eager"]] == [1, 4]
    assert all(d["step_ms"] > 0 for d in result["decode"]["eager"])
    assert result["caching"]["same_tokens"] == "6/6"
    assert result["caching"]["on"]["hit_rate"] > 0 and result["caching"]["off"]["hit_rate"] == 0
    greedy = result["greedy_fp32"]["eager"]
    assert greedy["identical"] == "6/6" and greedy["prefix_hits"] > 0 and greedy["preemptions"] > 0
    assert "| eager | 4 |" in capsys.readouterr().out
