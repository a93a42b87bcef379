"""Warm scale events: ``bench_cluster``'s cluster gains or loses an engine replica mid-run, shared disk tier on and off.

``python -m prefixserve.loadtest.bench_scale --scale-event up|down`` brings up a local
Ray cluster (loadtest/cluster_run.py, the same app and workloads as bench_cluster.py) and,
for each row of ``--tiers`` (``off,on``) in turn, deploys the app afresh (cold caches) with
one engine replica (``up``) or two (``down``), streams the first ``--scale-at`` of the
seeded workload through it with the closed-loop client, then scales the engine deployment
to two replicas (``up``) or one (``down``) through Serve's replica-count override (the
way ``serve deploy`` scales: the other replica keeps running, its cache warm), and streams
the rest. Row ``on`` points every replica's ``kv_disk_path`` at one fresh directory (the
shared disk tier: each replica writes its computed blocks there, a drained replica its
hot ones before it exits, and a replica new to a key reads them instead of recomputing);
row ``off`` is the same run without it (both rows have the same host tier, which the disk
tier needs, and the same device pool). The router is the default (``placed``).

The client holds its next request while Serve adds or removes the replica (an event takes
1-20 s on the 2-core CPU machine; requests sent meanwhile would only go to the
replicas already there), so both rows send exactly the same requests on either side of
the event, and the windows below hold the same requests in both rows.

Per row, from the responses' usage (``cached_tokens`` / ``prompt_tokens``: tokens served
from the device pool or any tier): the hit rate over the ``--window`` requests before
the event and the ``--window`` requests after it, and the dip (before - after, in
points); how many requests in the after window went to a replica that had not served
their tenant before the event (``moved``: the keys the event moved) and their hit rate;
the disk tier's hit tokens in the after window (``prefixserve:kv_tier_hit_tokens``);
TTFT p50 in each window; the event's duration. The issue's target: the dip with the
shared tier at most 2 points. Writes ``results/bench_scale_<event>.json`` (every
request's record), ``.md`` (the table) and ``.png`` (the hit rate over a rolling window
of requests, the event marked).

The device pool holds every tenant's prefix and the in-flight requests' own blocks
(:func:`pool_blocks`): nothing is evicted, so a dip comes from keys that move, not
from capacity.

Seeded: the same seed gives the same requests in the same order in every row.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixserve.common.logs import add_verbose_flag
from prefixserve.loadtest.bench_cluster import (
    WorkloadSpec,
    _bodies,
    _record_json,
    add_workload_flags,
    app_args,
    chat_encoder,
    workload_token_counts,
)
from prefixserve.loadtest.cluster_run import (
    HITS,
    QUERIES,
    LocalServeCluster,
    replica_counters,
    scrape_metrics,
    served_model,
)
from prefixserve.loadtest.harness.cli import plan_and_run
from prefixserve.loadtest.harness.client import RequestRecord, run_load
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.stats import percentile
from prefixserve.router.policies import POLICIES
from prefixserve.router.serve.metrics import sum_samples

# Engine replicas before and after each event.
EVENTS = {"up": (1, 2), "down": (2, 1)}
TIER_ROWS = ("off", "on")
TARGET_DIP_PTS = 2.0
TIER_HIT_TOKENS = "prefixserve:kv_tier_hit_tokens_total"


# --------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """Requests ``[lo, hi)`` of a run (by send order) and what they got from the cache."""

    lo: int
    hi: int
    requests: int  # answered requests in the window
    prompt_tokens: int
    cached_tokens: int  # served from the device pool or a tier (the responses' usage)
    span_s: float  # first send to last end of the window's requests
    ttft_p50_s: float | None

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def window(records: Sequence[RequestRecord], lo: int, hi: int) -> Window:
    """The window of records with ``lo <= index < hi``; failed requests count in no sum."""
    if not 0 <= lo <= hi:
        raise ValueError(f"a window needs 0 <= lo <= hi, got [{lo}, {hi})")
    inside = [r for r in records if lo <= r.index < hi]
    ok = [r for r in inside if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return Window(
        lo=lo,
        hi=hi,
        requests=len(ok),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        span_s=(max(r.ended_s for r in inside) - min(r.sent_s for r in inside)) if inside else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
    )


@dataclass(frozen=True)
class ScaleWindows:
    """The ``width`` requests before the event (sent before request ``event_index``) and after it."""

    event_index: int
    width: int
    before: Window
    after: Window

    @property
    def dip_pts(self) -> float | None:
        """Hit rate before minus after, in points (positive: the event cost hits)."""
        b, a = self.before.hit_rate, self.after.hit_rate
        return None if a is None or b is None else 100.0 * (b - a)

    def to_json(self) -> dict[str, Any]:
        return {
            "event_index": self.event_index,
            "width": self.width,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "dip_pts": self.dip_pts,
        }


def scale_windows(records: Sequence[RequestRecord], event_index: int, width: int) -> ScaleWindows:
    """Requests ``[event_index - width, event_index)`` against ``[event_index, event_index + width)``."""
    if width < 1 or event_index < width:
        raise ValueError(f"the window ({width} requests) must be >= 1 and fit before the event (request {event_index})")
    return ScaleWindows(
        event_index,
        width,
        window(records, event_index - width, event_index),
        window(records, event_index, event_index + width),
    )


def rolling_hit_rate(records: Sequence[RequestRecord], width: int) -> list[float | None]:
    """Per request (by index), the hit rate of the answered requests among it and the ``width - 1`` before it."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    by_index = sorted(records, key=lambda r: r.index)
    prompt = [(r.prompt_tokens or 0) if r.ok else 0 for r in by_index]
    cached = [(r.cached_tokens or 0) if r.ok else 0 for r in by_index]
    out: list[float | None] = []
    p = c = 0
    for i in range(len(by_index)):
        p += prompt[i]
        c += cached[i]
        if i >= width:
            p -= prompt[i - width]
            c -= cached[i - width]
        out.append(c / p if p else None)
    return out


