"""Flow-control benchmark: tenants through the Ray ingress at three times the cluster's capacity.

``python -m prefixserve.loadtest.bench_flow`` brings up a local Ray cluster (R engine replicas
running the priority scheduling policy, the ingress with a tenant file: docs/flow_control.md)
and runs, on that one deployment, seeded open-loop phases of ``--duration-s`` each:

1. **capacity**: batch-shaped requests, closed loop at the ingress's slots: C requests/s.
2. **alone**: the interactive tenant alone (band 0, short prompts) at ``--interactive-share`` x C.
3. **overload**: the interactive tenant as in 2 beside the batch tenant (band 10, long prompts
   and answers) sending ``--overload`` x C: the interactive TTFT p50 against phase 2's, and
   how many batch requests completed (none may be refused: the queue budget is sized to the run).
4. **fair**: the interactive tenant beside two equal-weight batch tenants, each sending half
   the overload: their TTFT p50s, and Jain's index of the tokens the two were served while
   both were backlogged.
5. **noisy**: phase 4 plus a noisy tenant sending three times its requests-per-minute quota:
   its admitted rate against the quota, the others' TTFT p50 against phase 4's.
6. **noisy_at_quota**: phase 5 with the noisy tenant sending exactly its quota: the others' TTFT
   p50 in phase 5 against this one is what its traffic beyond the quota costs them.

Then phase 3 again on a deployment without tenants (no flow control: every request waits in
Serve's and the engines' queues in arrival order), the comparison point.

Writes a markdown table, results/bench_flow.json and results/bench_flow.png (TTFT p50 of
each tenant per phase). Exit status 1 when a request failed that flow control should not have
refused (anything but the noisy tenant's 429s).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from prefixserve.loadtest.cluster_run import LocalServeCluster, scrape_metrics, served_model
from prefixserve.loadtest.harness.cli import cluster_parser, plan_and_run
from prefixserve.loadtest.harness.client import RequestRecord, auth_headers, run_load, stream_one
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.stats import percentile, ratio
from prefixserve.router.flow_control.fairness import jain_index
from prefixserve.router.serve.metrics import sum_samples

WORDS = (
    "alpha beta gamma delta river stone cloud paper garden window silver orange market "
    "harbor lantern meadow copper violet canyon thunder willow ember granite falcon"
).split()
INTERACTIVE, BATCH, BATCH_A, BATCH_B, NOISY = "interactive", "batch", "batch-a", "batch-b", "noisy"
TENANT_BANDS = {INTERACTIVE: 0, BATCH: 10, BATCH_A: 10, BATCH_B: 10, NOISY: 10}
PHASES = ("alone", "overload", "fair", "noisy", "noisy_at_quota", "overload_no_flow")


@dataclass(frozen=True)
class Shape:
    """One tenant's requests: prompt words (system + question) and answer tokens."""

    system_words: int
    question_words: int
    max_tokens: int


INTERACTIVE_SHAPE = Shape(system_words=20, question_words=8, max_tokens=8)
BATCH_SHAPE = Shape(system_words=120, question_words=24, max_tokens=32)


def api_key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


def tenant_file(noisy_requests_per_minute: float) -> dict[str, Any]:
    """The tenant file of the flow-control deployment (docs/flow_control.md's shape)."""
    return {
        "tenants": [
            {
                "name": name,
                "api_key": api_key(name),
                "priorities": [band, band],
                **({"requests_per_minute": noisy_requests_per_minute} if name == NOISY else {}),
            }
            for name, band in TENANT_BANDS.items()
        ]
    }


def chat_body(rng: random.Random, shape: Shape, system: str, model: str) -> dict[str, Any]:
    question = " ".join(rng.choice(WORDS) for _ in range(shape.question_words))
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": shape.max_tokens,
        "ignore_eos": True,  # every answer as long as asked: the work per request is what the phase says
        "temperature": 0.0,
    }


@dataclass(frozen=True)
class Arrival:
    """One request of an open-loop schedule: when (seconds from the phase's start), whose, what."""

    at_s: float
    tenant: str
    body: dict[str, Any]


