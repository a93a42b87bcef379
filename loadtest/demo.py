"""``make demo``: the cluster on this machine, a shared-prefix load, round_robin against the default policy.

``python -m prefixserve.loadtest.demo`` brings up a local Ray with Serve (the OpenAI
ingress and two SmolLM2 engine replicas on CPU), then for each policy in turn
deploys the app afresh (cold caches), streams the same seeded shared-prefix
load through it (a few tenants' system prompts, interleaved, closed loop) and
prints the cluster's prefix-cache hit rate (the replicas' vLLM counters, read
through the ingress's /metrics before and after), TTFT p50 and mean as the
client saw it, and requests/s; then the default policy's (``placed``) ratios
over round_robin.
Everything shuts down at the end (Ctrl-C included), quietly: library logs stay at
WARNING unless ``--verbose``.

KV pools are sized so that the working set (every tenant's system-prompt
blocks) exceeds one replica's pool and fits the two together: round_robin
sends every tenant to both replicas and they evict each other's prefixes;
the default policy keeps each tenant on the replica it is placed on. About 2
minutes on 2 CPU cores. Writes results/demo.json.

The pieces (cluster bring-up, streaming client, KV sizing, summaries) are
loadtest/cluster_run.py's and loadtest/bench_cluster.py's; this module only
chooses the demo's workload and prints its comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from prefixserve.common.logs import add_verbose_flag
from prefixserve.common.serve_shutdown import shutdown_serve
from prefixserve.loadtest.bench_cluster import (
    KVSizing,
    PolicyResult,
    WorkloadSpec,
    _bodies,
    chat_encoder,
    deploy_policy,
    measure,
    requests_per_replica,
    size_kv,
    workload_token_counts,
)
from prefixserve.loadtest.cluster_run import LocalServeCluster, served_model
from prefixserve.loadtest.harness.cli import plan_and_run
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.stats import ratio
from prefixserve.loadtest.workloads import WorkloadRequest
from prefixserve.router.policies import DEFAULT_POLICY

POLICIES = ("round_robin", DEFAULT_POLICY)
RING_SIZE = "prefixserve_router_ring_size"


def wait_for_ring(base_url: str, replicas: int, timeout_s: float = 120.0) -> None:
    """Wait until the ingress's router has every engine replica on its ring.

    Serve reports a replica running a moment before the ingress's router hears
    of it; a load started in between would route over a partial ring.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        # One ring-size sample per ingress replica (label ingress): each must see them all.
        sizes = [
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == RING_SIZE and s.labels.get("deployment") == "Engine"
        ]
        if sizes and all(size == replicas for size in sizes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not see {replicas} engine replicas within {timeout_s}s")
        time.sleep(0.2)


def _ttft_mean(records) -> float | None:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    return sum(ttfts) / len(ttfts) if ttfts else None


def render(rows: Sequence[tuple[PolicyResult, float | None]]) -> str:
    """The per-policy markdown table, the client's TTFT mean beside each policy's figures."""
    header = ["policy", "cluster hit rate", "TTFT p50 (s)", "TTFT mean (s)", "req/s", "requests per replica", "ok"]
    cells = [
        [
            r.policy,
            fmt(r.hit_rate, ".3f"),
            fmt(r.ttft_p50_s, ".3f"),
            fmt(mean, ".3f"),
            f"{r.requests_per_s:.2f}",
            requests_per_replica(r),
            f"{r.succeeded}/{r.requests}",
        ]
        for r, mean in rows
    ]
    return markdown_table(header, cells, "lrrrrlr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="'smollm2' or a checkpoint directory / .gguf file")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tenants", type=int, default=6, help="distinct system prompts")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument(
        "--system-len",
        type=int,
        default=320,
        help="system prompt tokens (long enough that a miss's prefill shows in TTFT)",
    )
    p.add_argument("--question-len", type=int, default=16, help="user message tokens")
    p.add_argument("--output-len", type=int, default=8, help="max_tokens")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-headroom", type=float, default=1.5, help="cluster prefix room over the working set, in [1, replicas)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request and per deployment")
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    add_verbose_flag(p)
    return p


@dataclass(frozen=True)
class Plan:
    """The demo's workload and the KV pool sized for it, checked before any cluster starts."""

    spec: WorkloadSpec
    requests: list[WorkloadRequest]
    sizing: KVSizing


def plan(args: argparse.Namespace) -> Plan:
    """The workload and the KV sizing the flags ask for (ValueError: a usage error)."""
    spec = WorkloadSpec(
        "shared_prefix",
        args.tenants,
        args.requests,
        args.system_len,
        args.question_len,
        args.output_len,
        seed=args.seed,
    )
    requests = spec.generate()
    prefix, totals = workload_token_counts(requests, chat_encoder(args.model))
    sizing = size_kv(
        prefix,
        totals,
        block_size=16,
        replicas=args.replicas,
        concurrency=args.concurrency,
        headroom=args.kv_headroom,
    )
    return Plan(spec, requests, sizing)


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


def run(args: argparse.Namespace, p: Plan) -> int:
    """Each policy on a fresh app, then the table, the ratios and results/demo.json."""
    spec, requests, sizing = p.spec, p.requests, p.sizing
    print(sizing.describe(), file=sys.stderr)

    rows: list[tuple[PolicyResult, float | None]] = []
    started = time.perf_counter()
    # One logical CPU per engine replica plus one spare for Serve's helpers.
    with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
        try:
            for policy in tqdm(POLICIES, desc="policies", unit="policy", file=sys.stderr):
                name = f"demo-{policy}"
                try:
                    t0 = time.perf_counter()
                    base = deploy_policy(cluster, policy, name, args, sizing, epsilon=None)
                    wait_for_ring(base, args.replicas)
                    tqdm.write(
                        f"{policy}: {args.replicas} replicas up in {time.perf_counter() - t0:.0f}s", file=sys.stderr
                    )
                    result, records = measure(
                        base,
                        policy,
                        _bodies(requests, served_model(base), None),
                        args.concurrency,
                        timeout_s=args.timeout,
                    )
                    rows.append((result, _ttft_mean(records)))
                finally:
                    cluster.delete(name)
        finally:
            # Serve stopped here, quietly, before the cluster's exit stops Ray (its own
            # serve.shutdown() then finds nothing to do).
            shutdown_serve()

    (rr, rr_mean), (bl, bl_mean) = rows
    print(
        f"\n## prefixserve demo: {args.tenants} tenants x {args.requests // args.tenants} requests, system prompt "
        f"{args.system_len} tokens, {args.output_len} output tokens, concurrency {args.concurrency}, "
        f"{args.replicas} replicas of {Path(args.model).name} on CPU\n"
    )
    print(sizing.describe() + "\n")
    print(render(rows))
    ratios = {
        "hit_rate": ratio(bl.hit_rate, rr.hit_rate),
        "ttft_p50": ratio(bl.ttft_p50_s, rr.ttft_p50_s),
        "ttft_mean": ratio(bl_mean, rr_mean),
        "requests_per_s": ratio(bl.requests_per_s, rr.requests_per_s),
    }
    print(
        f"\n{DEFAULT_POLICY} / round_robin: hit rate {fmt(ratios['hit_rate'], '.2f')}x, "
        f"TTFT p50 {fmt(ratios['ttft_p50'], '.2f')}x, TTFT mean {fmt(ratios['ttft_mean'], '.2f')}x, "
        f"req/s {fmt(ratios['requests_per_s'], '.2f')}x"
    )

    write_json(
        args.out_dir / "demo.json",
        {
            "config": config_json(args),
            "kv_sizing": sizing.to_json(),
            "results": [{**r.to_json(), "ttft_mean_s": mean} for r, mean in rows],
            "default_policy": DEFAULT_POLICY,
            "ratios_default_over_round_robin": ratios,
            "wall_s": time.perf_counter() - started,
            "workload": asdict(spec),
        },
    )
    print(
        "\nWhere to look on a running cluster (`prefixserve up`): http://127.0.0.1:8000/metrics (every replica's "
        "vllm:* series and the router's prefixserve_router_*), the Grafana dashboard "
        "observability/grafana-dashboard.json and the Prometheus scrape config observability/prometheus.yml."
    )
    return 0 if all(r.succeeded == r.requests for r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