def stayed(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]) -> dict[str, str]:
    """Each replica after an event that it survived, by its name then -> its name before.

    Serve may give a surviving replica another rank (so another ring name) to keep the
    ranks contiguous; with no traffic during the event, a survivor's cumulative
    prefix-cache counters are what they were, so it is the one replica before with the
    same (queries, hits). A replica matching none (or no single one) is new.
    """
    out = {}
    for name, counters in after.items():
        key = (counters.get(QUERIES, 0.0), counters.get(HITS, 0.0))
        if key == (0.0, 0.0):
            continue
        matches = [n for n, c in before.items() if (c.get(QUERIES, 0.0), c.get(HITS, 0.0)) == key]
        if len(matches) == 1:
            out[name] = matches[0]
    return out


def moved(
    records: Sequence[RequestRecord], tenants: Sequence[str], windows: ScaleWindows, renames: Mapping[str, str]
) -> list[int]:
    """Indices of the after window's answered requests served by a replica new to their tenant.

    New: the replica (by its name before the event, ``renames`` from :func:`stayed`) served
    no request of that tenant before the event, or did not exist then.
    """
    held: dict[str, set[str]] = {}
    for r in records:
        if r.index < windows.event_index and r.ok and r.replica is not None:
            held.setdefault(tenants[r.index], set()).add(r.replica)
    out = []
    for r in records:
        if not (windows.after.lo <= r.index < windows.after.hi and r.ok and r.replica is not None):
            continue
        was = renames.get(r.replica)
        if was is None or was not in held.get(tenants[r.index], set()):
            out.append(r.index)
    return sorted(out)


# --------------------------------------------------------------------------- sizing