def schedule(rates: Mapping[str, float], duration_s: float, model: str, seed: int) -> list[Arrival]:
    """Poisson arrivals per tenant at ``rates`` (requests/s) over ``duration_s``, merged by time.

    Each tenant's requests share its system prompt (a tenant's prefix) and differ in the question.
    """
    arrivals: list[Arrival] = []
    for tenant, rate in sorted(rates.items()):
        if rate <= 0:
            continue
        rng = random.Random(f"{seed}:{tenant}")
        shape = INTERACTIVE_SHAPE if tenant == INTERACTIVE else BATCH_SHAPE
        system = f"You serve tenant {tenant}. " + " ".join(rng.choice(WORDS) for _ in range(shape.system_words))
        t = rng.expovariate(rate)
        while t < duration_s:
            arrivals.append(Arrival(t, tenant, chat_body(rng, shape, system, model)))
            t += rng.expovariate(rate)
    arrivals.sort(key=lambda a: a.at_s)
    return arrivals


@dataclass
class TenantRecord:
    """A request of a phase: its tenant and what the client saw."""

    tenant: str
    record: RequestRecord


async def send_schedule(
    base_url: str, arrivals: Sequence[Arrival], *, with_keys: bool, timeout_s: float
) -> list[TenantRecord]:
    """Send ``arrivals`` open loop (each at its time, whatever is in flight); one record each."""
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, arrival: Arrival) -> TenantRecord:
            await asyncio.sleep(max(0.0, arrival.at_s - (time.perf_counter() - t0)))
            headers = auth_headers(api_key(arrival.tenant) if with_keys else None)
            return TenantRecord(arrival.tenant, await stream_one(client, url, i, arrival.body, headers, t0))

        return list(await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals))))


@dataclass
class TenantSummary:
    """One tenant's figures in one phase."""

    sent: int
    ok: int
    refused: dict[str, int]
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tokens: int  # prompt + completion tokens of its finished requests

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[TenantRecord]) -> dict[str, TenantSummary]:
    """Per tenant: sent, succeeded, refusals by status, TTFT p50/p90 of the succeeded, tokens served."""
    out: dict[str, TenantSummary] = {}
    for tenant in sorted({r.tenant for r in records}):
        mine = [r.record for r in records if r.tenant == tenant]
        ttfts = [r.ttft_s for r in mine if r.ok and r.ttft_s is not None]
        refused: dict[str, int] = {}
        for r in mine:
            if not r.ok:
                key = str(r.status) if r.status is not None else "error"
                refused[key] = refused.get(key, 0) + 1
        out[tenant] = TenantSummary(
            sent=len(mine),
            ok=sum(r.ok for r in mine),
            refused=refused,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            tokens=sum((r.prompt_tokens or 0) + (r.completion_tokens or 0) for r in mine if r.ok),
        )
    return out


def backlogged_jain(records: Sequence[TenantRecord], tenants: Sequence[str]) -> float | None:
    """Jain's index of the tokens ``tenants`` were served while all of them had requests waiting or
    running: the requests that ended before the first of them had sent its last request."""
    last_sent = min(
        (max((r.record.sent_s for r in records if r.tenant == t), default=0.0) for t in tenants), default=0.0
    )
    served = {
        t: sum(
            (r.record.prompt_tokens or 0) + (r.record.completion_tokens or 0)
            for r in records
            if r.tenant == t and r.record.ok and r.record.ended_s <= last_sent
        )
        for t in tenants
    }
    return jain_index([float(v) for v in served.values()]) if any(served.values()) else None


def admitted_rate_ratio(
    records: Sequence[TenantRecord], tenant: str, quota_per_minute: float, duration_s: float
) -> float:
    """The tenant's admitted requests per minute over the phase, over its quota."""
    admitted = sum(1 for r in records if r.tenant == tenant and r.record.status == 200)
    return admitted / (duration_s / 60.0) / quota_per_minute


@dataclass
class Targets:
    """The issue's targets, each measured."""

    interactive_ttft_vs_alone: float | None  # overload p50 / alone p50 (target <= 1.5)
    batch_completed: str  # "ok/sent" under overload (target: all)
    noisy_admitted_vs_quota: float | None  # target within 10% (0.9-1.1)
    others_ttft_vs_without_noisy: dict[str, float | None] = field(default_factory=dict)  # target <= 1.2
    # The noisy tenant at three times its quota against it at its quota: what its excess costs the others.
    others_ttft_over_vs_at_quota: dict[str, float | None] = field(default_factory=dict)
    jain_equal_tenants: float | None = None  # target >= 0.9
    no_flow_interactive_ttft_vs_alone: float | None = None  # the comparison point


