"""Scale-event benchmark: windowed hit rates, the dip, survivors and moved requests, sizing; one real run."""

from __future__ import annotations

import json
import random

import pytest

from prefixserve.loadtest import bench_scale as S
from prefixserve.loadtest.cluster_run import HITS, QUERIES
from prefixserve.loadtest.harness.client import RequestRecord


def _rec(i: int, prompt: int, cached: int, replica: str = "a", ok: bool = True) -> RequestRecord:
    return RequestRecord(
        index=i,
        ok=ok,
        status=200 if ok else 503,
        replica=replica,
        sent_s=float(i),
        first_token_s=i + 0.25,
        ended_s=i + 0.5,
        prompt_tokens=prompt if ok else None,
        cached_tokens=cached if ok else None,
        error=None if ok else "HTTP 503",
    )


# --------------------------------------------------------------------------- windows


def test_window_and_dip_worked_example():
    # Before the event (requests 2..3): 80 of 100 tokens and 90 of 100 cached; after (4..5): 10 and 80.
    recs = [_rec(0, 100, 0), _rec(1, 100, 0), _rec(2, 100, 80), _rec(3, 100, 90), _rec(4, 100, 10), _rec(5, 100, 80)]
    w = S.scale_windows(recs, event_index=4, width=2)
    assert (w.before.lo, w.before.hi, w.after.lo, w.after.hi) == (2, 4, 4, 6)
    assert w.before.hit_rate == pytest.approx(0.85) and w.after.hit_rate == pytest.approx(0.45)
    assert w.dip_pts == pytest.approx(40.0)
    assert w.before.span_s == pytest.approx(1.5) and w.after.ttft_p50_s == pytest.approx(0.25)
    # No dip when the after window hits as much: the dip is signed.
    flat = [*recs[:4], _rec(4, 100, 90), _rec(5, 100, 90)]
    assert S.scale_windows(flat, 4, 2).dip_pts == pytest.approx(-5.0)


def test_failed_requests_count_in_no_window_sum():
    recs = [_rec(0, 100, 50), _rec(1, 0, 0, ok=False), _rec(2, 100, 100)]
    w = S.window(recs, 0, 3)
    assert (w.requests, w.prompt_tokens, w.cached_tokens) == (2, 200, 150)
    assert S.window(recs, 1, 2).hit_rate is None


