"""Cluster benchmark: metrics parsing, KV sizing, load bookkeeping, statistics, rendering; one real run."""

from __future__ import annotations

import json
import math
import random
import zlib

import pytest
from prometheus_client import generate_latest

from prefixserve.loadtest import bench_cluster as B
from prefixserve.loadtest.cluster_run import (
    HITS,
    PREEMPTIONS,
    QUERIES,
    UNLABELLED,
    counter_deltas,
    in_flight_by_replica,
    replica_counters,
)
from prefixserve.loadtest.harness.client import RequestRecord
from prefixserve.replica.engine.metrics import EngineMetrics
from prefixserve.router.serve.metrics import merge_expositions

# --------------------------------------------------------------------------- metrics


def _engine_text(queries: int, hits: int) -> str:
    m = EngineMetrics("m")
    m.observe_step(
        num_running=1,
        num_waiting=0,
        kv_usage=0.5,
        prefix_queries=queries,
        prefix_hits=hits,
        num_preemptions=0,
        num_prompt_tokens=queries,
        num_generation_tokens=3,
    )
    return generate_latest(m.registry).decode()


def test_replica_counters_read_each_replica_out_of_the_ingress_exposition():
    rng = random.Random(11)
    truth = {
        f"SERVE_REPLICA::app#Engine#{i}": (q := rng.randrange(1, 10_000), rng.randrange(0, q + 1)) for i in range(3)
    }
    text = merge_expositions({name: _engine_text(q, h) for name, (q, h) in truth.items()}).decode()
    got = replica_counters(text)
    assert got == {name: {QUERIES: float(q), HITS: float(h), PREEMPTIONS: 0.0} for name, (q, h) in truth.items()}


def test_replica_counters_of_a_lone_replica_and_of_text_without_them():
    assert replica_counters(_engine_text(40, 16)) == {UNLABELLED: {QUERIES: 40.0, HITS: 16.0, PREEMPTIONS: 0.0}}
    assert replica_counters("# HELP x y\n# TYPE x counter\nx_total 3.0\n") == {}


def test_counter_deltas_start_new_replicas_from_zero():
    before = {"a": {QUERIES: 10.0, HITS: 4.0}}
    after = {"a": {QUERIES: 30.0, HITS: 9.0}, "b": {QUERIES: 7.0, HITS: 0.0}}
    assert counter_deltas(before, after) == {"a": {QUERIES: 20.0, HITS: 5.0}, "b": {QUERIES: 7.0, HITS: 0.0}}


# --------------------------------------------------------------------------- KV sizing


@pytest.mark.parametrize("seed", range(5))
def test_kv_sizing_working_set_exceeds_one_replica_and_fits_the_cluster(seed):
    rng = random.Random(seed)
    block = rng.choice([8, 16, 32])
    replicas = rng.randrange(2, 6)
    headroom = rng.uniform(1.0, replicas - 0.01)
    concurrency = rng.randrange(1, 9)
    prefix = {f"t{i}": rng.randrange(block, 20 * block) for i in range(rng.randrange(3, 30))}
    requests = [(t, prefix[t] + rng.randrange(1, 5 * block)) for t in rng.choices(sorted(prefix), k=50)]
    s = B.size_kv(prefix, requests, block_size=block, replicas=replicas, concurrency=concurrency, headroom=headroom)
    assert s.working_set_blocks == sum(n // block for n in prefix.values())
    assert s.request_blocks == max(-(-total // block) for _, total in requests)
    assert s.num_kv_blocks >= s.request_blocks
    if s.num_kv_blocks > s.request_blocks:  # the formula, not the one-request floor, decided
        assert s.replica_fraction < 1.0 <= s.cluster_fraction
    assert s.reserve_blocks == -(-concurrency // replicas) * s.private_blocks


def test_kv_sizing_worked_example():
    # Two tenants of 100 and 70 prefix tokens (6 + 4 full blocks), requests of 120 tokens at most.
    s = B.size_kv(
        {"a": 100, "b": 70}, [("a", 120), ("b", 90), ("a", 101)], block_size=16, replicas=2, concurrency=3, headroom=1.5
    )
    assert (s.working_set_blocks, s.request_blocks, s.private_blocks, s.reserve_blocks) == (10, 8, 2, 4)
    assert s.num_kv_blocks == math.ceil(1.5 * 10 / 2) + 4 == 12
    assert "W = 10 blocks" in s.describe() and "num_kv_blocks = 12" in s.describe()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replicas=1, headroom=1.0), "at least 2 replicas"),
        (dict(replicas=2, headroom=2.0), "headroom"),
        (dict(replicas=2, headroom=0.9), "headroom"),
    ],
)
def test_kv_sizing_refuses_sizes_where_routing_cannot_matter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        B.size_kv({"a": 64}, [("a", 80)], block_size=16, concurrency=2, **kwargs)


