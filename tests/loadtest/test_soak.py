"""The soak benchmark: its statistics and targets on hand-made buckets; one short real run (slow)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict

import pytest

from prefixserve.loadtest import soak as S
from prefixserve.loadtest.harness.stats import nearest_rank


def _bucket(
    index: int,
    start_s: float,
    rss: int,
    statuses: dict[str, dict[str, int]],
    ttfts: list[float],
    idle: dict[str, float] | None = None,
) -> S.Bucket:
    b = S.Bucket(
        index,
        start_s,
        start_s + 60,
        {k: Counter(v) for k, v in statuses.items()},
        ttfts,
        dict.fromkeys(S.METRICS, 0.0) if idle is None else idle,
    )
    b.sample = S.ProcessSample(start_s + 60, {"replica[1]": rss}, 30, 12)
    return b


def _targets(targets: list[S.Target]) -> dict[str, bool | None]:
    return {t.name: t.passed for t in targets}


def test_least_squares_slope_and_percentile() -> None:
    assert S.least_squares_slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert S.least_squares_slope([(0, 1.0)]) == 0.0 and S.least_squares_slope([(1, 1.0), (1, 2.0)]) == 0.0
    assert nearest_rank([], 99) is None
    assert nearest_rank([3.0, 1.0, 2.0], 50) == 2.0 and nearest_rank(list(map(float, range(1, 101))), 99) == 99.0


def test_targets_pass_on_a_flat_run_and_fail_on_each_defect() -> None:
    mib = 2**20
    flat = [_bucket(i, 60.0 * i, 500 * mib, {"chat": {"200": 10}}, [0.1] * 10) for i in range(4)]
    samples = [S.ProcessSample(t, {"r": 500 * mib}, 1, 1) for t in range(0, 240, 5)]
    base = [_bucket(0, -60.0, 500 * mib, {"chat": {"200": 10}}, [0.1] * 10)]
    good = _targets(S.evaluate({"baseline": base, "soak": flat}, samples, 0.0, 60.0))
    assert set(good.values()) == {True} and len(good) == 5
    # Without a baseline the TTFT ratio is not evaluated, the rest still are.
    assert _targets(S.evaluate({"soak": flat}, samples, 0.0, 60.0))["TTFT p99 within 1.5x baseline"] is None

    five = [*flat[:3], _bucket(3, 180.0, 500 * mib, {"chat": {"200": 9}, "slow_body": {"502": 1}}, [0.1])]
    assert _targets(S.evaluate({"soak": five}, samples, 0.0, 60.0))["no 5xx"] is False
    grown = [*flat[:3], _bucket(3, 180.0, 520 * mib, {"chat": {"200": 10}}, [0.1] * 10)]
    assert _targets(S.evaluate({"soak": grown}, samples, 0.0, 60.0))["RSS after warm-up within 2%"] is False
    rising = [S.ProcessSample(t, {"r": (500 + t // 5) * mib}, 1, 1) for t in range(0, 240, 5)]  # +12 MiB/min
    assert _targets(S.evaluate({"soak": flat}, rising, 0.0, 60.0))["RSS no upward trend"] is False
    slow = [_bucket(i, 60.0 * i, 500 * mib, {"chat": {"200": 10}}, [0.2] * 10) for i in range(4)]
    assert (
        _targets(S.evaluate({"baseline": base, "soak": slow}, samples, 0.0, 60.0))["TTFT p99 within 1.5x baseline"]
        is False
    )
    busy = [
        *flat[:3],
        _bucket(
            3,
            180.0,
            500 * mib,
            {"chat": {"200": 10}},
            [0.1],
            {**dict.fromkeys(S.METRICS, 0.0), "vllm:num_requests_running": 1.0},
        ),
    ]
    assert (
        _targets(S.evaluate({"soak": busy}, samples, 0.0, 60.0))["idle: KV usage, running, waiting back to 0"] is False
    )


def test_gauges_sum_requests_and_take_the_largest_kv_usage() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{replica="a"} 0.25',
            'vllm:kv_cache_usage_perc{replica="b"} 0.5',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{replica="a"} 2',
            'vllm:num_requests_running{replica="b"} 1',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{replica="a"} 0',
            "",
        ]
    )
    assert S.scrape_gauges(text) == {
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 0.0,
    }


def test_config_refuses_bad_settings() -> None:
    for bad in ({"hostile_share": 1.5}, {"duration_s": 0}, {"bucket_s": 100, "duration_s": 50}, {"concurrency": 0}):
        with pytest.raises(ValueError):
            S.SoakConfig(**bad)


def test_kinds_come_from_the_flag_and_unknown_ones_are_refused() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    S.add_arguments(parser)
    assert parser.parse_args([]).kinds == tuple(S.HOSTILE_KINDS)
    assert parser.parse_args(["--kinds", "too_long, cancel"]).kinds == ("too_long", "cancel")
    for bad in ((), ("nope",), ("cancel", "cancel")):
        with pytest.raises(ValueError, match="kinds"):
            S.SoakConfig(kinds=bad)
    result = {"config": asdict(S.SoakConfig(kinds=("too_long",))), "phases": {}, "targets": []}
    assert "(kinds too_long)" in S.markdown(result)
    assert "kinds" not in S.markdown({**result, "config": asdict(S.SoakConfig())})


@pytest.mark.slow
def test_a_short_soak_runs_and_writes_its_table(tmp_path) -> None:
    """A quarter of a minute of traffic on a real replica: the structure of what it writes, idle KV back to 0.

    The targets themselves are not asserted: meeting them is the server's job, measured by the long run.
    """
    config = S.SoakConfig(
        duration_s=10,
        bucket_s=5,
        warmup_s=5,
        compare_baseline=True,
        baseline_s=5,
        sample_s=1.25,
        hostile_share=0.5,
        hold_s=2.0,
        idle_timeout_s=30,
        huge_messages=5_000,
    )
    result = S.run_soak(config, tmp_path)
    assert set(result["phases"]) == {"baseline", "soak"}
    assert len(result["phases"]["baseline"]) == 1 and len(result["phases"]["soak"]) == 2
    assert set(result["phases"]["baseline"][0]["statuses"]) == {S.NORMAL}  # no hostile share there
    hostile = {k for b in result["phases"]["soak"] for k in b["statuses"]} - {S.NORMAL}
    assert hostile and hostile <= set(S.HOSTILE_KINDS)
    for bucket in (b for phase in result["phases"].values() for b in phase):
        assert bucket["normal_ok"] > 0 and bucket["ttft_p99_s"] >= bucket["ttft_p50_s"] > 0
        assert bucket["rss_total_bytes"] > 0 and bucket["fds"] > 0 and bucket["threads"] > 0
        assert bucket["rss_bytes"] and sum(bucket["rss_bytes"].values()) == bucket["rss_total_bytes"]
        assert bucket["idle"] == dict.fromkeys(S.METRICS, 0.0)  # nothing left running, KV blocks released
    assert [t["name"] for t in result["targets"]] == [
        "no 5xx",
        "RSS after warm-up within 2%",
        "RSS no upward trend",
        "TTFT p99 within 1.5x baseline",
        "idle: KV usage, running, waiting back to 0",
    ]
    assert result["targets"][-1]["passed"] is True
    assert all(t["passed"] in (True, False) for t in result["targets"])  # each evaluated, given a baseline
    assert json.loads((tmp_path / "soak.json").read_text())["targets"] == result["targets"]
    table = (tmp_path / "soak.md").read_text()
    assert "### soak" in table and "### baseline" in table and "| target | result | detail |" in table
    assert table.count("\n| 0 | ") == 2 and "\n| 1 | " in table
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