def app_args(
    model: str,
    replicas: int,
    slots_per_replica: int,
    tenants: dict[str, Any] | None,
    queue_budget_s: float,
    reserved_slots: int = 0,
) -> dict[str, Any]:
    """The deployment: priority scheduling, ``slots_per_replica`` requests running per engine replica.

    With tenants, the ingress holds the slots (``replicas x slots_per_replica``) and queues the rest
    fairly; each engine's batch (and Serve's cap) is every slot, so a request that has its slot
    finds a seat on its replica at once, however the router spreads them, and the ingress's order
    is the order requests run in. Without tenants, each engine's batch is ``slots_per_replica``:
    the same work at once, every other request waiting in an engine's queue in arrival order (no
    tenant asks a priority), Serve's cap above what the router sends a replica.
    """
    slots = replicas * slots_per_replica
    ingress: dict[str, Any] = {"num_replicas": 1}
    if tenants is not None:
        ingress.update(
            tenants=tenants,
            queue_budget_s=queue_budget_s,
            flow_max_in_flight=slots,
            flow_reserved_slots=reserved_slots,
        )
    return {
        "engine": {
            "model": model,
            "scheduling_policy": "priority",
            "max_num_seqs": slots if tenants is not None else slots_per_replica,
        },
        "num_replicas": replicas,
        "max_ongoing_requests": 64 * slots,
        "ray_actor_options": {"num_cpus": 1},
        "router": {"policy": "placed"},
        "ingress": ingress,
    }


def build_parser() -> argparse.ArgumentParser:
    p = cluster_parser("bench_flow", __doc__ or "")
    p.add_argument(
        "--slots-per-replica", type=int, default=4, help="requests the ingress runs at once, per engine replica"
    )
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds each open-loop phase sends")
    p.add_argument("--overload", type=float, default=3.0, help="the batch load, in multiples of the capacity")
    p.add_argument("--interactive-share", type=float, default=0.15, help="the interactive rate, x capacity")
    p.add_argument("--noisy-quota-share", type=float, default=0.25, help="the noisy tenant's quota, x capacity")
    p.add_argument(
        "--reserved-slots",
        type=int,
        default=None,
        help="ingress slots for the interactive band alone (default: one per replica)",
    )
    return p


@dataclass
class Plan:
    """Validated options."""

    queue_budget_s: float
    reserved_slots: int


def plan(args: argparse.Namespace) -> Plan:
    """Check the options; the queue budget covers a whole overloaded phase's backlog."""
    if args.replicas < 1 or args.slots_per_replica < 1:
        raise ValueError("--replicas and --slots-per-replica must be >= 1")
    if not args.duration_s > 0 or not args.overload > 0:
        raise ValueError("--duration-s and --overload must be > 0")
    if not 0 < args.interactive_share < 1 or not 0 < args.noisy_quota_share < 1:
        raise ValueError("--interactive-share and --noisy-quota-share must be in (0, 1)")
    # The backlog of a phase drains in about overload x duration: no batch request may time out in it.
    reserved = args.replicas if args.reserved_slots is None else args.reserved_slots
    if not 0 <= reserved < args.replicas * args.slots_per_replica:
        raise ValueError("--reserved-slots must leave the batch bands a slot")
    return Plan(queue_budget_s=args.overload * args.duration_s * 2 + 60.0, reserved_slots=reserved)


def measure_capacity(base: str, model: str, slots: int, seed: int, timeout_s: float) -> float:
    """Batch-shaped requests a second, closed loop at ``slots`` in flight."""
    arrivals = schedule({BATCH: 1.0}, float(slots * 4), model, seed + 1000)[: slots * 4]
    started = time.perf_counter()
    records = run_load(base, [a.body for a in arrivals], slots, api_key=api_key(BATCH), timeout_s=timeout_s)
    elapsed = time.perf_counter() - started
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"capacity run: {len(failed)} requests failed: {failed[:3]}")
    return len(records) / elapsed


