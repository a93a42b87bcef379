"""Router benchmark: the replay bound, router specs and command lines, the tables; one real run.

The real run (slow) puts prefixserve's standalone router and nginx in front of two real
replicas of a tiny checkpoint, and runs prefixserve's Ray cluster with the same engine settings;
the PyPI peers are left to the benchmark itself.
"""

from __future__ import annotations

import json

import pytest

from prefixserve.loadtest import bench_routers as B
from prefixserve.loadtest.harness.client import RequestRecord
from prefixserve.loadtest.peer_routers import PeerRouterVenv, smg_command, vllm_router_command
from prefixserve.loadtest.prefix_bound import distinct_blocks, replay_bound, replay_hits
from prefixserve.loadtest.router_stand import EventFeed, RouterSpec, find_nginx
from prefixserve.loadtest.vllm_stand import VLLMSettings, server_command
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, prefix_hash

# --------------------------------------------------------------------------- the bound


def test_replay_hits_count_leading_whole_blocks_seen_before():
    a = list(range(10))
    prompts = [
        a,  # nothing seen yet
        a[:8] + [99, 98],  # the first two blocks of 4 are a's
        a[:4] + [7, 7, 7, 7, 7],  # one block, then a block nobody sent
        list(range(8)),  # two blocks seen, but the last token is always computed: one block
        [5] + a[1:],  # differs in the first token: nothing
    ]
    assert replay_hits(prompts, 4) == [0, 8, 4, 4, 0]
    assert replay_bound(prompts, 4) == pytest.approx(16 / sum(map(len, prompts)))


def test_replay_hits_need_the_same_blocks_before_them():
    # The second block of the later prompt equals one sent before, but after another first block.
    assert replay_hits([[1, 1, 2, 2, 0], [3, 3, 2, 2, 0]], 2) == [0, 0]
    assert replay_bound([], 16) == 0.0
    with pytest.raises(ValueError):
        replay_hits([[1]], 0)


def test_distinct_blocks_count_each_whole_block_once_by_what_precedes_it():
    assert distinct_blocks([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [3, 4, 1, 2]], 2) == 2 + 0 + 2
    assert distinct_blocks([[1]], 2) == 0


def test_conversation_sizing_keeps_the_pool_formula_over_the_new_working_set():
    from prefixserve.loadtest.bench_cluster import size_kv

    sizing = size_kv(
        {"u0": 64, "u1": 64}, [("u0", 100), ("u1", 300)], block_size=16, replicas=2, concurrency=4, headroom=1.5
    )
    conv = B.conversation_sizing(sizing, 40)
    assert conv.working_set_blocks == 40 and conv.reserve_blocks == sizing.reserve_blocks
    assert conv.num_kv_blocks == 30 + sizing.reserve_blocks
    assert conv.replica_fraction < 1.0 <= conv.cluster_fraction


# --------------------------------------------------------------------------- routers


def test_router_specs_parse_and_refuse_unknown_policies():
    assert RouterSpec.parse("smg:cache_aware").name == "smg:cache_aware"
    assert RouterSpec.parse("nginx") == RouterSpec("nginx")
    assert RouterSpec.parse("nginx").sends_prefix_hash
    assert not RouterSpec.parse("prefixserve:placed").sends_prefix_hash
    for bad in ("smg", "smg:placed", "nginx:placed", "haproxy:round_robin", "vllm-router:prefix_hash"):
        with pytest.raises(ValueError):
            RouterSpec.parse(bad)


