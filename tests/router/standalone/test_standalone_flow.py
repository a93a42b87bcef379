"""Flow control in the standalone router (``--tenants``): real HTTP, a router over fake upstream replicas."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import metric
from standalone_router_helpers import USAGE, FakeReplica, RouterServerThread, ServerThread, wait_until

from prefixserve.router.standalone.config import StandaloneRouterConfig
from prefixserve.router.standalone.proxy import ROUTER_SELF, StandaloneRouter

TENANTS = """\
tenant_header: x-tenant
tenants:
  - {name: live, api_key: k-live, priorities: [0, 0]}
  - {name: batch, api_key: k-batch, priorities: [10, 10]}
  - {name: noisy, header_value: noisy, requests_per_minute: 0.06}  # two banked, the next in 1,000 s
"""
REASON = "X-Prefixserve-Reject-Reason"


def chat(user: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": user}], "stream": stream, "max_tokens": 4}


def key(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


def serve(tmp_path: Path, upstream: ServerThread, **settings: Any) -> tuple[RouterServerThread, StandaloneRouter]:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    config = StandaloneRouterConfig(replicas=[upstream.url], tenants=str(tenants), health_interval_s=60.0, **settings)
    router = StandaloneRouter(config)
    return RouterServerThread.for_router(router), router


def test_tenants_quotas_and_the_settled_usage(tmp_path: Path) -> None:
    fake = FakeReplica()
    with ServerThread(fake.app) as up:
        server, router = serve(tmp_path, up)
        with server, httpx.Client(base_url=server.url, timeout=60) as client:
            unknown = client.post("/v1/chat/completions", json=chat("hi"), headers=key("k-other"))
            assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "unknown_tenant"
            assert (
                unknown.headers[REASON] == "unknown_tenant" and unknown.headers["X-Prefixserve-Replica"] == ROUTER_SELF
            )
            outside = client.post("/v1/chat/completions", json={**chat("hi"), "priority": 3}, headers=key("k-batch"))
            assert outside.status_code == 400 and outside.json()["error"]["param"] == "priority"
            for _ in range(2):  # its two banked requests
                noisy = client.post("/v1/chat/completions", json=chat("hi"), headers={"x-tenant": "noisy"})
                assert noisy.status_code == 200
            over = client.post("/v1/chat/completions", json=chat("hi"), headers={"x-tenant": "noisy"})
            assert over.status_code == 429 and over.headers[REASON] == "requests_per_minute"
            assert (
                over.json()["error"]["code"] == "tenant_rate_limit_exceeded" and int(over.headers["Retry-After"]) >= 1
            )
            assert len(fake.received) == 2  # no refused request reached the replica
            text = client.get("/metrics").text
            assert (
                metric(text, "prefixserve_router_flow_tokens_total", tenant="noisy", kind="prompt")
                == 2 * USAGE["prompt_tokens"]
            )
            assert (
                metric(text, "prefixserve_router_flow_tokens_total", tenant="noisy", kind="completion")
                == 2 * USAGE["completion_tokens"]
            )
            assert (
                metric(text, "prefixserve_router_flow_rejections_total", tenant="noisy", reason="requests_per_minute")
                == 1
            )
            assert router.flow is not None and router.flow.in_flight == 0


def test_past_its_slots_the_router_serves_the_best_band_first_and_frees_every_slot(tmp_path: Path) -> None:
    fake = FakeReplica()
    fake.gate = threading.Event()
    with ServerThread(fake.app) as up:
        server, router = serve(tmp_path, up, flow_max_in_flight=1)
        flow = router.flow
        assert flow is not None
        with server, httpx.Client(base_url=server.url, timeout=60) as client, ThreadPoolExecutor(3) as pool:
            with client.stream(
                "POST", "/v1/chat/completions", json=chat("holder", stream=True), headers=key("k-batch")
            ) as held:
                lines = held.iter_lines()  # held: a dropped iterator closes the stream
                next(line for line in lines if line.startswith("data: "))
                later_batch = pool.submit(
                    client.post, "/v1/chat/completions", json=chat("batch"), headers=key("k-batch")
                )
                wait_until(lambda: flow.queued == 1, "the batch request waits")
                later_live = pool.submit(client.post, "/v1/chat/completions", json=chat("live"), headers=key("k-live"))
                wait_until(lambda: flow.queued == 2, "the live request waits")
                fake.gate.set()
                list(lines)
            assert later_live.result().status_code == 200 and later_batch.result().status_code == 200
        users = [body["messages"][-1]["content"] for body in fake.received]
        assert users == ["holder", "live", "batch"]  # the live band went first, though it came last
        wait_until(lambda: flow.in_flight == 0, "every slot was released")


def test_a_wait_past_the_budget_is_a_503(tmp_path: Path) -> None:
    fake = FakeReplica()
    fake.gate = threading.Event()
    with ServerThread(fake.app) as up:
        server, router = serve(tmp_path, up, flow_max_in_flight=1, queue_budget_s=0.05)
        with server, httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream(
                "POST", "/v1/chat/completions", json=chat("holder", stream=True), headers=key("k-live")
            ) as held:
                lines = held.iter_lines()  # held: a dropped iterator closes the stream
                next(line for line in lines if line.startswith("data: "))
                late = client.post("/v1/chat/completions", json=chat("late"), headers=key("k-live"))
                assert late.status_code == 503 and late.headers[REASON] == "queue_timeout"
                fake.gate.set()
                list(lines)
        assert router.flow is not None
        wait_until(lambda: router.flow.in_flight == 0 and router.flow.queued == 0, "nothing left held")  # type: ignore[union-attr]


def test_a_malformed_tenant_file_stops_the_router_with_its_line(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: a\n    apikey: k\n")
    with pytest.raises(ValueError, match="line 3: unknown tenant keys"):
        StandaloneRouterConfig(replicas=["http://127.0.0.1:1"], tenants=str(tenants))