def run(args: argparse.Namespace, p: Plan) -> int:
    started = time.perf_counter()
    phases: dict[str, dict[str, TenantSummary]] = {}
    records: dict[str, list[TenantRecord]] = {}
    slots = args.replicas * args.slots_per_replica
    noisy_quota = 0.0
    capacity = 0.0
    fairness_gauge: float | None = None
    with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
        bar = tqdm(total=len(PHASES) + 1, desc="phases", unit="phase", file=sys.stderr)
        # The noisy quota is set from the capacity, known only once measured: deploy, measure, redeploy.
        base = cluster.deploy(
            app_args(
                args.model, args.replicas, args.slots_per_replica, tenant_file(60.0), p.queue_budget_s, p.reserved_slots
            ),
            "bench-flow",
            num_replicas=args.replicas,
            timeout_s=args.timeout,
            api_key=api_key(INTERACTIVE),
        )
        model = served_model(base, api_key=api_key(INTERACTIVE))
        capacity = measure_capacity(base, model, slots, args.seed, args.timeout)
        noisy_quota = args.noisy_quota_share * capacity * 60.0
        bar.update()
        tqdm.write(f"capacity: {capacity:.2f} batch requests/s at {slots} in flight", file=sys.stderr)
        cluster.delete("bench-flow")
        base = cluster.deploy(
            app_args(
                args.model,
                args.replicas,
                args.slots_per_replica,
                tenant_file(noisy_quota),
                p.queue_budget_s,
                p.reserved_slots,
            ),
            "bench-flow",
            num_replicas=args.replicas,
            timeout_s=args.timeout,
            api_key=api_key(INTERACTIVE),
        )
        interactive = args.interactive_share * capacity
        overload = args.overload * capacity
        loads = {
            "alone": {INTERACTIVE: interactive},
            "overload": {INTERACTIVE: interactive, BATCH: overload},
            "fair": {INTERACTIVE: interactive, BATCH_A: overload / 2, BATCH_B: overload / 2},
            "noisy": {
                INTERACTIVE: interactive,
                BATCH_A: overload / 2,
                BATCH_B: overload / 2,
                NOISY: 3 * noisy_quota / 60,
            },
            # The noisy tenant sending exactly its quota: what the others pay for its allowed share.
            "noisy_at_quota": {
                INTERACTIVE: interactive,
                BATCH_A: overload / 2,
                BATCH_B: overload / 2,
                NOISY: noisy_quota / 60,
            },
        }
        for i, (phase, rates) in enumerate(loads.items()):
            arrivals = schedule(rates, args.duration_s, model, args.seed + i)
            records[phase] = asyncio.run(send_schedule(base, arrivals, with_keys=True, timeout_s=args.timeout))
            phases[phase] = summarize(records[phase])
            bar.update()
            tqdm.write(f"{phase}: {_line(phases[phase])}", file=sys.stderr)
        text = scrape_metrics(base)
        fairness_gauge = sum_samples(text, "prefixserve_router_flow_fairness_index") or None
        cluster.delete("bench-flow")
        base = cluster.deploy(
            app_args(args.model, args.replicas, args.slots_per_replica, None, p.queue_budget_s),
            "bench-no-flow",
            num_replicas=args.replicas,
            timeout_s=args.timeout,
        )
        arrivals = schedule(loads["overload"], args.duration_s, model, args.seed + 1)
        records["overload_no_flow"] = asyncio.run(
            send_schedule(base, arrivals, with_keys=False, timeout_s=args.timeout)
        )
        phases["overload_no_flow"] = summarize(records["overload_no_flow"])
        bar.update()
        tqdm.write(f"overload_no_flow: {_line(phases['overload_no_flow'])}", file=sys.stderr)
        bar.close()

    alone = phases["alone"][INTERACTIVE].ttft_p50_s
    targets = Targets(
        interactive_ttft_vs_alone=ratio(phases["overload"][INTERACTIVE].ttft_p50_s, alone),
        batch_completed=f"{phases['overload'][BATCH].ok}/{phases['overload'][BATCH].sent}",
        noisy_admitted_vs_quota=admitted_rate_ratio(records["noisy"], NOISY, noisy_quota, args.duration_s),
        others_ttft_vs_without_noisy={
            t: ratio(phases["noisy"][t].ttft_p50_s, phases["fair"][t].ttft_p50_s)
            for t in (INTERACTIVE, BATCH_A, BATCH_B)
        },
        others_ttft_over_vs_at_quota={
            t: ratio(phases["noisy"][t].ttft_p50_s, phases["noisy_at_quota"][t].ttft_p50_s)
            for t in (INTERACTIVE, BATCH_A, BATCH_B)
        },
        jain_equal_tenants=backlogged_jain(records["fair"], [BATCH_A, BATCH_B]),
        no_flow_interactive_ttft_vs_alone=ratio(phases["overload_no_flow"][INTERACTIVE].ttft_p50_s, alone),
    )
    title = (
        f"{args.replicas} replicas x {args.slots_per_replica} slots, model {Path(args.model).name}, capacity "
        f"{capacity:.2f} req/s, overload {args.overload:g}x for {args.duration_s:g} s"
    )
    print(f"\n## Flow control: {title}\n")
    print(render_phases(phases))
    print()
    print(render_targets(targets, fairness_gauge))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config_json(args),
        "capacity_requests_per_s": capacity,
        "noisy_quota_per_minute": noisy_quota,
        "phases": {ph: {t: s.to_json() for t, s in per.items()} for ph, per in phases.items()},
        "targets": asdict(targets),
        "fairness_index_gauge": fairness_gauge,
        "wall_s": time.perf_counter() - started,
    }
    json_path = write_json(args.out_dir / "bench_flow.json", payload, announce=False)
    png_path = args.out_dir / "bench_flow.png"
    plot(phases, png_path, title)
    print(f"\nwrote {json_path} and {png_path}")
    unexpected = sum(
        n
        for phase, per in phases.items()
        for tenant, s in per.items()
        for status, n in s.refused.items()
        if not (tenant == NOISY and status == "429")
    )
    return 1 if unexpected else 0


