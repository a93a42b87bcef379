"""Cluster benchmark: the same seeded workload under each routing policy, side by side.

``python -m prefixserve.loadtest.bench_cluster`` brings up a local Ray cluster (Serve's
proxy, the OpenAI ingress, R engine replicas on CPU) and, for each policy in
turn, deploys the app afresh (new replicas: cold KV caches), streams the
workload through it with a closed-loop client, and deletes it. Policies:
prefixserve's ``round_robin``, ``power_of_two`` (Ray Serve's default
behaviour), ``consistent_hash``, ``bounded_load`` and ``placed`` (the default;
router/policies/, run by router/serve/request_router.py), ``ray_prefix``: Ray Serve LLM's own
``PrefixCacheAffinityRouter`` plugged into our engine deployment as its
request router, and the peer models of loadtest/peers run as the request
router by loadtest/peers/serve_adapter.py (prompt tokens, block hashes,
reported loads, KV events): ``sglang_tree`` (SGLang's cache_aware), ``llmd``
(llm-d's weighted scorers) and ``dynamo`` (Dynamo's KV cost). ``--url``
instead measures a running endpoint once (its requests salted so that earlier
traffic cannot count as hits).

Per policy it reports the cluster's prefix-cache hit rate (the replicas'
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
counters, read from the ingress's /metrics before and after), TTFT p50/p95
measured by the client on the stream, requests/s, and the load per replica
(in-flight requests over time, from the ``X-Prefixserve-Replica`` header of
each response: the max and the mean over replicas of their time-averaged
in-flight count, and the peak). Then ratios of the baseline (placed)
against every other policy: a markdown table, results/bench_cluster.json and
results/bench_cluster.png (hit-rate bars and a TTFT p50 line per policy).

KV pools are sized from the workload so that routing matters: the working set
(every tenant's system-prompt blocks) exceeds one replica's pool but fits the
cluster's: ``num_kv_blocks = ceil(headroom * W / R) + reserve`` with
``1 <= headroom < R`` (see :func:`size_kv`). The output states the sizing.

``--workload multi_turn`` sends users who share one system prompt, each
resending its growing conversation; ``--workload agent`` users of one agent app
(a system prompt and tool definitions four times as long), each step adding a
tool call and its result; ``--session-affinity header|turns``
measures the opt-in multi-turn keys of router/routing_key.py.

Default run (SmolLM2-135M, 2 replicas, 5 policies): zipf_tenants with 16
tenants (Zipf s=0.6, tenant-0 hot with 10% of the traffic on top), 48
requests, 160-token system prompts, 16-token questions, 8 output tokens,
concurrency 4: under 9 minutes on 2 shared CPU cores, half of it deploying
replicas (each loads the GGUF anew). ``--model`` pointing at a tiny random
checkpoint makes it quick (about 25 s per policy).

Caveat: Serve names replicas randomly, so each deployment places the tenants
on the ring differently; the per-replica request split in the table shows it.

Seeded: the same seed gives the same requests in the same order for every policy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from prefixserve.common.logs import add_verbose_flag
from prefixserve.loadtest.cluster_run import (
    HITS,
    PREEMPTIONS,
    QUERIES,
    LocalServeCluster,
    counter_deltas,
    in_flight_by_replica,
    replica_counters,
    scrape_metrics,
    served_model,
)
from prefixserve.loadtest.harness.cli import plan_and_run
from prefixserve.loadtest.harness.client import RequestRecord, run_load
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.stats import percentile, ratio
from prefixserve.loadtest.simulate import add_placed_option_flag, parse_placed_options
from prefixserve.loadtest.workloads import WorkloadRequest, generate
from prefixserve.router.policies import POLICIES, RING_POLICIES, make_policy, pick_options
from prefixserve.router.serve.metrics import sum_samples

RAY_PREFIX = "ray_prefix"
# Peer models (loadtest/peers) run by loadtest/peers/serve_adapter.py's PeerRouter.
PEER_POLICIES = ("sglang_tree", "llmd", "dynamo")
DEFAULT_POLICIES = ("round_robin", "power_of_two", RAY_PREFIX, "consistent_hash", "placed")
KNOWN_POLICIES = tuple(sorted(POLICIES)) + (RAY_PREFIX,) + PEER_POLICIES
BASELINE = "placed"
WORKLOADS = ("zipf_tenants", "shared_prefix", "multi_turn", "agent")
CONVERSATIONS = ("multi_turn", "agent")
# Multi-turn affinity (router/routing_key.py): none, X-Session-Id (the client sends the user's id), or key_turns=1.
SESSION_AFFINITY = ("none", "header", "turns")
SPILLS = "prefixserve_router_spills_total"
ROUTED = "prefixserve_router_requests_total"


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class WorkloadSpec:
    """The benchmark's workload knobs (mapped onto loadtest/workloads.py's configs)."""

    name: str = "zipf_tenants"
    tenants: int = 16
    requests: int = 48
    system_len: int = 160
    question_len: int = 16
    output_len: int = 8
    zipf_s: float = 0.6
    hot_share: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.tenants < 1 or self.requests < 1:
            raise ValueError("--tenants and --requests must be >= 1")
        if self.name in ("shared_prefix", *CONVERSATIONS) and self.requests < self.tenants:
            raise ValueError(
                f"{self.name} sends requests // tenants prompts per tenant (user): give at least "
                f"{self.tenants} requests or fewer tenants"
            )

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, workload: str | None = None, seed: int | None = None
    ) -> WorkloadSpec:
        """The spec the workload flags ask for (``--workload``, ``--tenants`` ... ``--seed``); ``workload`` and
        ``seed`` stand in for those two flags where a benchmark sweeps several."""
        return cls(
            workload if workload is not None else args.workload,
            args.tenants,
            args.requests,
            args.system_len,
            args.question_len,
            args.output_len,
            args.zipf_s,
            args.hot_share,
            seed if seed is not None else args.seed,
        )

    def generate(self) -> list[WorkloadRequest]:
        """The requests, from loadtest/workloads.py's generator of this workload."""
        per_tenant = self.requests // self.tenants
        if self.name == "multi_turn":
            # Users sharing one system prompt, each resending its growing conversation.
            params: dict[str, Any] = {
                "num_users": self.tenants,
                "num_rounds": per_tenant,
                "system_prompt_len": self.system_len,
                "user_turn_len": self.question_len,
                "assistant_turn_len": 2 * self.question_len,
                "shared_system_prompt": True,
            }
        elif self.name == "agent":
            # Users of one agent app (system prompt + tool definitions of 4x it), each step a tool result.
            params = {"num_users": self.tenants, "num_steps": per_tenant, "system_prompt_len": self.system_len}
            params.update(tools_len=4 * self.system_len, task_len=self.question_len)
            params.update(tool_call_len=self.question_len, tool_result_len=4 * self.question_len)
        elif self.name == "zipf_tenants":
            params = {"num_tenants": self.tenants, "num_requests": self.requests}
            params.update(zipf_s=self.zipf_s, hot_share=self.hot_share)
        else:
            params = {"num_groups": self.tenants, "prompts_per_group": per_tenant}
        if self.name not in CONVERSATIONS:
            params.update(system_prompt_len=self.system_len, question_len=self.question_len)
        return generate(self.name, {**params, "output_len": self.output_len, "seed": self.seed})


