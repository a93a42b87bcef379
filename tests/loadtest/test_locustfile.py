"""The locustfile, run headless for a few seconds against a real replica server.

Locust is run as its own process (its gevent monkey-patching must not touch the
test process). The replica serves a tiny random Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_helpers import ReplicaProcess, build_tiny_llama

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _locust(tmp_path: Path, host: str, env_extra: dict[str, str]) -> list[dict[str, str]]:
    locust = Path(sys.executable).parent / "locust"
    prefix = tmp_path / "run"
    env = dict(os.environ, **env_extra)
    proc = subprocess.run(
        [
            str(locust),
            "-f",
            str(REPO / "loadtest" / "locustfile.py"),
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "5s",
            "--stop-timeout",
            "20",
            "--host",
            host,
            "--csv",
            str(prefix),
            "--only-summary",
            "--loglevel",
            "WARNING",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(f"{prefix}_stats.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_locust_records_ttft_and_e2e_without_failures(tmp_path) -> None:
    ckpt = build_tiny_llama(tmp_path / "tiny-llama", seed=3)
    with ReplicaProcess(ckpt, "--max-model-len", "512", log_dir=tmp_path) as replica:
        model = httpx.get(f"{replica.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        rows = _locust(
            tmp_path,
            replica.base_url,
            {
                "PREFIXSERVE_WORKLOAD": "shared_prefix",
                "PREFIXSERVE_WORKLOAD_PARAMS": "num_groups=2,prompts_per_group=3,system_prompt_len=64,"
                "question_len=8,output_len=4",
                "PREFIXSERVE_SEED": "5",
                "PREFIXSERVE_MODEL": model,
                "PREFIXSERVE_SEND_PREFIX_HASH": "1",
            },
        )
        metrics = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
    by_type = {(r["Type"], r["Name"]): r for r in rows}
    ttft = by_type[("TTFT", "shared_prefix")]
    e2e = by_type[("E2E", "shared_prefix")]
    post = by_type[("POST", "/v1/chat/completions")]
    for row in (ttft, e2e, post):
        assert int(row["Request Count"]) >= 2, rows
        assert int(row["Failure Count"]) == 0, rows
    assert int(ttft["Request Count"]) == int(e2e["Request Count"]) == int(post["Request Count"])
    assert float(ttft["Median Response Time"]) <= float(e2e["Median Response Time"])
    # the shared system prompts were served from the prefix cache
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0