def _line(per: Mapping[str, TenantSummary]) -> str:
    return ", ".join(
        f"{t} {s.ok}/{s.sent} TTFT p50 {fmt(s.ttft_p50_s, '.3f')}s" + (f" refused {s.refused}" if s.refused else "")
        for t, s in per.items()
    )


def render_phases(phases: Mapping[str, Mapping[str, TenantSummary]]) -> str:
    rows = [
        (
            phase,
            tenant,
            f"{s.ok}/{s.sent}",
            ", ".join(f"{k}: {v}" for k, v in s.refused.items()) or "-",
            fmt(s.ttft_p50_s and s.ttft_p50_s * 1000, ".0f"),
            fmt(s.ttft_p90_s and s.ttft_p90_s * 1000, ".0f"),
            s.tokens,
        )
        for phase, per in phases.items()
        for tenant, s in per.items()
    ]
    return markdown_table(
        ["phase", "tenant", "ok/sent", "refused", "TTFT p50 ms", "TTFT p90 ms", "tokens served"], rows, "llrrrrr"
    )


def render_targets(t: Targets, fairness_gauge: float | None) -> str:
    rows: list[tuple[str, str, str]] = [
        ("interactive TTFT p50 under overload / alone", fmt(t.interactive_ttft_vs_alone, ".2f"), "<= 1.5"),
        ("the same without flow control", fmt(t.no_flow_interactive_ttft_vs_alone, ".2f"), "(comparison)"),
        ("batch requests completed under overload", t.batch_completed, "all"),
        ("noisy tenant's admitted rate / its quota", fmt(t.noisy_admitted_vs_quota, ".3f"), "0.9-1.1"),
        *(
            (f"{tenant} TTFT p50 with the noisy tenant / without", fmt(v, ".2f"), "<= 1.2")
            for tenant, v in t.others_ttft_vs_without_noisy.items()
        ),
        *(
            (f"{tenant} TTFT p50, noisy tenant at 3x its quota / at its quota", fmt(v, ".2f"), "(isolation)")
            for tenant, v in t.others_ttft_over_vs_at_quota.items()
        ),
        ("Jain's index, equal-weight batch tenants (backlogged)", fmt(t.jain_equal_tenants, ".3f"), ">= 0.9"),
        ("Jain's index, the ingress's gauge at the end", fmt(fairness_gauge, ".3f"), "(all tenants, last minute)"),
    ]
    return markdown_table(["target", "measured", "wanted"], rows, "lrr")


def plot(phases: Mapping[str, Mapping[str, TenantSummary]], path: Path, title: str) -> None:
    """TTFT p50 of each tenant, grouped by phase."""
    tenants = sorted({t for per in phases.values() for t in per})
    with figure(path, 120, figsize=(9, 4.5)) as (_, ax):
        ax.set_title(title, fontsize=9)
        width = 0.8 / max(1, len(tenants))
        for j, tenant in enumerate(tenants):
            xs = [i + j * width for i in range(len(phases))]
            ys = [((per.get(tenant) and per[tenant].ttft_p50_s) or 0) * 1000 for per in phases.values()]
            ax.bar(xs, ys, width, label=tenant)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], list(phases), rotation=15)
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.legend()


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