# --------------------------------------------------------------------------- KV sizing


@dataclass(frozen=True)
class KVSizing:
    """Per-replica KV pool for a workload, chosen so that the working set needs the whole cluster.

    working_set_blocks (W): full blocks of every tenant's static prefix, summed.
    private_blocks: the most blocks one request needs beyond its tenant's prefix.
    reserve_blocks: room for the private blocks of one replica's share of the
        in-flight requests, ``ceil(concurrency / replicas) * private_blocks``.
    num_kv_blocks: ``max(request_blocks, ceil(headroom * W / replicas) + reserve_blocks)``.
    """

    block_size: int
    replicas: int
    concurrency: int
    headroom: float
    tenants: int
    working_set_blocks: int
    request_blocks: int
    private_blocks: int
    reserve_blocks: int
    num_kv_blocks: int

    @property
    def prefix_room_blocks(self) -> int:
        """Blocks of one replica's pool left for cached prefixes when its in-flight share runs."""
        return self.num_kv_blocks - self.reserve_blocks

    @property
    def replica_fraction(self) -> float:
        """One replica's prefix room over the working set (< 1: one replica cannot hold it)."""
        return self.prefix_room_blocks / self.working_set_blocks

    @property
    def cluster_fraction(self) -> float:
        """The cluster's prefix room over the working set (>= 1: it fits when routed by prefix)."""
        return self.replicas * self.prefix_room_blocks / self.working_set_blocks

    def describe(self) -> str:
        return (
            f"KV sizing: working set W = {self.working_set_blocks} blocks ({self.tenants} tenants' system "
            f"prompts, block size {self.block_size}); num_kv_blocks = {self.num_kv_blocks} per replica "
            f"= ceil({self.headroom:g} x W / {self.replicas}) + {self.reserve_blocks} reserved for in-flight "
            f"requests; prefix room: one replica {self.replica_fraction:.0%} of W, the cluster "
            f"{self.cluster_fraction:.0%} of W"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "replica_fraction": self.replica_fraction, "cluster_fraction": self.cluster_fraction}