@pytest.mark.parametrize("seed", range(5))
def test_windows_and_rolling_rate_match_a_direct_count(seed):
    rng = random.Random(seed)
    n = rng.randrange(10, 60)
    recs = []
    for i in range(n):
        prompt = rng.randrange(1, 300)
        recs.append(_rec(i, prompt, rng.randrange(0, prompt + 1), ok=rng.random() > 0.1))
    rng.shuffle(recs)  # records may come in any order: the index is the send order
    width = rng.randrange(1, n // 2)
    k = rng.randrange(width, n - width + 1)
    by_index = {r.index: r for r in recs}

    def rate(lo: int, hi: int) -> float | None:
        ok = [by_index[i] for i in range(lo, hi) if by_index[i].ok]
        p = sum(r.prompt_tokens for r in ok)
        return sum(r.cached_tokens for r in ok) / p if p else None

    w = S.scale_windows(recs, k, width)
    assert w.before.hit_rate == pytest.approx(rate(k - width, k))
    assert w.after.hit_rate == pytest.approx(rate(k, k + width))
    rolling = S.rolling_hit_rate(recs, width)
    assert len(rolling) == n
    for i, got in enumerate(rolling):
        assert got == pytest.approx(rate(max(0, i - width + 1), i + 1))


def test_windows_refuse_sizes_that_do_not_fit():
    recs = [_rec(i, 10, 5) for i in range(6)]
    for k, width in ((1, 2), (3, 0)):
        with pytest.raises(ValueError):
            S.scale_windows(recs, k, width)
    with pytest.raises(ValueError):
        S.rolling_hit_rate(recs, 0)


# --------------------------------------------------------------------------- survivors and moved keys


def test_a_survivor_renamed_by_serve_is_found_by_its_unchanged_counters():
    before = {"r0": {QUERIES: 500.0, HITS: 300.0}, "r1": {QUERIES: 420.0, HITS: 250.0}}
    # Scale-down: r0 left and the survivor (r1) took rank 0's name.
    assert S.stayed(before, {"r0": {QUERIES: 420.0, HITS: 250.0}}) == {"r0": "r1"}
    # Scale-up: r0 stays as it was, the new replica has served nothing.
    up = {"r0": {QUERIES: 500.0}, "r1": {QUERIES: 0.0, HITS: 0.0}}
    assert S.stayed({"r0": {QUERIES: 500.0}}, up) == {"r0": "r0"}
    # Two replicas with equal counters cannot tell which survived: new to every key.
    assert S.stayed({"a": {QUERIES: 5.0}, "b": {QUERIES: 5.0}}, {"a": {QUERIES: 5.0}}) == {}


def test_moved_requests_are_those_on_a_replica_new_to_their_tenant():
    tenants = ["t0", "t1", "t0", "t1", "t0", "t1", "t2", "t1"]
    replicas = ["A", "B", "A", "B", "A", "A", "A", "B2"]
    recs = [_rec(i, 10, 5, replica=r) for i, r in enumerate(replicas)]
    w = S.scale_windows(recs, event_index=4, width=4)
    # After the event A (kept its name) serves t0 (its own: not moved), t1 (B's: moved), t2 (never seen:
    # moved); B2 is B renamed and serves t1, which B held.
    assert S.moved(recs, tenants, w, {"A": "A", "B2": "B"}) == [5, 6]
    # Without the rename B2 is a new replica: its request moved too.
    assert S.moved(recs, tenants, w, {"A": "A"}) == [5, 6, 7]


def test_pool_holds_every_prefix_and_the_in_flight_requests():
    prefix = {"a": 100, "b": 40}  # 6 and 2 full blocks of 16
    requests = [("a", 130), ("b", 60), ("a", 110)]  # 9 and 4 blocks: 3 and 2 beyond the prefix
    assert S.pool_blocks(prefix, requests, block_size=16, concurrency=2) == 8 + 2 * 3
    assert S.pool_blocks({"a": 0}, [("a", 400)], block_size=16, concurrency=1) == 25


def test_verdict_and_table():
    rows = []
    for tier, dip in (("off", 12.5), ("on", 1.0)):
        window = {"hit_rate": 0.5, "ttft_p50_s": 0.1}
        rows.append(
            {
                "tier": tier,
                "before": window,
                "after": window,
                "dip_pts": dip,
                "moved_requests": 3,
                "moved_hit_rate": None,
                "after_disk_hit_tokens": 0.0,
                "event_s": 12.0,
                "whole_run": window,
                "succeeded": 4,
                "requests": 4,
            }
        )
    assert S.verdict(rows) == {"dip_pts": {"off": 12.5, "on": 1.0}, "target_dip_pts": 2.0, "target_met": True}
    assert S.verdict(rows[:1])["target_met"] is None
    table = S.render_table(rows)
    assert "| on | 0.500 | 0.500 | +1.0 | 3 (n/a) |" in table


def test_cli_refuses_bad_options():
    for bad in (
        ["--scale-event", "sideways"],
        ["--scale-event", "up", "--tiers", "off,maybe"],
        ["--scale-event", "up", "--window", "60", "--requests", "96"],
        ["--scale-event", "down", "--scale-at", "1.0"],
    ):
        with pytest.raises(SystemExit) as exc:
            S.main([*bad, "--out-dir", "/nonexistent"])
        assert exc.value.code == 2


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_benchmark_end_to_end_on_a_local_cluster(tmp_path):
    from model_helpers import tiny_checkpoint
    from server_helpers import free_port

    model = tiny_checkpoint(tmp_path / "tiny", seed=4)
    out = tmp_path / "out"
    small = "--tenants 4 --requests 16 --window 4 --system-len 48 --question-len 8 --output-len 2 --concurrency 2"
    tiers = ["--host-gib", "0.01", "--disk-root", str(tmp_path)]
    where = ["--port", str(free_port()), "--out-dir", str(out), "--timeout", "120"]
    code = S.main(["--scale-event", "down", "--model", str(model), *small.split(), *tiers, *where])
    assert code == 0
    data = json.loads((out / "bench_scale_down.json").read_text())
    assert data["failures"] == {} and data["event_index"] == round(0.6 * 16)  # the default --scale-at
    assert [r["tier"] for r in data["rows"]] == ["off", "on"]
    for r in data["rows"]:
        assert r["succeeded"] == r["requests"] == 16
        assert r["replicas"] == [2, 1] and len(r["replicas_at_event"]) == 2 and len(r["replicas_after_event"]) == 1
        assert r["before"]["requests"] == r["after"]["requests"] == 4
        for w in (r["before"], r["after"], r["whole_run"]):
            assert 0.0 <= w["hit_rate"] <= 1.0
        assert r["dip_pts"] == pytest.approx(100 * (r["before"]["hit_rate"] - r["after"]["hit_rate"]))
        assert 0 <= r["moved_requests"] <= 4 and r["event_s"] > 0
    off, on = data["rows"]
    assert off["after_disk_hit_tokens"] == 0  # no disk tier, no disk hits
    assert set(data["summary"]["dip_pts"]) == {"off", "on"} and isinstance(data["summary"]["target_met"], bool)
    assert len(data["records"]["on"]) == 16
    assert (out / "bench_scale_down.md").read_text().count("\n| o") == 2
    assert (out / "bench_scale_down.png").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_scale_")]  # the disk directory is gone