def test_kv_sizing_refuses_prompts_shorter_than_a_block():
    with pytest.raises(ValueError, match="--system-len"):
        B.size_kv({"a": 10, "b": 15}, [("a", 30)], block_size=16, replicas=2, concurrency=1, headroom=1.5)


def test_workload_token_counts_use_the_templated_shared_prefix():
    # A chat template that wraps every message: the shared part ends inside the user turn's header.
    def encode(messages):
        ids = [1]
        for m in messages:
            ids += [2, len(m["role"])] + [zlib.crc32(w.encode()) % 1000 + 10 for w in m["content"].split()] + [3]
        return ids + [4]

    reqs = B.WorkloadSpec(tenants=3, requests=12, system_len=20, question_len=5, output_len=7, seed=3).generate()
    prefix, totals = B.workload_token_counts(reqs, encode)
    assert set(prefix) == {r.tenant for r in reqs}
    # <s>, the system turn (2 + 20 words + 1), the user turn's 2 header tokens.
    assert all(n == 1 + 23 + 2 for n in prefix.values())
    assert totals == [(r.tenant, len(encode(r.body["messages"])) + 7) for r in reqs]


def test_oracle_hit_rate_counts_every_repeat_of_a_tenant_prefix():
    # a: 40-token prefix (2 blocks of 16), b: 20 tokens (1 block); prompts of 50 tokens.
    rate = B.oracle_hit_rate(["a", "b", "a", "a", "b", "c"], [50] * 6, {"a": 40, "b": 20, "c": 60}, 16)
    assert rate == pytest.approx((32 + 32 + 16) / 300)
    assert B.oracle_hit_rate(["a", "b"], [10, 10], {"a": 64, "b": 64}, 16) == 0.0


# --------------------------------------------------------------------------- load per replica


def _rec(i, replica, sent, end, *, first=None, ok=True, prompt=None, cached=None):
    return RequestRecord(
        index=i,
        ok=ok,
        status=200 if ok else 503,
        replica=replica,
        sent_s=sent,
        first_token_s=first,
        ended_s=end,
        prompt_tokens=prompt,
        cached_tokens=cached,
        error=None if ok else "HTTP 503",
    )


def test_in_flight_worked_example():
    recs = [
        _rec(0, "a", 0.0, 4.0),
        _rec(1, "a", 1.0, 2.0),
        _rec(2, "a", 2.0, 3.0),
        _rec(3, "b", 3.0, 8.0),
        _rec(4, None, 0.0, 0.5, ok=False),
    ]
    got = in_flight_by_replica(recs)
    assert got["a"].peak == 2  # [1,2) and [2,3) touch but never overlap
    assert got["a"].mean == pytest.approx(6.0 / 8.0)
    assert got["b"].peak == 1 and got["b"].mean == pytest.approx(5.0 / 8.0)
    assert got["a"].requests == 3 and set(got) == {"a", "b"}


@pytest.mark.parametrize("seed", range(3))
def test_in_flight_matches_a_brute_force_count(seed):
    rng = random.Random(100 + seed)
    recs = []
    for i in range(60):
        sent = rng.uniform(0, 20)
        recs.append(_rec(i, rng.choice("xyz"), sent, sent + rng.uniform(0.01, 5)))
    window = max(r.ended_s for r in recs) - min(r.sent_s for r in recs)
    got = in_flight_by_replica(recs)
    for name, load in got.items():
        mine = [r for r in recs if r.replica == name]
        peak = max(sum(1 for r in mine if r.sent_s <= t < r.ended_s) for t in (r.sent_s for r in mine))
        assert load.peak == peak
        assert load.mean == pytest.approx(sum(r.e2e_s for r in mine) / window)


# --------------------------------------------------------------------------- statistics


def _result(policy, hit, ttft, rng):
    recs = [
        _rec(
            i,
            f"r{i % 2}",
            i * 0.5,
            i * 0.5 + 2.0,
            first=i * 0.5 + ttft + rng.uniform(-0.01, 0.01),
            prompt=100,
            cached=int(100 * hit),
        )
        for i in range(20)
    ]
    counters = {
        "r0": {QUERIES: 1000.0, HITS: 1000.0 * hit},
        "r1": {QUERIES: 1000.0, HITS: 1000.0 * hit},
        "r2": {QUERIES: 0.0, HITS: 0.0},
    }
    return B.summarize(policy, recs, counters)