def size_kv(
    prefix_tokens: Mapping[str, int],
    requests: Sequence[tuple[str, int]],
    *,
    block_size: int,
    replicas: int,
    concurrency: int,
    headroom: float,
) -> KVSizing:
    """Size one replica's KV pool for a workload.

    ``prefix_tokens``: per tenant, the tokens its requests share (the chat
    template through its system prompt). ``requests``: (tenant, prompt tokens +
    max_tokens) of each request. ``1 <= headroom < replicas`` keeps the working
    set bigger than one replica's prefix room and within the cluster's.
    """
    if replicas < 2:
        raise ValueError("routing only matters with at least 2 replicas: set --replicas 2 or more")
    if not 1.0 <= headroom < replicas:
        raise ValueError(
            f"headroom must be in [1, replicas={replicas}) so that the working set fits the cluster "
            f"but not one replica; got {headroom}"
        )
    if block_size < 1 or concurrency < 1:
        raise ValueError("block_size and concurrency must be >= 1")
    if not requests:
        raise ValueError("the workload has no requests")
    missing = sorted({t for t, _ in requests} - set(prefix_tokens))
    if missing:
        raise ValueError(f"no prefix length for tenants {missing}")
    full = {t: n // block_size for t, n in prefix_tokens.items()}
    working_set = sum(full.values())
    if working_set == 0:
        raise ValueError(
            f"the system prompts are shorter than one block ({block_size} tokens): "
            "lengthen them (--system-len) so there is something to cache"
        )
    request_blocks = max(-(-total // block_size) for _, total in requests)
    private = max(-(-total // block_size) - full[t] for t, total in requests)
    reserve = -(-concurrency // replicas) * private
    num_kv_blocks = max(request_blocks, math.ceil(headroom * working_set / replicas) + reserve)
    return KVSizing(
        block_size=block_size,
        replicas=replicas,
        concurrency=concurrency,
        headroom=headroom,
        tenants=len(full),
        working_set_blocks=working_set,
        request_blocks=request_blocks,
        private_blocks=private,
        reserve_blocks=reserve,
        num_kv_blocks=num_kv_blocks,
    )


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def workload_token_counts(
    requests: Sequence[WorkloadRequest], encode_chat: Callable[[list[dict[str, str]]], list[int]]
) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """(prefix tokens per tenant, (tenant, prompt + max_tokens) per request) with the model's chat template.

    A tenant's prefix is what two requests with its system prompt and
    different user messages share once templated.
    """
    prefix: dict[str, int] = {}
    totals = []
    for req in requests:
        messages = req.body["messages"]
        if req.tenant not in prefix:
            static = [m for m in messages if m["role"] in ("system", "developer")]
            a = encode_chat(static + [{"role": "user", "content": "alpha"}])
            b = encode_chat(static + [{"role": "user", "content": "omega"}])
            prefix[req.tenant] = common_prefix_len(a, b)
        totals.append((req.tenant, len(encode_chat(messages)) + int(req.body["max_tokens"])))
    return prefix, totals


def oracle_hit_rate(
    tenants: Sequence[str], prompt_tokens: Sequence[int], prefix_tokens: Mapping[str, int], block_size: int
) -> float:
    """Hit rate of one replica with an unbounded cache replaying the requests in order.

    Every request after its tenant's first hits the full blocks of the tenant's
    prefix; no policy on any cluster does better (requests of one tenant sent
    together can even miss where this counts a hit).
    """
    seen: set[str] = set()
    hits = 0
    for tenant, _ in zip(tenants, prompt_tokens, strict=True):
        if tenant in seen:
            hits += prefix_tokens[tenant] // block_size * block_size
        seen.add(tenant)
    total = sum(prompt_tokens)
    return hits / total if total else 0.0


def chat_encoder(model: str) -> Callable[[list[dict[str, str]]], list[int]]:
    """The model's chat template as the engine applies it (replica/engine/input_processor.py's encode_chat)."""
    from prefixserve.loadtest.peers.serve_adapter import PromptEncoder

    return PromptEncoder.load(model).encode_chat


# --------------------------------------------------------------------------- policies


def router_args(
    policy: str,
    *,
    seed: int,
    epsilon: float | None,
    engine: Mapping[str, Any] | None = None,
    placed_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``router`` section of router/serve/app.py's args that runs ``policy``.

    ``engine``: the engine section (a peer tokenizes with its model and hashes with its block size,
    hash algorithm and pool size, as a real deployment of that router is configured).
    ``placed_options``: more options of ``placed`` (PlacedOptions; None values included), applied to
    the ``placed`` policy alone.
    """
    if policy == RAY_PREFIX:
        return {"router_class": "ray_llm_prefix_aware"}
    if policy in PEER_POLICIES:
        from prefixserve.loadtest.peers.serve_adapter import PEER_ROUTER_CLASS_PATH
        from prefixserve.replica.config import EngineConfig, resolve_hash_algo

        engine = engine or {}
        kwargs: dict[str, Any] = {
            "peer": policy,
            "seed": seed,
            "model": engine.get("model", EngineConfig.model),
            "block_size": engine.get("block_size", EngineConfig.block_size),
            "hash_algo": resolve_hash_algo(
                engine.get("prefix_hash_algo", EngineConfig.prefix_hash_algo), engine.get("prefix_caching_hash_algo")
            ),
        }
        if engine.get("num_kv_blocks") is not None:
            kwargs["num_gpu_blocks"] = engine["num_kv_blocks"]
        return {"router_class": PEER_ROUTER_CLASS_PATH, "kwargs": kwargs}
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {list(KNOWN_POLICIES)}")
    args: dict[str, Any] = {"router_class": "prefixserve", "policy": policy}
    args.update(pick_options(policy, {"seed": seed, "epsilon": epsilon}))
    if policy == "placed" and placed_options:
        args.update(placed_options)
    return args


def app_args(
    policy: str,
    *,
    model: str,
    replicas: int,
    sizing: KVSizing | None,
    seed: int,
    epsilon: float | None,
    engine_extra: Mapping[str, Any] | None = None,
    session_affinity: str = "none",
    placed_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """router/serve/app.py's args for one policy's deployment (``placed_options``: see ``router_args``)."""
    engine: dict[str, Any] = {"model": model, "seed": seed, **(engine_extra or {})}
    if sizing is not None:
        engine.update(num_kv_blocks=sizing.num_kv_blocks, block_size=sizing.block_size)
    ingress: dict[str, Any] = {"num_replicas": 1}
    if session_affinity == "header":
        ingress["session_header"] = True
    elif session_affinity == "turns":
        ingress["key_turns"] = 1
    return {
        "engine": engine,
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 1},
        "router": router_args(policy, seed=seed, epsilon=epsilon, engine=engine, placed_options=placed_options),
        "ingress": ingress,
    }


def session_headers(requests: Sequence[WorkloadRequest], session_affinity: str) -> list[dict[str, str]] | None:
    """Per request, the X-Session-Id its client sends (the user/tenant) under ``header`` affinity."""
    if session_affinity != "header":
        return None
    from prefixserve.router.routing_key import SESSION_HEADER

    return [{SESSION_HEADER: r.tenant} for r in requests]


# --------------------------------------------------------------------------- statistics


@dataclass
class PolicyResult:
    """One policy's figures (times in seconds)."""

    policy: str
    requests: int
    succeeded: int
    hit_rate: float | None  # from the replicas' counters: hit tokens / queried tokens
    cached_token_ratio: float | None  # from the responses' usage: cached / prompt tokens
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    e2e_p50_s: float | None
    requests_per_s: float
    duration_s: float
    load_max: float  # max over replicas of its time-averaged in-flight requests
    load_mean: float  # mean over replicas of the same
    peak_in_flight: int  # most requests one replica had at once
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    preemptions: int = 0  # the replicas' recompute preemptions (a pool too small for the in-flight load)
    deploy_s: float | None = None  # time to bring this policy's app up (local cluster only)
    # Keyed requests served off their ring owner (prefixserve's router metric; ring policies only).
    spills: int | None = None
    # Requests the router counted under this policy's name (prefixserve's router and the peer
    # routers, router/serve/metrics.py; None for Ray's own router and --url).
    routed: int | None = None

    @property
    def load_imbalance(self) -> float | None:
        """load_max / load_mean: 1.0 is perfectly even."""
        return ratio(self.load_max, self.load_mean)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "load_imbalance": self.load_imbalance}


def summarize(
    policy: str, records: Sequence[RequestRecord], counters: Mapping[str, Mapping[str, float]]
) -> PolicyResult:
    """One policy's result from its request records and its replicas' counter deltas.

    Replicas known from the counters but absent from the records served no
    request and count as idle in the load mean.
    """
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    queries = sum(c.get(QUERIES, 0.0) for c in counters.values())
    hits = sum(c.get(HITS, 0.0) for c in counters.values())
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    loads = in_flight_by_replica(records)
    names = sorted(set(counters) | set(loads))
    means = [loads[n].mean if n in loads else 0.0 for n in names]
    duration = (max(r.ended_s for r in records) - min(r.sent_s for r in records)) if records else 0.0
    per_replica = {}
    for n in names:
        c = counters.get(n, {})
        q, h = c.get(QUERIES, 0.0), c.get(HITS, 0.0)
        load = loads.get(n)
        per_replica[n] = {
            "requests": load.requests if load else 0,
            "prefix_queries": q,
            "prefix_hits": h,
            "hit_rate": h / q if q else None,
            "mean_in_flight": load.mean if load else 0.0,
            "peak_in_flight": load.peak if load else 0,
        }
    return PolicyResult(
        policy=policy,
        requests=len(records),
        succeeded=len(ok),
        hit_rate=hits / queries if queries else None,
        cached_token_ratio=cached / prompt if prompt else None,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        e2e_p50_s=percentile([r.e2e_s for r in ok], 50),
        requests_per_s=len(ok) / duration if duration > 0 else 0.0,
        duration_s=duration,
        load_max=max(means, default=0.0),
        load_mean=sum(means) / len(means) if means else 0.0,
        peak_in_flight=max((load.peak for load in loads.values()), default=0),
        preemptions=round(sum(c.get(PREEMPTIONS, 0.0) for c in counters.values())),
        replicas=per_replica,
        errors=[f"request {r.index}: {r.error}" for r in records if not r.ok][:10],
    )


def ratios(results: Sequence[PolicyResult], baseline: str = BASELINE) -> dict[str, dict[str, float | None]]:
    """For every other policy: baseline / policy of the hit rate and of TTFT p50.

    A hit-rate ratio above 1 and a TTFT ratio below 1 favour the baseline. Empty
    when the baseline did not run.
    """
    base = next((r for r in results if r.policy == baseline), None)
    if base is None:
        return {}
    return {
        r.policy: {
            "hit_rate_ratio": ratio(base.hit_rate, r.hit_rate),
            "ttft_p50_ratio": ratio(base.ttft_p50_s, r.ttft_p50_s),
            "ttft_p95_ratio": ratio(base.ttft_p95_s, r.ttft_p95_s),
        }
        for r in results
        if r.policy != baseline
    }


# --------------------------------------------------------------------------- output


def render_table(results: Sequence[PolicyResult]) -> str:
    """The per-policy markdown table."""
    header = (
        "policy | hit rate | cached/prompt tokens | TTFT p50 (s) | TTFT p95 (s) | req/s"
        " | in-flight max/mean per replica | peak in-flight | requests per replica | spills | ok"
    )
    rows = [
        [
            r.policy,
            fmt(r.hit_rate, ".3f"),
            fmt(r.cached_token_ratio, ".3f"),
            fmt(r.ttft_p50_s, ".3f"),
            fmt(r.ttft_p95_s, ".3f"),
            f"{r.requests_per_s:.2f}",
            f"{r.load_max:.2f} / {r.load_mean:.2f} ({fmt(r.load_imbalance, '.2f')}x)",
            r.peak_in_flight,
            requests_per_replica(r),
            "-" if r.spills is None else r.spills,
            f"{r.succeeded}/{r.requests}",
        ]
        for r in results
    ]
    return markdown_table(header, rows, "lrrrrrrrlrr")


def requests_per_replica(r: PolicyResult) -> str:
    """How many requests each replica served, in replica-name order: ``10 / 9 / 0``."""
    return " / ".join(str(int(v["requests"])) for _, v in sorted(r.replicas.items()))


def render_ratios(table: Mapping[str, Mapping[str, float | None]], baseline: str = BASELINE) -> str:
    """The baseline-against-each-policy markdown table."""
    header = [
        f"{baseline} vs",
        f"hit-rate ratio ({baseline} / policy)",
        f"TTFT p50 ratio ({baseline} / policy)",
        "TTFT p95 ratio",
    ]
    rows = [
        [policy, *(f"{fmt(r[k], '.2f')}x" for k in ("hit_rate_ratio", "ttft_p50_ratio", "ttft_p95_ratio"))]
        for policy, r in table.items()
    ]
    return markdown_table(header, rows, "lrrr")


def plot(results: Sequence[PolicyResult], path: Path, title: str) -> None:
    """Hit-rate bars (left axis) and a TTFT p50 line (right axis) per policy."""
    names = [r.policy for r in results]
    xs = range(len(names))
    with figure(path, 120, figsize=(max(6.0, 1.6 * len(names)), 4.5)) as (_, ax):
        bars = ax.bar(
            xs, [r.hit_rate or 0.0 for r in results], color="#4c72b0", alpha=0.8, label="prefix-cache hit rate"
        )
        for bar, r in zip(bars, results):
            ax.annotate(
                fmt(r.hit_rate, ".2f"),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("cluster prefix-cache hit rate")
        ax.set_xticks(list(xs), names, rotation=15)
        ax2 = ax.twinx()
        ax2.plot(
            xs,
            [r.ttft_p50_s if r.ttft_p50_s is not None else float("nan") for r in results],
            "o-",
            color="#c44e52",
            label="TTFT p50",
        )
        ax2.plot(
            xs,
            [r.ttft_p95_s if r.ttft_p95_s is not None else float("nan") for r in results],
            "s--",
            color="#c44e52",
            alpha=0.5,
            label="TTFT p95",
        )
        ax2.set_ylim(bottom=0)
        ax2.set_ylabel("TTFT (s)")
        handles = [bars] + ax2.get_lines()
        ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
        ax.set_title(title, fontsize=9)


# --------------------------------------------------------------------------- running


def _bodies(requests: Sequence[WorkloadRequest], model: str, salt: str | None) -> list[dict[str, Any]]:
    bodies = []
    for req in requests:
        body = {**req.body, "model": model}
        if salt is not None:
            body["cache_salt"] = salt
        bodies.append(body)
    return bodies


def deploy_policy(
    cluster: LocalServeCluster,
    policy: str,
    name: str,
    args: argparse.Namespace,
    sizing: KVSizing | None,
    **options: Any,
) -> str:
    """Deploy ``policy``'s app afresh as ``name`` (cold caches); returns its base URL.

    ``args`` gives the model, the replica count, the seed and the deployment timeout;
    ``options``, the rest of :func:`app_args`'s (``epsilon`` among them).
    """
    return cluster.deploy(
        app_args(policy, model=args.model, replicas=args.replicas, sizing=sizing, seed=args.seed, **options),
        name,
        num_replicas=args.replicas,
        timeout_s=args.timeout,
    )


def measure(
    base_url: str,
    policy: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    api_key: str | None = None,
    headers: Sequence[Mapping[str, str]] | None = None,
    timeout_s: float = 600.0,
) -> tuple[PolicyResult, list[RequestRecord]]:
    """Stream ``bodies`` through ``base_url`` and summarize it, with the counters read before and after."""
    before = scrape_metrics(base_url, api_key=api_key)
    with tqdm(total=len(bodies), desc=policy, unit="req", leave=False, file=sys.stderr) as bar:
        records = run_load(
            base_url,
            bodies,
            concurrency,
            headers=headers,
            api_key=api_key,
            timeout_s=timeout_s,
            on_done=lambda _: bar.update(1),
        )
    after = scrape_metrics(base_url, api_key=api_key)
    result = summarize(policy, records, counter_deltas(replica_counters(before), replica_counters(after)))
    if policy in RING_POLICIES:
        result.spills = round(sum_samples(after, SPILLS) - sum_samples(before, SPILLS))
    if policy in POLICIES or policy in PEER_POLICIES:
        labels = {"policy": policy}
        result.routed = round(sum_samples(after, ROUTED, labels) - sum_samples(before, ROUTED, labels))
    return result, records


def _record_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "i": r.index,
        "ok": r.ok,
        "replica": r.replica,
        "sent_s": round(r.sent_s, 4),
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
        "e2e_s": round(r.e2e_s, 4),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "error": r.error,
    }


def add_workload_flags(p: argparse.ArgumentParser, defaults: WorkloadSpec, *, concurrency: int) -> None:
    """The model, the workload (:meth:`WorkloadSpec.from_args` reads it back), the closed loop and the block size."""
    p.add_argument("--model", default="smollm2", help="'smollm2' or a checkpoint directory / .gguf file")
    p.add_argument("--workload", default=defaults.name, choices=WORKLOADS)
    p.add_argument("--tenants", type=int, default=defaults.tenants)
    p.add_argument("--requests", type=int, default=defaults.requests)
    p.add_argument("--system-len", type=int, default=defaults.system_len, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=defaults.question_len, help="user message tokens")
    p.add_argument("--output-len", type=int, default=defaults.output_len, help="max_tokens")
    p.add_argument("--zipf-s", type=float, default=defaults.zipf_s)
    p.add_argument("--hot-share", type=float, default=defaults.hot_share)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight (closed loop)")
    p.add_argument("--block-size", type=int, default=16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_cluster",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--url", default=None, help="measure a running endpoint (one row, salted requests) instead of a local cluster"
    )
    p.add_argument("--label", default="endpoint", help="row name of the --url run")
    p.add_argument("--api-key", default=None, help="Bearer key for --url")
    p.add_argument(
        "--send-prefix-hash",
        action="store_true",
        help="send X-Prefix-Hash (router/routing_key.py's key), for an nginx --url",
    )
    p.add_argument(
        "--policies", default=",".join(DEFAULT_POLICIES), help=f"comma-separated, from {', '.join(KNOWN_POLICIES)}"
    )
    p.add_argument("--baseline", default=BASELINE, help="policy the ratios compare against the others")
    p.add_argument("--replicas", type=int, default=2)
    add_workload_flags(p, WorkloadSpec(), concurrency=4)
    p.add_argument(
        "--kv-headroom", type=float, default=1.5, help="cluster prefix room over the working set, in [1, replicas)"
    )
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the computed per-replica pool")
    p.add_argument(
        "--epsilon", type=float, default=None, help="bounded_load's and placed's epsilon (default: the policy's)"
    )
    add_placed_option_flag(p)
    p.add_argument(
        "--session-affinity",
        default="none",
        choices=SESSION_AFFINITY,
        help="multi-turn affinity: 'header' sends X-Session-Id (the user) and keys by it, 'turns' keys "
        "by the first turn too (router/routing_key.py)",
    )
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port for the local cluster")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request and per deployment")
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    add_verbose_flag(p)
    return p


def _parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in KNOWN_POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown or no policies {unknown}; choose from {list(KNOWN_POLICIES)}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"--policies names a policy twice: {policies}")
    return policies


@dataclass
class Plan:
    """What a run will do, validated before anything starts."""

    spec: WorkloadSpec
    requests: list[WorkloadRequest]
    policies: list[str]  # local cluster; empty with --url
    sizing: KVSizing | None  # local cluster only
    oracle_hit_rate: float | None = None  # local cluster only (needs the model's tokenizer)
    placed_options: dict[str, Any] = field(default_factory=dict)  # --placed-option, validated


def plan(args: argparse.Namespace) -> Plan:
    """Validate the options and size the KV pools; raises ValueError saying what to change."""
    spec = WorkloadSpec.from_args(args)
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    requests = spec.generate()
    if args.url is not None:
        return Plan(spec, requests, [], None)
    policies = _parse_policies(args.policies)
    placed_options = dict(parse_placed_options(args.placed_option))
    if placed_options:
        make_policy("placed", **placed_options)  # validates them before any cluster starts
    prefix, totals = workload_token_counts(requests, chat_encoder(args.model))
    sizing = size_kv(
        prefix,
        totals,
        block_size=args.block_size,
        replicas=args.replicas,
        concurrency=args.concurrency,
        headroom=args.kv_headroom,
    )
    if args.num_kv_blocks is not None:
        if args.num_kv_blocks < sizing.request_blocks:
            raise ValueError(f"--num-kv-blocks must hold one request: at least {sizing.request_blocks}")
        sizing = KVSizing(**{**asdict(sizing), "num_kv_blocks": args.num_kv_blocks})
    prompts = [total - int(r.body["max_tokens"]) for r, (_, total) in zip(requests, totals)]
    # The oracle counts system-prompt hits only: a conversation's history hits more (no bound for multi_turn).
    oracle = (
        None
        if spec.name in CONVERSATIONS
        else oracle_hit_rate([r.tenant for r in requests], prompts, prefix, args.block_size)
    )
    return Plan(spec, requests, policies, sizing, oracle, placed_options)


def run(args: argparse.Namespace, p: Plan) -> int:
    """Measure (a local cluster per policy, or the --url endpoint), print, write JSON and PNG."""
    spec, requests, sizing = p.spec, p.requests, p.sizing
    results: list[PolicyResult] = []
    failures: dict[str, str] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()

    if args.url is not None:
        base = args.url.rstrip("/")
        salt = f"bench-{uuid.uuid4().hex[:12]}"  # earlier traffic of the same workload cannot hit
        bodies = _bodies(requests, served_model(base, api_key=args.api_key), salt)
        headers = None
        if args.send_prefix_hash:
            from prefixserve.router.routing_key import PREFIX_HASH_HEADER, routing_key

            headers = [{PREFIX_HASH_HEADER: k} if (k := routing_key(b)) is not None else {} for b in bodies]
        result, recs = measure(
            base, args.label, bodies, args.concurrency, api_key=args.api_key, headers=headers, timeout_s=args.timeout
        )
        results.append(result)
        records[args.label] = [_record_json(r) for r in recs]
    else:
        assert sizing is not None
        print(sizing.describe(), file=sys.stderr)
        # One logical CPU per engine replica plus one for helper actors (Ray Serve LLM's prefix tree).
        with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
            for policy in tqdm(p.policies, desc="policies", unit="policy", file=sys.stderr):
                # A fresh app (and name) per policy: new replicas with cold caches, and a new
                # prefix-tree actor for ray_prefix (its name is scoped by the app).
                name = f"bench-{policy}"
                try:
                    t0 = time.perf_counter()
                    base = deploy_policy(
                        cluster,
                        policy,
                        name,
                        args,
                        sizing,
                        epsilon=args.epsilon,
                        session_affinity=args.session_affinity,
                        placed_options=p.placed_options,
                    )
                    deploy_s = time.perf_counter() - t0
                    tqdm.write(f"{policy}: deployed in {deploy_s:.0f}s", file=sys.stderr)
                    bodies = _bodies(requests, served_model(base), None)
                    result, recs = measure(
                        base,
                        policy,
                        bodies,
                        args.concurrency,
                        timeout_s=args.timeout,
                        headers=session_headers(requests, args.session_affinity),
                    )
                    result.deploy_s = deploy_s
                    results.append(result)
                    records[policy] = [_record_json(r) for r in recs]
                    tqdm.write(
                        f"{policy}: hit rate {fmt(result.hit_rate, '.3f')}, TTFT p50 "
                        f"{fmt(result.ttft_p50_s, '.3f')}s, {result.succeeded}/{result.requests} ok",
                        file=sys.stderr,
                    )
                except Exception as exc:  # one policy failing must not lose the others' figures
                    failures[policy] = f"{type(exc).__name__}: {exc}"
                    tqdm.write(f"{policy}: FAILED {failures[policy]}", file=sys.stderr)
                finally:
                    try:
                        cluster.delete(name)
                    except Exception as exc:
                        tqdm.write(f"{policy}: could not delete the app: {exc}", file=sys.stderr)

    ratio_table = ratios(results, args.baseline)
    where = f"{args.url}" if args.url is not None else f"{args.replicas} replicas, model {Path(args.model).name}"
    affinity = "" if args.session_affinity == "none" else f", session affinity {args.session_affinity}"
    title = (
        f"{spec.name}: {spec.tenants} tenants, {spec.requests} requests, system {spec.system_len} tok, "
        f"concurrency {args.concurrency}, {where}{affinity}"
    )
    print(f"\n## Cluster benchmark: {title}\n")
    if sizing is not None:
        print(sizing.describe() + "\n")
    if p.oracle_hit_rate is not None:
        print(
            f"Upper bound: one replica with an unbounded cache would hit {p.oracle_hit_rate:.3f} of the "
            "prompt tokens.\n"
        )
    print(render_table(results))
    preempted = {r.policy: r.preemptions for r in results if r.preemptions}
    if preempted:
        print(f"\nrecompute preemptions (the KV pool was short for the in-flight load): {preempted}")
    if ratio_table:
        print()
        print(render_ratios(ratio_table, args.baseline))
    for policy, reason in failures.items():
        print(f"\n{policy} FAILED: {reason}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config_json(args),
        "workload": asdict(spec),
        "kv_sizing": sizing.to_json() if sizing is not None else None,
        "oracle_hit_rate": p.oracle_hit_rate,
        "results": [r.to_json() for r in results],
        "baseline": args.baseline,
        "ratios": ratio_table,
        "failures": failures,
        "wall_s": time.perf_counter() - started,
        "records": records,
    }
    json_path = args.out_dir / "bench_cluster.json"
    write_json(json_path, payload, announce=False)
    png_path = args.out_dir / "bench_cluster.png"
    if results:
        plot(results, png_path, title)
    print(f"\nwrote {json_path}" + (f" and {png_path}" if results else ""))
    return 1 if failures or any(r.succeeded < r.requests for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
