"""Cluster simulator: accounting on small runs, the oracle bound, and SGLang's approximate tree."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace

import pytest

from prefixserve.loadtest import simulate as S
from prefixserve.loadtest.peers.sglang import ApproxTree, SGLangCacheAware, SGLangConfig
from prefixserve.router.policies import Replica

SMALL = S.SimConfig(
    num_replicas=4,
    num_tenants=40,
    num_requests=600,
    system_prompt_len=64,
    question_len=16,
    output_len=16,
    blocks_per_replica=64,
    max_num_seqs=8,
    utilization=0.7,
    seed=7,
)


@pytest.fixture(scope="module")
def traffic():
    return S.make_traffic(SMALL)


@pytest.mark.parametrize("policy", S.POLICY_NAMES)
def test_accounting_balances(policy, traffic) -> None:
    r = S.simulate(SMALL, policy, traffic, check_invariants=True)
    assert r.finished == r.num_requests == SMALL.num_requests
    assert r.prompt_tokens == SMALL.num_requests * SMALL.prompt_len
    assert r.hit_tokens + r.miss_tokens == r.prompt_tokens
    # the KV managers' own counters agree with the simulator's
    assert (r.kv_query_tokens, r.kv_hit_tokens) == (r.prompt_tokens, r.hit_tokens)
    assert r.oracle_violations == 0 and r.hit_tokens <= sum(traffic.oracle_hits)
    assert 0 <= r.hit_rate <= r.oracle_hit_rate <= 1
    assert r.leaked_blocks == 0
    # every token short of the oracle has one cause
    assert r.first_touch_miss_tokens + r.evicted_miss_tokens == sum(traffic.oracle_hits) - r.hit_tokens
    assert r.ttft_p50 > 0 and r.ttft_p99 >= r.ttft_p50
    assert r.load_max_over_mean >= 1.0


def test_one_replica_with_room_for_everything_equals_the_oracle(traffic) -> None:
    blocks = SMALL.num_requests * -(-(SMALL.prompt_len + SMALL.output_len) // SMALL.block_size)
    cfg = replace(SMALL, num_replicas=1, blocks_per_replica=blocks, max_num_seqs=10_000)
    r = S.simulate(cfg, "round_robin", traffic)
    assert r.hit_tokens == sum(traffic.oracle_hits)
    assert r.first_touch_miss_tokens == r.evicted_miss_tokens == 0
    assert r.of_oracle == pytest.approx(1.0)


def test_affinity_beats_spraying_when_the_working_set_exceeds_one_replica(traffic) -> None:
    # 40 tenants x 4 system blocks = 160 blocks of system prompts, 64 blocks per replica
    rr = S.simulate(SMALL, "round_robin", traffic)
    ch = S.simulate(SMALL, "consistent_hash", traffic)
    bl = S.simulate(SMALL, "bounded_load", traffic)
    assert ch.hit_rate > rr.hit_rate * 1.3
    assert bl.hit_rate > rr.hit_rate
    assert bl.load_max_over_mean <= ch.load_max_over_mean
    assert rr.load_max_over_mean == pytest.approx(1.0, abs=0.01)


def test_deterministic_for_a_seed(traffic) -> None:
    a = asdict(S.simulate(SMALL, "power_of_two", traffic))
    b = asdict(S.simulate(SMALL, "power_of_two", S.make_traffic(SMALL)))
    a.pop("wall_seconds"), b.pop("wall_seconds")
    assert a == b
    other = S.make_traffic(replace(SMALL, seed=8))
    assert other.tenants != traffic.tenants


ADAPTERS = replace(
    SMALL, num_tenants=16, num_adapters=16, max_loras=4, num_requests=1500, blocks_per_replica=96, seed=0
)


@pytest.mark.parametrize("policy", ["round_robin", "placed", "llmd", "llmd_lora"])
def test_adapters_are_loaded_and_dropped_as_the_engine_does(policy) -> None:
    r = S.simulate(ADAPTERS, policy, check_invariants=True)
    assert r.finished == ADAPTERS.num_requests and r.leaked_blocks == 0
    # Every adapter is loaded at least once; never more than once a request.
    assert ADAPTERS.num_adapters <= r.adapter_loads <= ADAPTERS.num_requests
    assert r.adapter_loads_per_1000 == pytest.approx(1000 * r.adapter_loads / r.finished)


def test_placed_keeps_adapters_where_they_are_held() -> None:
    traffic = S.make_traffic(ADAPTERS)
    loads = {p: S.simulate(ADAPTERS, p, traffic) for p in ("round_robin", "placed", "llmd_lora")}
    placed = loads["placed"]
    assert placed.adapter_loads <= 0.5 * loads["round_robin"].adapter_loads
    assert placed.adapter_loads <= loads["llmd_lora"].adapter_loads
    assert placed.hit_rate >= max(loads["round_robin"].hit_rate, loads["llmd_lora"].hit_rate) - 0.005


def test_without_adapters_nothing_is_loaded(traffic) -> None:
    assert S.simulate(SMALL, "placed", traffic).adapter_loads == 0
    with pytest.raises(ValueError, match="tenants workload"):
        replace(SMALL, num_adapters=4, workload="multi_turn")


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise blocks_per_replica"):
        S.SimConfig(blocks_per_replica=4)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        S.SimConfig(num_replicas=0)


def test_cli_writes_table_json_and_png(tmp_path, capsys) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = S.main(
        [
            "--replicas",
            "4",
            "--tenants",
            "30",
            "--requests",
            "300",
            "--system-len",
            "32",
            "--question-len",
            "8",
            "--output-len",
            "8",
            "--blocks-per-replica",
            "48",
            "--sweep-replicas",
            "2,4",
            "--sweep-epsilons",
            "0.1,1",
            "--sweep-requests",
            "200",
            "--out",
            str(out),
            "--png",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "| policy | R | hit rate |" in text and "sglang_tree" in text
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["main"]] == list(S.POLICY_NAMES)
    assert len(data["sweep_replicas"]) == 2 * len(S.POLICY_NAMES) and len(data["sweep_epsilon"]) == 2
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the approximate tree


def test_tree_match_insert_and_evict_keep_invariants() -> None:
    rng = random.Random(5)
    tree = ApproxTree()
    stems = [tuple(rng.randrange(6) for _ in range(rng.randint(1, 6))) for _ in range(8)]
    inserted: dict[str, set[tuple]] = {}
    for step in range(400):
        seq = rng.choice(stems) + tuple(rng.randrange(6) for _ in range(rng.randint(0, 5)))
        rep = f"r{rng.randrange(3)}"
        tree.insert(seq, rep, float(step))
        inserted.setdefault(rep, set()).add(seq)
        if step % 50 == 49:
            for r in list(tree.sizes):
                tree.evict(r, 20)
                assert tree.sizes[r] <= 20
            inserted = {}  # after eviction only the bound is known
        tree.check_invariants()
        matched, holder = tree.match(seq)
        assert matched == len(seq) and holder == rep  # just inserted: whole match, most recent holder


def test_tree_longest_match_is_exact() -> None:
    tree = ApproxTree()
    tree.insert((1, 2, 3, 4, 5), "a", 0.0)
    tree.insert((1, 2, 3, 9), "b", 1.0)
    assert tree.match((1, 2, 3, 4, 7)) == (4, "a")
    assert tree.match((1, 2, 3, 8)) == (3, "b")  # both hold (1,2,3); b used it last
    assert tree.match((7, 7)) == (0, None)
    assert tree.sizes == {"a": 5, "b": 4}
    tree.check_invariants()


def test_sglang_policy_branches() -> None:
    pol = SGLangCacheAware(SGLangConfig(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5))
    reps = [Replica("a:1", 0), Replica("b:1", 0), Replica("c:1", 0)]
    first = pol.choose(reps, (1, 2, 3, 4), 0.0).chosen  # empty tree: smallest tree (ties by load, name)
    assert first.name == "a:1"
    assert pol.choose(reps, (1, 2, 3, 5), 1.0).chosen.name == "a:1"  # 3/4 matched > 0.5: affinity
    assert pol.choose(reps, (9, 9, 9, 9), 2.0).chosen.name == "b:1"  # no match: smallest tree
    loaded = [Replica("a:1", 9), Replica("b:1", 3), Replica("c:1", 1)]
    assert pol.choose(loaded, (1, 2, 3, 4), 3.0).chosen.name == "c:1"  # imbalanced: least loaded
    mild = [Replica("a:1", 4), Replica("b:1", 3), Replica("c:1", 1)]
    # balanced again: affinity to the replica that got this prefix last (c, by the imbalanced branch)
    assert pol.choose(mild, (1, 2, 3, 4), 4.0).chosen.name == "c:1"


def test_cpu_profile_from_the_engine_benchmark(tmp_path) -> None:
    from prefixserve.loadtest.cost_model import CPU_DEFAULT, cpu_profile

    assert cpu_profile(tmp_path / "missing.json") == CPU_DEFAULT
    bench = {
        "rows": [
            {"engine": "prefixserve, caching on", "ttft_alone_hit_s": 0.07},
            {"engine": "prefixserve, caching off", "ttft_alone_miss_s": 0.6},
        ],
        "decode_tokens_per_s": {"1": 40.0, "8": 200.0, "32": 400.0},
    }
    path = tmp_path / "bench_engine.json"
    path.write_text(json.dumps(bench))
    prof = cpu_profile(path)
    assert prof.prefill_s_per_token == pytest.approx(0.53 / 529)
    assert prof.decode_step(1) == pytest.approx(1 / 40) and prof.decode_step(32) == pytest.approx(32 / 400)
    assert prof.prefill_s(16) == pytest.approx(0.07)
    path.write_text(json.dumps({"rows": []}))
    assert cpu_profile(path) == CPU_DEFAULT


def test_gpu_profiles_reproduce_the_measurements_they_cite() -> None:
    """Each GPU profile's figures give back the published measurements loadtest/cost_model.py cites."""
    from prefixserve.loadtest.cost_model import PROFILE_NAMES, get_profile

    tp4 = get_profile("h100-70b-tp4")
    # vLLM 0.6.0, 4 x H100, ShareGPT: TPOT 23.58 ms with 4 x 2.9156 s in flight, 29.15 ms with 8 x 3.7524 s.
    assert tp4.decode_step(4 * 2.9156) == pytest.approx(0.02358, abs=1e-4)
    assert tp4.decode_step(8 * 3.75238) == pytest.approx(0.02915, abs=1e-4)
    assert tp4.prefill_s(200) == pytest.approx(0.054, abs=1e-3)  # SGLang's median TTFT, same replica
    small = get_profile("h100-8b")
    assert small.decode_step(10) == pytest.approx(0.0072, abs=1e-5)  # 72 ms per 10-step chunk
    assert small.prefill_s(1369) == pytest.approx(0.062, abs=1e-3)  # 10 prompts arriving together
    seed = get_profile("seed-article")
    assert seed.prefill_s(512 + 100) - seed.prefill_s(100) == pytest.approx(0.64)  # 820 - 180 ms
    assert seed.decode_step(256) == pytest.approx(0.0278)
    # The seed article's loaded prefill is an order of magnitude slower than the idle 4 x H100 replica.
    assert seed.prefill_s_per_token / tp4.prefill_s_per_token > 10
    assert {get_profile(n).name for n in PROFILE_NAMES} == set(PROFILE_NAMES)
    with pytest.raises(ValueError, match="h100-70b-tp4"):
        get_profile("h100")