def test_summarize_counts_hits_load_and_latency():
    rng = random.Random(5)
    recs = [
        _rec(0, "r0", 0.0, 2.0, first=0.5, prompt=200, cached=160),
        _rec(1, "r0", 0.0, 1.0, first=0.25, prompt=200, cached=0),
        _rec(2, "r1", 1.0, 4.0, first=2.0, prompt=100, cached=80),
        _rec(3, None, 0.5, 0.6, ok=False),
    ]
    counters = {
        "r0": {QUERIES: 400.0, HITS: 160.0, PREEMPTIONS: 2.0},
        "r1": {QUERIES: 100.0, HITS: 80.0},
        "idle": {QUERIES: 0.0, HITS: 0.0},
    }
    r = B.summarize("p", recs, counters)
    assert (r.requests, r.succeeded) == (4, 3)
    assert r.hit_rate == pytest.approx(240 / 500)
    assert r.cached_token_ratio == pytest.approx(240 / 500)
    assert r.ttft_p50_s == pytest.approx(0.5)
    assert r.duration_s == pytest.approx(4.0) and r.requests_per_s == pytest.approx(3 / 4.0)
    # Time-averaged in-flight: r0 3s/4s, r1 3s/4s, idle 0: the idle replica pulls the mean down.
    assert r.load_max == pytest.approx(0.75) and r.load_mean == pytest.approx(0.5)
    assert r.load_imbalance == pytest.approx(1.5)
    assert r.peak_in_flight == 2 and r.preemptions == 2
    assert r.replicas["idle"]["requests"] == 0 and r.replicas["idle"]["hit_rate"] is None
    assert r.errors == ["request 3: HTTP 503"]
    assert _result("q", 0.0, 1.0, rng).hit_rate == 0.0


def test_ratios_of_the_baseline_against_each_policy():
    rng = random.Random(8)
    results = [
        _result("round_robin", 0.3, 1.2, rng),
        _result("consistent_hash", 0.0, 0.6, rng),
        _result("placed", 0.6, 0.6, rng),
    ]
    table = B.ratios(results)
    assert set(table) == {"round_robin", "consistent_hash"}
    assert table["round_robin"]["hit_rate_ratio"] == pytest.approx(2.0)
    assert table["round_robin"]["ttft_p50_ratio"] == pytest.approx(0.5, rel=0.05)
    assert table["consistent_hash"]["hit_rate_ratio"] is None  # a zero hit rate has no ratio
    assert B.ratios(results[:2]) == {}


