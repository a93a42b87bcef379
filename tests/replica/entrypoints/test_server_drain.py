"""SIGTERM drains a real ``prefixserve replica`` process.

A request in flight at the signal runs to its end; meanwhile ``/health`` and new
requests answer 503 with Retry-After; a stream still open at the drain timeout
ends with an in-band error event and ``data: [DONE]``; the process exits 0 with
no ERROR or traceback in its log. Asserted by events and status codes, with
generous waits, never by clocks.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from server_helpers import ReplicaProcess, StreamReader

pytestmark = pytest.mark.slow

WAIT_S = 120.0
DRAIN_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def ckpt_8192_positions(tiny_ckpts):
    """The shared tiny shape with 8192 positions, not the shared ckpt's 1024: the server runs at 8192."""
    return tiny_ckpts(max_pos=8192)


def test_sigterm_drains_then_ends_open_streams_in_band_and_exits_0(ckpt_8192_positions, tmp_path):
    with ReplicaProcess(
        ckpt_8192_positions,
        "--max-model-len",
        "8192",
        "--drain-timeout-s",
        str(DRAIN_TIMEOUT_S),
        "--log-level",
        "info",
        log_dir=tmp_path,
    ) as replica:
        base = replica.base_url
        # 8,000 decode steps cannot end within the drain timeout; 150 can.
        long = StreamReader(base, max_tokens=8000, timeout_s=WAIT_S)
        short = StreamReader(base, max_tokens=150, timeout_s=WAIT_S)
        assert long.started.wait(WAIT_S) and short.started.wait(WAIT_S)
        assert replica.proc is not None
        replica.proc.send_signal(signal.SIGTERM)

        for _ in range(600):  # until the process has handled the signal (bounded, not a timing assertion)
            health = httpx.get(f"{base}/health", timeout=WAIT_S)
            if health.status_code != 200:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "server_shutting_down"

        short.join()
        assert short.status == 200 and short.events[-1] == "[DONE]"
        assert short.finish_reasons() == ["length"]

        long.join()
        assert long.status == 200 and long.events[-1] == "[DONE]", long.events[-3:]
        last = long.payloads()[-1]
        assert last["error"]["code"] == "server_shutting_down", last
        assert replica.proc.wait(timeout=WAIT_S) == 0, replica.log_tail()
        log = replica.log_tail(200_000)
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