def pool_blocks(
    prefix_tokens: Mapping[str, int], requests: Sequence[tuple[str, int]], *, block_size: int, concurrency: int
) -> int:
    """One replica's device pool that holds every tenant's prefix and every in-flight request's own blocks.

    ``prefix_tokens`` and ``requests`` as bench_cluster.py's ``workload_token_counts`` gives them;
    on one replica nothing is then evicted, so hits are lost only where keys move.
    """
    if block_size < 1 or concurrency < 1:
        raise ValueError("block_size and concurrency must be >= 1")
    if not requests:
        raise ValueError("the workload has no requests")
    full = {t: n // block_size for t, n in prefix_tokens.items()}
    request_blocks = max(-(-total // block_size) for _, total in requests)
    private = max(-(-total // block_size) - full[t] for t, total in requests)
    return max(request_blocks, sum(full.values()) + concurrency * private)


# --------------------------------------------------------------------------- one row


def _disk_hits(text: str) -> float:
    return sum_samples(text, TIER_HIT_TOKENS, {"tier": "disk"})


def run_row(
    cluster: LocalServeCluster, args: argparse.Namespace, tier: str, p: Plan, disk_root: Path
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One row: deploy, the load before the event, the event, the after window, the rest; the app deleted."""
    start_replicas, end_replicas = EVENTS[args.scale_event]
    engine: dict[str, Any] = {
        "num_kv_blocks": p.num_kv_blocks,
        "block_size": args.block_size,
        "kv_offloading_size": args.host_gib,
    }
    disk = None
    if tier == "on":
        disk = Path(tempfile.mkdtemp(prefix="bench_scale_", dir=disk_root))
        engine.update(kv_disk_path=str(disk), kv_disk_size_gb=args.disk_gib)
    app = app_args(
        args.policy,
        model=args.model,
        replicas=end_replicas,
        sizing=None,
        seed=args.seed,
        epsilon=None,
        engine_extra=engine,
    )
    name = f"scale-{args.scale_event}-{tier}"
    k, w = p.event_index, args.window
    try:
        t = time.perf_counter()
        base = cluster.apply(app, name, num_replicas=start_replicas, timeout_s=args.timeout)
        deploy_s = time.perf_counter() - t
        bodies = _bodies(p.requests, served_model(base), None)
        t0 = time.perf_counter()

        def load(lo: int, hi: int) -> list[RequestRecord]:
            return run_load(base, bodies[lo:hi], args.concurrency, timeout_s=args.timeout, t0=t0, first_index=lo)

        records = load(0, k)
        at_event = scrape_metrics(base)
        t = time.perf_counter()
        cluster.apply(app, name, num_replicas=end_replicas, timeout_s=args.timeout)
        event = (t - t0, time.perf_counter() - t0)
        after_event = scrape_metrics(base)
        records += load(k, k + w)
        after_window = scrape_metrics(base)
        records += load(k + w, len(bodies))
    finally:
        try:
            cluster.delete(name)
        finally:
            if disk is not None:
                shutil.rmtree(disk, ignore_errors=True)
    windows = scale_windows(records, k, w)
    renames = stayed(replica_counters(at_event), replica_counters(after_event))
    tenants = [r.tenant for r in p.requests]
    moved_idx = set(moved(records, tenants, windows, renames))
    moved_recs = [r for r in records if r.index in moved_idx]
    moved_prompt = sum(r.prompt_tokens or 0 for r in moved_recs)
    whole = window(records, 0, len(records))
    row = {
        "tier": tier,
        "scale_event": args.scale_event,
        "replicas": [start_replicas, end_replicas],
        "deploy_s": deploy_s,
        "event_start_s": event[0],
        "event_s": event[1] - event[0],
        **windows.to_json(),
        "moved_requests": len(moved_recs),
        "moved_hit_rate": sum(r.cached_tokens or 0 for r in moved_recs) / moved_prompt if moved_prompt else None,
        "after_disk_hit_tokens": _disk_hits(after_window) - _disk_hits(after_event),
        "replicas_at_event": sorted(replica_counters(at_event)),
        "replicas_after_event": sorted(replica_counters(after_event)),
        "renamed": {new: old for new, old in renames.items() if new != old},
        "whole_run": whole.to_json(),
        "succeeded": sum(1 for r in records if r.ok),
        "requests": len(records),
        "errors": [f"request {r.index}: {r.error}" for r in records if not r.ok][:10],
    }
    return row, records


# --------------------------------------------------------------------------- output


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-row markdown table."""
    header = (
        "shared disk tier | hit rate before | hit rate after | dip (points)"
        " | moved requests (their hit rate) | disk-hit tokens after | TTFT p50 before / after (s)"
        " | event (s) | whole run | ok"
    )
    cells = [
        [
            r["tier"],
            fmt(r["before"]["hit_rate"], ".3f"),
            fmt(r["after"]["hit_rate"], ".3f"),
            fmt(r["dip_pts"], "+.1f"),
            f"{r['moved_requests']} ({fmt(r['moved_hit_rate'], '.3f')})",
            f"{r['after_disk_hit_tokens']:.0f}",
            f"{fmt(r['before']['ttft_p50_s'], '.3f')} / {fmt(r['after']['ttft_p50_s'], '.3f')}",
            f"{r['event_s']:.0f}",
            fmt(r["whole_run"]["hit_rate"], ".3f"),
            f"{r['succeeded']}/{r['requests']}",
        ]
        for r in rows
    ]
    return markdown_table(header, cells, "lrrrrrrrrr")


def verdict(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The dips side by side and whether the shared tier's is within the target."""
    dips = {r["tier"]: r["dip_pts"] for r in rows}
    on = dips.get("on")
    return {
        "dip_pts": dips,
        "target_dip_pts": TARGET_DIP_PTS,
        "target_met": None if on is None else on <= TARGET_DIP_PTS,
    }


def plot(
    series: Mapping[str, Sequence[float | None]], event_index: int, width: int, rolling: int, path: Path, title: str
) -> None:
    """Each row's hit rate over the last ``rolling`` requests against the request index, the event and its
    ``width``-request windows marked."""
    with figure(path, 120, figsize=(8.0, 4.0)) as (_, ax):
        for tier, ys in series.items():
            ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], label=f"shared disk tier {tier}")
        ax.axvline(event_index - 0.5, color="black", linestyle="--", linewidth=1, label="scale event")
        ax.axvspan(event_index - width - 0.5, event_index - 0.5, color="#4c72b0", alpha=0.08, label="before window")
        ax.axvspan(event_index - 0.5, event_index + width - 0.5, color="#c44e52", alpha=0.08, label="after window")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("request (send order)")
        ax.set_ylabel(f"hit rate, last {rolling} requests")
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title, fontsize=9)


# --------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_scale",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scale-event", required=True, choices=sorted(EVENTS), help="up: 1 -> 2 replicas; down: 2 -> 1")
    p.add_argument("--scale-at", type=float, default=0.6, help="fraction of the requests sent before the event")
    p.add_argument(
        "--window", type=int, default=36, help="requests in the windows before and after the event (hit rate, dip)"
    )
    p.add_argument("--tiers", default=",".join(TIER_ROWS), help="rows to run, in order: off, on (the shared disk tier)")
    p.add_argument("--policy", default="placed", choices=sorted(POLICIES), help="the router's policy")
    add_workload_flags(p, WorkloadSpec("shared_prefix", tenants=12, requests=160), concurrency=2)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the computed per-replica device pool")
    p.add_argument("--host-gib", type=float, default=0.25, help="host tier per replica (GiB; the disk tier needs it)")
    p.add_argument("--disk-gib", type=float, default=4.0, help="the shared disk tier's bound (GiB)")
    p.add_argument(
        "--disk-root", type=Path, default=None, help="where the shared tier's directory is made (default: the temp dir)"
    )
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request and per deployment or event")
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    add_verbose_flag(p)
    return p


@dataclass
class Plan:
    """What a run will do, validated before anything starts."""

    spec: WorkloadSpec
    requests: list[Any]  # WorkloadRequest
    tiers: list[str]
    event_index: int
    num_kv_blocks: int


def plan(args: argparse.Namespace) -> Plan:
    """Validate the options and size the pool; raises ValueError saying what to change."""
    spec = WorkloadSpec.from_args(args)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not tiers or any(t not in TIER_ROWS for t in tiers) or len(set(tiers)) != len(tiers):
        raise ValueError(f"--tiers must name rows from {TIER_ROWS}, each once; got {args.tiers!r}")
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if not args.host_gib > 0 or not args.disk_gib > 0:
        raise ValueError("--host-gib and --disk-gib must be > 0")
    if not 0.0 < args.scale_at < 1.0:
        raise ValueError(f"--scale-at must be in (0, 1), got {args.scale_at}")
    requests = spec.generate()
    k = round(args.scale_at * len(requests))
    if args.window < 1 or args.window > k or k + args.window > len(requests):
        raise ValueError(
            f"--window {args.window} must be >= 1 and fit on both sides of the event (request {k} of "
            f"{len(requests)}): lower it, move --scale-at or give more --requests"
        )
    prefix, totals = workload_token_counts(requests, chat_encoder(args.model))
    blocks = pool_blocks(prefix, totals, block_size=args.block_size, concurrency=args.concurrency)
    if args.num_kv_blocks is not None:
        request_blocks = max(-(-total // args.block_size) for _, total in totals)
        if args.num_kv_blocks < request_blocks:
            raise ValueError(f"--num-kv-blocks must hold one request: at least {request_blocks}")
        blocks = args.num_kv_blocks
    return Plan(spec, requests, tiers, k, blocks)


def _versions() -> dict[str, str]:
    import ray
    import torch

    return {"python": platform.python_version(), "ray": ray.__version__, "torch": torch.__version__}


def run(args: argparse.Namespace, p: Plan) -> int:
    """Every row on one local cluster; print, write JSON, markdown and PNG."""
    start_replicas, end_replicas = EVENTS[args.scale_event]
    rows: list[dict[str, Any]] = []
    records: dict[str, list[RequestRecord]] = {}
    failures: dict[str, str] = {}
    load_start = os.getloadavg()
    started = time.perf_counter()
    disk_root = args.disk_root if args.disk_root is not None else Path(tempfile.gettempdir())
    with LocalServeCluster(num_cpus=max(start_replicas, end_replicas) + 1, port=args.port) as cluster:
        for tier in p.tiers:
            try:
                row, recs = run_row(cluster, args, tier, p, disk_root)
            except Exception as exc:  # one row failing must not lose the other's figures
                failures[tier] = f"{type(exc).__name__}: {exc}"
                print(f"shared tier {tier}: FAILED {failures[tier]}", file=sys.stderr)
                continue
            rows.append(row)
            records[tier] = recs
            print(
                f"shared tier {tier}: before {fmt(row['before']['hit_rate'], '.3f')}, after "
                f"{fmt(row['after']['hit_rate'], '.3f')}, dip {fmt(row['dip_pts'], '+.1f')} points",
                file=sys.stderr,
            )
    load_end = os.getloadavg()
    spec = p.spec
    title = (
        f"scale {args.scale_event} ({start_replicas} -> {end_replicas} replicas) at request {p.event_index} of "
        f"{len(p.requests)}:\n{spec.name}, {spec.tenants} tenants, system {spec.system_len} tok, concurrency "
        f"{args.concurrency}, policy {args.policy}, model {Path(args.model).name}"
    )
    heading = title.replace("\n", " ")
    summary = verdict(rows)
    table = render_table(rows)
    md = (
        f"## Scale event: {heading}\n\n"
        f"Windows: the {args.window} requests before the event and the {args.window} after it. Device pool "
        f"{p.num_kv_blocks} blocks of {args.block_size} tokens per replica (every tenant's prefix fits one "
        f"replica), host tier {args.host_gib:g} GiB per replica. Load average {load_start[0]:.2f} at the "
        f"start, {load_end[0]:.2f} at the end.\n\n{table}\n\n"
        f"Dip with the shared tier: {fmt(summary['dip_pts'].get('on'), '+.1f')} points, without: "
        f"{fmt(summary['dip_pts'].get('off'), '+.1f')} points (target: with <= {TARGET_DIP_PTS:g}; "
        f"met: {summary['target_met']}).\n"
    )
    for tier, reason in failures.items():
        md += f"\nshared tier {tier} FAILED: {reason}\n"
    print("\n" + md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_scale_{args.scale_event}"
    payload = {
        "config": config_json(args),
        "workload": asdict(spec),
        "event_index": p.event_index,
        "num_kv_blocks": p.num_kv_blocks,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **_versions()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": {"start": load_start, "end": load_end},
        "rows": rows,
        "summary": summary,
        "failures": failures,
        "wall_s": time.perf_counter() - started,
        "records": {tier: [_record_json(r) for r in recs] for tier, recs in records.items()},
    }
    write_json(stem.with_suffix(".json"), payload, announce=False)
    stem.with_suffix(".md").write_text(md)
    if rows:
        # One request per tenant, in expectation, per point: narrow enough to show the dip's shape.
        rolling = max(1, min(args.window, spec.tenants))
        series = {tier: rolling_hit_rate(recs, rolling) for tier, recs in records.items()}
        plot(series, p.event_index, args.window, rolling, stem.with_suffix(".png"), title)
    print(f"wrote {stem}.json, .md" + (", .png" if rows else ""))
    return 1 if failures or any(r["succeeded"] < r["requests"] for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