def test_peer_command_lines_name_the_workers_policy_and_ports(tmp_path):
    venv = PeerRouterVenv(tmp_path / "venv")
    assert not venv.installed()
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    smg = smg_command(venv, "prefix_hash", workers, "127.0.0.1", 10, 11)
    assert smg[:2] == [str(tmp_path / "venv" / "bin" / "smg"), "launch"]
    assert "--disable-tokenizer-autoload" in smg
    assert smg[smg.index("--worker-urls") + 1 : smg.index("--worker-urls") + 3] == workers
    assert smg[smg.index("--prometheus-port") + 1] == "11"
    vr = vllm_router_command(venv, "consistent_hash", workers, "127.0.0.1", 10, 12)
    assert vr[vr.index("--policy") + 1] == "consistent_hash" and vr[vr.index("--prometheus-port") + 1] == "12"
    with pytest.raises(ValueError):
        smg_command(venv, "consistent_hash", workers, "127.0.0.1", 10, 11)


def test_event_reading_routers_get_the_vllm_servers_sockets_and_hash_settings(tmp_path):
    venv = PeerRouterVenv(tmp_path / "venv")
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sources = tuple((w, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}") for w, p in zip(workers, (5, 7)))
    kv = vllm_router_command(venv, "kv_aware", workers, "127.0.0.1", 10, 12, sources, 32, "smollm2")
    assert kv.count("--kv-event-source") == 2 and "http://127.0.0.1:1=tcp://127.0.0.1:5" in kv
    assert "http://127.0.0.1:2=tcp://127.0.0.1:8" in kv  # its replay socket
    assert kv[kv.index("--kv-event-block-size") + 1] == "32" and kv[kv.index("--kv-event-model") + 1] == "smollm2"
    with pytest.raises(ValueError, match="event sources"):
        vllm_router_command(venv, "kv_aware", workers, "127.0.0.1", 10, 12)
    ours = EventFeed(sources, 32, "0", tmp_path / "tok", "smollm2").prefixserve_args()
    assert ours[ours.index("--kv-events-hash") + 1] == "vllm" and ours[ours.index("--kv-events-seed") + 1] == "0"
    assert "http://127.0.0.1:1=tcp://127.0.0.1:5,tcp://127.0.0.1:6" in ours


def test_vllm_servers_run_with_the_settings_a_router_must_match(tmp_path):
    command = server_command(VLLMSettings("py", tmp_path, num_kv_blocks=60, block_size=32), 9000, 9001, 9002)
    assert command[command.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert command[command.index("--num-gpu-blocks-override") + 1] == "61"  # and its null block
    assert "--enable-prompt-tokens-details" in command and "--enable-scale-out" in command
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:9001" and events["replay_endpoint"] == "tcp://*:9002"
    with pytest.raises(ValueError, match="multiple of 32"):
        VLLMSettings("py", tmp_path, num_kv_blocks=60, block_size=16)


def test_the_vllm_upstream_needs_its_python_and_kv_aware_needs_the_vllm_upstream():
    with pytest.raises(ValueError, match="--vllm-python"):
        B.plan(B.build_parser().parse_args(["--upstream", "vllm", "--block-size", "32"]))
    with pytest.raises(ValueError, match="kv_aware"):
        B.plan(B.build_parser().parse_args(["--routers", "vllm-router:kv_aware"]))
    with pytest.raises(ValueError, match="ray:POLICY"):
        B.plan(
            B.build_parser().parse_args(["--routers", "ray:placed", "--adapters", "2", "--workloads", "zipf_tenants"])
        )


def test_nginx_clients_send_the_routing_key_of_the_static_prefix():
    bodies = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "no system prompt"}]},
    ]
    assert B.prefix_hash_headers(bodies) == [{PREFIX_HASH_HEADER: prefix_hash("be brief")}, {}]


# --------------------------------------------------------------------------- tables


def _record(i: int, replica: str | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        index=i,
        ok=ok,
        status=200 if ok else 502,
        replica=replica,
        sent_s=float(i),
        first_token_s=i + 0.5 if ok else None,
        ended_s=i + 1.0,
        prompt_tokens=100,
        cached_tokens=50 if ok else None,
        error=None if ok else "HTTP 502: bad gateway | upstream",
    )


