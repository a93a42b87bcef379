"""Draining the cluster (router/serve/drain.py, what ``prefixserve up`` does on SIGTERM) on a real Ray Serve app.

While it drains, the ingress answers ``/health`` and new requests 503 with
Retry-After; a stream still open at the drain timeout ends with an in-band
error event and ``data: [DONE]``. Asserted by events and status codes.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from cluster_helpers import APP_NAME, LocalRayCluster, deploy
from server_helpers import StreamReader

pytestmark = pytest.mark.slow

PORT = 18447
WAIT_S = 120.0


def test_a_draining_cluster_refuses_new_requests_and_ends_open_streams_in_band(ckpt_4096_positions):
    from prefixserve.router.serve.drain import drain_app

    model = ckpt_4096_positions
    cluster = LocalRayCluster(num_workers=1, cpus_per_worker=2)
    try:
        base = deploy(
            {
                "engine": {"model": model, "num_kv_blocks": 512, "max_model_len": 4096},
                "num_replicas": 1,
                "ray_actor_options": {"num_cpus": 0.5},
                "drain_timeout_s": 1.0,
                "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
            },
            PORT,
        )
        long = StreamReader(base, max_tokens=4000, timeout_s=WAIT_S)  # cannot end within the drain timeout
        assert long.started.wait(WAIT_S) and long.status == 200
        left: list[int] = []
        drain = threading.Thread(target=lambda: left.append(drain_app(APP_NAME, 1.0)), daemon=True)
        drain.start()
        for _ in range(600):  # until the ingress heard the drain (bounded, not a timing assertion)
            health = httpx.get(f"{base}/health", timeout=WAIT_S)
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        drain.join(timeout=WAIT_S)
        assert left == [1]
        long.join()
        assert long.events[-1] == "[DONE]", long.events[-3:]
        assert long.payloads()[-1]["error"]["code"] == "server_shutting_down", long.payloads()[-1]
    finally:
        cluster.shutdown()
