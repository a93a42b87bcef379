"""The serving benchmark client: its requests and figures, and a short run against a real replica
(a check that it runs and reads what the server streams, not a timed test)."""

from __future__ import annotations

import json

import pytest
from server_helpers import ReplicaProcess, build_tiny_llama

from prefixserve.loadtest import bench_serve
from prefixserve.loadtest.bench_serve import BenchServeConfig, RequestResult


def test_prefix_repetition_bodies_share_their_prefixes():
    config = BenchServeConfig(base_url="http://x", num_prompts=12, prefix_repetition_prefix_len=40)
    bodies = bench_serve.request_bodies(config, 12, seed=0)
    assert len(bodies) == 12
    prefixes = {" ".join(b["prompt"].split()[:40]) for b in bodies}
    assert len(prefixes) == 4  # num_prefixes
    assert all(b["stream"] and b["max_tokens"] == 16 and b["ignore_eos"] for b in bodies)
    assert bench_serve.request_bodies(config, 12, seed=0) == bodies  # seeded
    chat = bench_serve.request_bodies(BenchServeConfig(base_url="http://x", endpoint="chat"), 3, seed=0)
    assert all(b["messages"][0]["role"] == "user" and "prompt" not in b for b in chat)


def test_summarize_follows_vllm_definitions():
    results = [
        RequestResult(ok=True, latency_s=1.0, ttft_s=0.4, itl_s=[0.2, 0.2, 0.2], output_tokens=4),
        RequestResult(ok=True, latency_s=2.0, ttft_s=0.5, itl_s=[1.5], output_tokens=2),
        RequestResult(ok=False, error="HTTP 500"),
    ]
    got = bench_serve.summarize(results, duration_s=4.0)
    assert got["completed"] == 2 and got["failed"] == 1 and got["errors"] == ["HTTP 500"]
    assert got["request_throughput"] == pytest.approx(0.5)
    assert got["output_throughput"] == pytest.approx(1.5)
    assert got["tpot_ms"]["p50"] == pytest.approx((200.0 + 1500.0) / 2)  # (latency - ttft) / (tokens - 1)
    assert got["ttft_ms"]["p50"] == pytest.approx(450.0)
    assert got["itl_ms"]["p50"] == pytest.approx(200.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="give --base-url"):
        BenchServeConfig()
    with pytest.raises(ValueError, match="request_rate"):
        BenchServeConfig(base_url="http://x", request_rate=0)
    with pytest.raises(ValueError, match="endpoint"):
        BenchServeConfig(base_url="http://x", endpoint="embeddings")


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_runs_against_a_replica(tmp_path, endpoint, capsys):
    checkpoint = build_tiny_llama(tmp_path / "tiny-llama", seed=7)
    with ReplicaProcess(
        checkpoint, "--served-model-name", "tiny", "--max-model-len", "256", log_dir=tmp_path
    ) as replica:
        out = tmp_path / "serve"
        code = bench_serve.main(
            [
                "--base-url",
                replica.base_url,
                "--endpoint",
                endpoint,
                "--served-model-name",
                "tiny",
                "--num-prompts",
                "6",
                "--num-warmups",
                "2",
                "--prefix-repetition-prefix-len",
                "32",
                "--prefix-repetition-suffix-len",
                "8",
                "--prefix-repetition-output-len",
                "4",
                "--max-concurrency",
                "2",
                "--request-rate",
                "50",
                "--out",
                str(out),
            ]
        )
        assert code == 0
    report = json.loads(out.with_suffix(".json").read_text())
    figures = report["servers"]["server"]["ours_client"]
    assert figures["completed"] == 6 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 6 * 4  # from the streamed usage (ignore_eos)
    assert figures["ttft_ms"]["p50"] > 0 and figures["tpot_ms"]["p50"] > 0 and figures["itl_ms"]["p50"] > 0
    assert out.with_suffix(".md").read_text() in capsys.readouterr().out


def test_a_tree_runs_under_an_interpreter_that_imports_that_tree(tmp_path):
    """--ours-tree must time the tree's own code: PYTHONPATH cannot point the installed package elsewhere."""
    from pathlib import Path

    from prefixserve.loadtest.bench_serve import tree_python

    here = Path(__file__).resolve().parents[2]
    python = tree_python(here)
    assert Path(python).exists()
    with pytest.raises(ValueError, match="make setup"):
        tree_python(tmp_path)