def test_workload_table_joins_seeds_and_names_failures():
    from prefixserve.loadtest.bench_cluster import summarize

    records = [_record(0, "a"), _record(1, "b"), _record(2, "a", ok=False)]
    ran = B.RouterRun("nginx", "agent", 0, 0.8, summarize("nginx", records, {}), split=[2, 1])
    failed = B.RouterRun("nginx", "agent", 1, 0.7, failure="RuntimeError: no answer")
    table = B.render_workload([failed, ran], ["nginx", "smg:round_robin"])
    lines = table.splitlines()
    assert len(lines) == 3  # header, rule, one router (the other did not run at all)
    row = lines[2]
    assert row.startswith("| nginx | 0.500 / n/a | 0.62 / n/a |")
    assert "2:1 / n/a" in row and "2/3 / n/a" in row
    assert "1 (request 2: HTTP 502: bad gateway \\| upstream) / did not run: RuntimeError: no answer" in row


def test_repeated_runs_show_the_median_run_and_list_every_run():
    from dataclasses import replace

    from prefixserve.loadtest.bench_cluster import summarize

    def run(seed: int, repeat: int, ttft: float | None, cached: int = 50) -> B.RouterRun:
        if ttft is None:
            return B.RouterRun("nginx", "agent", seed, 0.8, failure="RuntimeError: no answer", repeat=repeat)
        records = [replace(_record(i, "a"), first_token_s=i + ttft, cached_tokens=cached) for i in range(3)]
        return B.RouterRun("nginx", "agent", seed, 0.8, summarize("nginx", records, {}), split=[3, 0], repeat=repeat)

    runs = [run(0, 0, 0.3), run(0, 1, 0.1, cached=10), run(0, 2, 0.2, cached=20), run(1, 0, None), run(1, 1, 0.4)]
    table = B.render_workload(runs, ["nginx"])
    header, _, row = table.splitlines()
    assert header.endswith("| each run: TTFT p50 (s) @ hit rate |")
    # seed 0: the 0.2 s run (its hit rate 0.200 beside it); seed 1: of a failure and 0.4 s, the 0.4 s run
    assert row.startswith("| nginx | 0.200 / 0.500 | 0.25 / 0.62 | 0.200 / 0.400 |")
    assert row.endswith("| 0.300 @ 0.500, 0.100 @ 0.100, 0.200 @ 0.200 / failed, 0.400 @ 0.500 |")
    assert B.render_workload(runs[:1], ["nginx"]).splitlines()[0].endswith("| errors |")  # one run: no column


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
@pytest.mark.skipif(find_nginx() is None, reason="nginx is not installed (scripts/system-deps.sh)")
def test_standalone_router_nginx_and_the_ray_cluster_answer_and_route_every_request(tmp_path):
    from model_helpers import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "tiny", seed=5)
    out = tmp_path / "out"
    small = "--tenants 3 --requests 6 --system-len 48 --question-len 8 --output-len 4 --concurrency 2"
    routers = "prefixserve:placed,nginx,ray:placed"
    argv = ["--model", str(model), "--routers", routers, "--workloads", "agent", *small.split()]
    code = B.main([*argv, "--out-dir", str(out), "--timeout", "300"])
    data = json.loads((out / "bench_routers.json").read_text())
    runs = data["runs"]
    assert [(r["workload"], r["router"]) for r in runs] == [
        ("agent", "prefixserve:placed"),
        ("agent", "nginx"),
        ("agent", "ray:placed"),
    ]
    for r in runs:
        assert r["failure"] is None, r["failure"]
        assert r["result"]["succeeded"] == r["result"]["requests"] == 6, r["result"]["errors"]
        # Every answer named one of the two replicas: the split accounts for each request.
        assert len(r["split"]) == 2 and sum(r["split"]) == 6 and r["unattributed"] == 0
        assert all(rec["replica"] is not None for rec in r["records"])
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 < r["bound"] < 1.0
    assert code == 0


