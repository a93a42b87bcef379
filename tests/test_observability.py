"""The dashboard and the replica's metrics on a real Prometheus.

A real Prometheus scrapes a real standalone replica (tiny random model) every
second while a short load with repeated prefixes runs; every PromQL expression of
observability/grafana-dashboard.json is then evaluated through Prometheus' HTTP
API and must return plausible values. A metric renamed on either side leaves a
panel empty and fails the test. The router's panels are evaluated the same way
against the Ray ingress in tests/test_cluster.py. The repository's scrape config
is checked with promtool.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from prometheus_helpers import REPO, PrometheusProcess, dashboard_queries, find_prometheus
from server_helpers import ReplicaProcess, build_tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_prometheus() is None, reason="prometheus is not installed (scripts/system-deps.sh)"),
]

# Long enough for several full KV blocks each.
SYSTEMS = [
    f"You are a terse assistant for tenant {i}. Answer in one short sentence, always politely. " * 3 for i in range(2)
]


def test_dashboard_queries_name_existing_panels():
    queries = dashboard_queries()
    assert len(queries) >= 10
    assert any(q.needs_router for q in queries) and any(not q.needs_router for q in queries)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with prometheus")
def test_scrape_config_is_valid():
    result = subprocess.run(
        ["promtool", "check", "config", str(REPO / "observability" / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_replica_panel_shows_plausible_values_on_a_real_prometheus(tmp_path_factory):
    ckpt = build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny", seed=7)
    workdir = tmp_path_factory.mktemp("prometheus")
    with ReplicaProcess(ckpt, "--max-model-len", "512", log_dir=workdir) as replica:
        with PrometheusProcess([f"127.0.0.1:{replica.port}"], workdir) as prometheus:
            prometheus.wait_until(prometheus.targets_up, 60.0, "the replica was not scraped")
            with httpx.Client(base_url=replica.base_url, timeout=120.0) as http:
                for i in range(12):  # each system prompt repeats: the prefix cache hits
                    response = http.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [
                                {"role": "system", "content": SYSTEMS[i % 2]},
                                {"role": "user", "content": f"question {i}"},
                            ],
                            "max_tokens": 4,
                            "temperature": 0.0,
                        },
                    )
                    assert response.status_code == 200, response.text
            queries = [q for q in dashboard_queries() if not q.needs_router]
            prometheus.evaluate(queries, timeout_s=60.0)


def test_json_logs_name_the_request_and_the_replica(tmp_path_factory):
    ckpt = build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny", seed=8)
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
