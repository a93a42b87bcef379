"""The dashboard and the replica's metrics on a real Prometheus.

A real Prometheus scrapes a real standalone replica (tiny random model) every
second while a short load with repeated prefixes runs; every PromQL expression of
observability/grafana-dashboard.json is then evaluated through Prometheus' HTTP
API and must return plausible values. The replicas run with a host tier and one
shared disk directory, and the load evicts prefixes from the device pool and sends
another replica prompts the first one computed, so the KV tier panels have data too.
A metric renamed on either side leaves a panel empty and fails the test. The router's panels are evaluated the same way
against the Ray ingress in tests/router/serve/test_cluster.py. The repository's scrape config
is checked with promtool.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from prometheus_helpers import REPO, PrometheusProcess, dashboard_queries, find_prometheus
from server_helpers import ReplicaProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_prometheus() is None, reason="prometheus is not installed (scripts/system-deps.sh)"),
]

# Long enough for several full KV blocks each; more of them than the device pool holds.
SYSTEMS = [
    f"You are a terse assistant for tenant {i}. Answer in one short sentence, always politely. " * 3 for i in range(6)
]
# A device pool the six system prompts overflow (the host tier keeps what it evicts), a
# host tier and a disk bound that hold them all (a few KiB a block on the tiny model).
TIER_ARGS = ("--max-model-len", "256", "--num-kv-blocks", "20", "--kv-offloading-size", "0.002")


def test_dashboard_queries_name_existing_panels():
    queries = dashboard_queries()
    assert len(queries) >= 10
    assert any(q.needs_router for q in queries) and any(not q.needs_router for q in queries)
    assert any(q.needs_tiers for q in queries)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with prometheus")
def test_scrape_config_is_valid():
    result = subprocess.run(
        ["promtool", "check", "config", str(REPO / "observability" / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _chat(http: httpx.Client, system: str, question: str) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0.0,
        },
    )
    assert response.status_code == 200, response.text


def test_every_replica_panel_shows_plausible_values_on_a_real_prometheus(ckpt, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    disk = tmp_path_factory.mktemp("kv-disk")
    args = (*TIER_ARGS, "--kv-disk-path", str(disk), "--kv-disk-size-gb", "0.01")
    with ReplicaProcess(ckpt, *args, log_dir=workdir) as a, ReplicaProcess(ckpt, *args, log_dir=workdir) as b:
        with PrometheusProcess([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], workdir) as prometheus:
            prometheus.wait_until(prometheus.targets_up, 60.0, "the replicas were not scraped")
            with httpx.Client(base_url=a.base_url, timeout=120.0) as http:
                # Each system prompt twice in a row (a device hit), then all again after the others
                # evicted it from the device pool (host hits).
                for i in range(24):
                    _chat(http, SYSTEMS[(i // 2) % len(SYSTEMS)], f"question {i}")
            with httpx.Client(base_url=b.base_url, timeout=120.0) as http:
                for i, system in enumerate(SYSTEMS):  # what a wrote to the shared directory: disk hits on b
                    _chat(http, system, f"other question {i}")
            queries = [q for q in dashboard_queries() if not q.needs_router]
            prometheus.evaluate(queries, timeout_s=60.0)

            def total(expr: str) -> float:
                return sum(prometheus.query(f"sum({expr})"))

            tier = "prefixserve:kv_tier_{}_total{{tier='{}'}}"
            assert total(tier.format("stored_blocks", "host")) > 0 and total(tier.format("loaded_blocks", "host")) > 0
            assert total(tier.format("stored_blocks", "disk")) > 0 and total(tier.format("loaded_blocks", "disk")) > 0
            assert total(tier.format("hit_tokens", "disk")) > 0
            hits = total("vllm:external_prefix_cache_hits_total")
            assert 0 < hits <= total("vllm:external_prefix_cache_queries_total")
            assert total("prefixserve:kv_tier_copy_bytes_total{op='copy_back'}") > 0
            assert total("prefixserve:kv_disk_errors_total") == 0
            assert prometheus.query("min(prefixserve:kv_disk_enabled)") == [1.0]


def test_json_logs_name_the_request_and_the_replica(ckpt, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("logs")
    with ReplicaProcess(
        ckpt, "--log-format", "json", "--log-level", "info", "--replica-name", "replica-a", log_dir=workdir
    ) as replica:
        response = httpx.post(
            f"{replica.base_url}/v1/completions",
            timeout=120.0,
            headers={"X-Request-Id": "req-7"},
            json={"prompt": "hello", "max_tokens": 2},
        )
        assert response.status_code == 200 and response.headers["x-request-id"] == "req-7"
    lines = [json.loads(line) for line in replica.log_path.read_text().splitlines() if line.startswith("{")]
    ours = [line for line in lines if line["request_id"] == "req-7"]
    assert ours and all(line["replica"] == "replica-a" and line["level"] == "INFO" for line in ours), lines
    assert all(set(line) >= {"time", "level", "logger", "request_id", "replica", "event"} for line in lines)
    assert any(line["logger"] == "uvicorn.access" for line in lines)  # uvicorn's lines are JSON too