def test_tables_and_plot(tmp_path):
    rng = random.Random(9)
    results = [_result("round_robin", 0.25, 1.5, rng), _result("placed", 0.7, 0.5, rng)]
    table = B.render_table(results)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| round_robin | 0.250 |")
    assert "| 10 / 10 / 0 | - | 20/20 |" in lines[3]
    ratios = B.render_ratios(B.ratios(results))
    assert "| round_robin | 2.80x |" in ratios
    png = tmp_path / "x" / "bench.png"
    B.plot(results, png, "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_app_args_are_valid_router_app_args_for_every_policy():
    from prefixserve.router.cluster_config import AppArgs

    sizing = B.size_kv({"a": 64, "b": 64}, [("a", 80)], block_size=16, replicas=2, concurrency=2, headroom=1.5)
    for policy in B.KNOWN_POLICIES:
        args = B.app_args(policy, model="smollm2", replicas=2, sizing=sizing, seed=1, epsilon=0.5)
        parsed = AppArgs.from_dict(args)
        assert parsed.engine["num_kv_blocks"] == sizing.num_kv_blocks
        assert parsed.num_replicas == 2
        if policy == B.RAY_PREFIX:
            assert parsed.router.router_class == "ray_llm_prefix_aware"
        elif policy in B.PEER_POLICIES:  # loadtest/peers/serve_adapter.py, configured like the engine
            assert parsed.router.router_class.endswith("serve_adapter:PeerRouter")
            assert parsed.router.kwargs == {
                "peer": policy,
                "seed": 1,
                "model": "smollm2",
                "block_size": 16,
                "hash_algo": "sha256",
                "num_gpu_blocks": sizing.num_kv_blocks,
            }
        else:
            assert parsed.router.policy == policy
    with pytest.raises(ValueError, match="unknown policy"):
        B.router_args("nope", seed=0, epsilon=None)
    turns = AppArgs.from_dict(
        B.app_args("placed", model="smollm2", replicas=2, sizing=sizing, seed=1, epsilon=None, session_affinity="turns")
    )
    assert turns.ingress.config.key_turns == 1 and not turns.ingress.config.session_header
    # --placed-option reaches placed alone, None values included (they switch a mechanism off).
    for policy in ("placed", "bounded_load"):
        routed = AppArgs.from_dict(
            B.app_args(
                policy,
                model="smollm2",
                replicas=2,
                sizing=sizing,
                seed=1,
                epsilon=None,
                placed_options={"move_epsilon": None},
            )
        )
        assert routed.router.policy_options == ({"move_epsilon": None} if policy == "placed" else {})


def test_multi_turn_workload_and_session_headers():
    spec = B.WorkloadSpec("multi_turn", tenants=3, requests=9, system_len=20, question_len=4, output_len=2)
    requests = spec.generate()
    assert len(requests) == 9 and len({r.tenant for r in requests}) == 3
    systems = {r.body["messages"][0]["content"] for r in requests}
    assert len(systems) == 1  # one shared system prompt: the plain key puts every user on one key
    assert max(len(r.body["messages"]) for r in requests) == 1 + 2 * 3 - 1
    assert B.session_headers(requests, "none") is None
    assert B.session_headers(requests, "header")[0] == {"X-Session-Id": requests[0].tenant}


def test_agent_workload_shares_one_tool_prefix_across_users():
    spec = B.WorkloadSpec("agent", tenants=3, requests=9, system_len=20, question_len=4, output_len=2)
    requests = spec.generate()
    assert len(requests) == 9 and len({r.tenant for r in requests}) == 3
    assert len({r.body["messages"][0]["content"] for r in requests}) == 1
    assert max(len(r.body["messages"]) for r in requests) == 1 + 1 + 2 * 2


def test_cli_refuses_a_bad_placed_option():
    for bad in ("move_epsilon", "move_epsilon=-1", "no_such_option=1", "move_epsilon=abc"):
        args = B.build_parser().parse_args(["--workload", "agent", "--placed-option", bad])
        with pytest.raises(ValueError):
            B.plan(args)


def test_cli_refuses_unknown_policies():
    with pytest.raises(SystemExit):
        B.main(["--policies", "round_robin,nope", "--out-dir", "/nonexistent"])


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_benchmark_end_to_end_on_a_local_cluster(tmp_path):
    from model_helpers import tiny_checkpoint
    from server_helpers import free_port

    model = tiny_checkpoint(tmp_path / "tiny", seed=4)
    out = tmp_path / "out"
    small = "--tenants 4 --requests 12 --system-len 48 --question-len 8 --output-len 4 --concurrency 2 --seed 4"
    where = ["--port", str(free_port()), "--out-dir", str(out), "--timeout", "300"]
    code = B.main(["--model", str(model), "--policies", "round_robin,placed", *small.split(), *where])
    assert code == 0
    data = json.loads((out / "bench_cluster.json").read_text())
    assert data["failures"] == {}
    assert [r["policy"] for r in data["results"]] == ["round_robin", "placed"]
    sizing = data["kv_sizing"]
    assert sizing["replica_fraction"] < 1.0 <= sizing["cluster_fraction"]
    assert 0.0 < data["oracle_hit_rate"] < 1.0
    for r in data["results"]:
        assert r["succeeded"] == r["requests"] == 12
        assert 0.0 <= r["hit_rate"] <= 1.0
        if r["preemptions"] == 0:  # a recomputed request looks its prompt up again
            assert r["hit_rate"] <= data["oracle_hit_rate"] + 0.02
        # The replicas' counters and the responses' usage agree on what was cached.
        assert r["cached_token_ratio"] == pytest.approx(r["hit_rate"], abs=0.02)
        assert len(r["replicas"]) == 2 and sum(v["requests"] for v in r["replicas"].values()) == 12
        assert r["ttft_p50_s"] > 0 and r["ttft_p95_s"] >= r["ttft_p50_s"]
        assert 0 < r["load_mean"] <= r["load_max"] <= r["peak_in_flight"] <= 2
    spills = {r["policy"]: r["spills"] for r in data["results"]}
    assert spills["round_robin"] is None and 0 <= spills["placed"] <= 12
    assert set(data["ratios"]) == {"round_robin"}
    assert (out / "bench_cluster.png").stat().st_size > 0