def test_kv_tiers_serve_evicted_prefixes_and_their_copies_cost_less_than_prefill(traffic) -> None:
    off = S.simulate(SMALL, "round_robin", traffic, check_invariants=True)
    host_cfg = replace(SMALL, host_blocks_per_replica=256)
    host = S.simulate(host_cfg, "round_robin", traffic, check_invariants=True)
    disk = S.simulate(replace(host_cfg, shared_disk=True), "round_robin", traffic, check_invariants=True)
    for r in (host, disk):
        assert r.oracle_violations == 0 and r.leaked_blocks == 0
        assert r.hit_tokens + r.miss_tokens == r.prompt_tokens
        assert r.kv_hit_tokens + r.host_hit_tokens == r.hit_tokens  # device hits + tier hits
    assert off.host_hit_tokens == 0 and host.disk_hit_tokens == 0
    # Round robin sprays a tenant over every replica: the host tier keeps what each evicted,
    # and the shared disk gives each replica what another computed.
    assert host.host_hit_tokens > 0 and host.hit_rate > off.hit_rate
    assert disk.disk_hit_tokens > 0 and disk.hit_rate > host.hit_rate
    assert host.ttft_mean < off.ttft_mean
    profile = S.get_profile(SMALL.profile)
    assert profile.tier_load_s(16, 0) < profile.prefill_s(16) - profile.prefill_overhead_s
    with pytest.raises(ValueError, match="shared_disk needs the host tier"):
        replace(SMALL, shared_disk=True)
