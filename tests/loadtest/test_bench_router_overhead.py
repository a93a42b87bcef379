"""bench_router_overhead: the summary's arithmetic, the phase order, and a run at a tiny setting (it runs
and both paths answer; how fast is the benchmark's business, not the test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.loadtest.bench_router_overhead import (
    OverheadConfig,
    main,
    phase_order,
    router_command,
    summarize,
    upstream_events,
)
from prefixserve.loadtest.harness.client import RequestRecord
from prefixserve.loadtest.peer_routers import PeerRouterVenv


def record(ttft_ms: float, total_ms: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(0, ok, 200, None, 1.0, 1.0 + ttft_ms / 1000, 1.0 + total_ms / 1000)


def test_the_added_latency_is_the_router_minus_direct() -> None:
    direct = [record(1.0 + i, 2.0 + i) for i in range(101)]
    routed = [record(1.5 + i, 3.0 + i) for i in range(101)] + [record(0.0, 0.0, ok=False)]
    s = summarize({"direct": direct, "router": routed})
    assert s["direct"]["ttft_p50_ms"] == pytest.approx(51.0) and s["router"]["errors"] == 1
    assert s["added"]["ttft_p50_ms"] == pytest.approx(0.5)
    assert s["added"]["total_p50_ms"] == pytest.approx(1.0)
    assert s["added"]["total_p99_ms"] == pytest.approx(1.0)


def test_rounds_alternate_which_path_goes_first() -> None:
    assert [phase_order(i) for i in range(3)] == [("direct", "router"), ("router", "direct"), ("direct", "router")]


def test_the_upstream_streams_a_whole_answer() -> None:
    events = upstream_events(3)
    payloads = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]\n\n" and len(events) == 6
    assert payloads[-1]["usage"]["completion_tokens"] == 3 and payloads[3]["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(ValueError):
        OverheadConfig(concurrency=0)
    with pytest.raises(ValueError):
        OverheadConfig(rate=-1.0)


@pytest.mark.parametrize(("rate", "router"), [("0", "prefixserve"), ("50", "prefixserve"), ("0", "protocol-relay")])
def test_the_benchmark_runs_at_a_tiny_setting(tmp_path: Path, rate: str, router: str) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--concurrency", "2", "--requests", "3", "--rounds", "2", "--runs", "1", "--warmup", "2", "--rate", rate]
    argv += ["--router", router]
    assert main([*argv, "--out", str(out), "--logs", str(tmp_path / "logs")]) == 0
    (result,) = json.loads(out.read_text())["runs"]
    for target in ("direct", "router"):
        assert result[target]["requests"] == 6 and result[target]["errors"] == 0
        assert result[target]["total_p99_ms"] >= result[target]["total_p50_ms"] > 0
    assert set(result["added"]) == {"ttft_p50_ms", "ttft_p99_ms", "total_p50_ms", "total_p99_ms"}


def test_a_peer_router_is_measured_from_its_venv_with_its_policy(tmp_path: Path) -> None:

    venv = PeerRouterVenv(tmp_path / "venv")
    smg = router_command("http://127.0.0.1:1", 9, OverheadConfig(router="smg"), venv)
    assert smg[0] == str(venv.binary("smg")) and smg[smg.index("--policy") + 1] == "round_robin"
    ours = router_command("http://127.0.0.1:1", 9, OverheadConfig())
    assert "router" in ours and ours[ours.index("--policy") + 1] == "placed"
    with pytest.raises(ValueError, match="venv"):
        router_command("http://127.0.0.1:1", 9, OverheadConfig(router="vllm-router"))
    with pytest.raises(ValueError, match="--router"):
        OverheadConfig(router="haproxy")