def test_saved_results_of_two_seeds_render_as_one_table(tmp_path):
    from prefixserve.loadtest.bench_cluster import size_kv, summarize

    sizing = size_kv({"t": 64}, [("t", 100)], block_size=16, replicas=2, concurrency=2, headroom=1.5)
    paths = []
    for seed in (1, 0):
        run = B.RouterRun("nginx", "zipf_tenants", seed, 0.8, summarize("nginx", [_record(0, "a")], {}), split=[1, 0])
        case = {"workload": {"name": "zipf_tenants", "seed": seed}, "bound": 0.8, "kv_sizing": sizing.to_json()}
        data = {"config": {"routers": "nginx"}, "cases": [case], "runs": [run.to_json()]}
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps(data))
    text = B.render_saved(paths)
    assert text.startswith("### zipf_tenants (seeds 0 / 1)")
    assert "| nginx | 0.500 / 0.500 |" in text and "1:0 / 1:0" in text


def _timed_run(router: str, seed: int, ttft: float, repeat: int) -> B.RouterRun:
    from dataclasses import replace

    from prefixserve.loadtest.bench_cluster import summarize

    records = [replace(_record(i, "a"), first_token_s=i + ttft) for i in range(3)]
    return B.RouterRun(router, "agent", seed, 0.8, summarize(router, records, {}), split=[3, 0], repeat=repeat)


def test_prefixserve_is_compared_with_each_peer_where_both_ran_twice():
    ours, rr, ca = "prefixserve:placed", "smg:round_robin", "smg:cache_aware"
    runs = [_timed_run(ours, 0, t, i) for i, t in enumerate([0.30, 0.32, 0.31])]
    runs += [_timed_run(rr, 0, t, i) for i, t in enumerate([0.50, 0.52, 0.51])]
    runs += [_timed_run(ca, 0, 0.1, 0)]  # one run: nothing to compare
    runs += [_timed_run(ours, 1, t, i) for i, t in enumerate([0.40, 0.42])]
    runs += [_timed_run(rr, 1, t, i) for i, t in enumerate([0.41, 0.39])]
    lines = B.render_comparison(runs, [ours, rr, ca]).splitlines()
    assert len(lines) == 4  # header, rule, seed 0 and seed 1 against round robin
    assert lines[2].startswith(f"| agent s0 | {ours} | {rr} | 3 / 3 | 0.310 / 0.510 | -0.200 |")
    assert lines[2].endswith("| 1.00 |")  # every run of ours the faster
    assert lines[3].startswith(f"| agent s1 | {ours} | {rr} | 2 / 2 | 0.410 / 0.400 | +0.010 |")
    assert B.render_comparison(runs, [rr, ca]) == ""  # no router of ours
    assert "prefixserve against each peer" in B.render(runs, [ours, rr, ca], [_case(0), _case(1)])


def _case(seed: int) -> dict:
    from prefixserve.loadtest.bench_cluster import size_kv

    sizing = size_kv({"t": 64}, [("t", 100)], block_size=16, replicas=2, concurrency=2, headroom=1.5)
    return {"workload": {"name": "agent", "seed": seed}, "bound": 0.8, "kv_sizing": sizing.to_json()}


def test_a_case_run_again_in_another_file_is_listed_once_with_its_runs_pooled(tmp_path):
    paths = []
    for i, ttft in enumerate((0.2, 0.4)):
        run = _timed_run("nginx", 0, ttft, 0)
        data = {"config": {"routers": "nginx"}, "cases": [_case(0)], "runs": [run.to_json()]}
        paths.append(tmp_path / f"again{i}.json")
        paths[-1].write_text(json.dumps(data))
    text = B.render_saved(paths)
    assert text.startswith("### agent (seeds 0)\n")
    assert "0.200 @ 0.500, 0.400 @ 0.500" in text


def test_vllm_servers_get_ports_no_other_server_of_the_stand_has():
    from prefixserve.loadtest.vllm_stand import _ports

    taken: set[int] = set()
    first, second = _ports(3, taken), _ports(3, taken)
    assert len(set(first) | set(second)) == 6 and taken == set(first) | set(second)
