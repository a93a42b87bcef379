"""Migration benchmark: kill an engine replica mid-stream and see every stream finish, token for token.

``python -m prefixserve.loadtest.bench_migration`` brings up a local Ray cluster (``--replicas``
engine replicas behind the ingress) and, for each mode (``migrate``: the ingress continues a stream
whose replica died on another one, router/serve/ingress.py; ``off``: ``migrate_streams: false``, as
before), alternated ``--runs`` times, each run on a fresh deployment:

1. **prefill**: each of ``--streams`` prompts (``--prompt-tokens`` each, its own) alone, one token
   asked, under a cache salt of its own: one cold prefill of that prompt, its TTFT;
2. **reference**: the ``--streams`` requests, streamed concurrently and greedy, undisturbed (another
   cache salt): the text each must have;
3. **killed**: the same requests again, without a salt; once every stream on the victim (the replica
   serving most of them) has ``--kill-after`` tokens, the victim's actor is killed.

Figures: streams finished, streams whose text equals the reference (``--json-share`` of them under a
JSON schema, whose answers must also parse and validate), and for the streams the victim was serving,
the extra latency of the move: the gap in the stream across the kill, less the stream's median gap
before it; against one cold prefill of its prompt (the p99 of those ratios is the figure the
migration target bounds by 2), and the p99 over the cold prefills of every moved stream together:
the work the replica they move to must do when no KV tier holds their blocks. With ``--kv-disk-gb``
the engines share a disk tier, to which the victim wrote their blocks as it computed them. Writes a
markdown table, results/bench_migration[_disk].json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from prefixserve.loadtest.cluster_run import LocalServeCluster, scrape_metrics, served_model
from prefixserve.loadtest.harness.cli import alternated, cluster_parser, plan_and_run
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_runs
from prefixserve.loadtest.harness.sse import aiter_events
from prefixserve.loadtest.harness.stats import nearest_rank, ratio
from prefixserve.loadtest.workloads import words_text
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.router.serve.metrics import sum_samples

MODES = ("migrate", "off")
APP = "bench-migration"
# The JSON streams' schema: a list of digits (long enough to be mid-stream at the kill); their
# max_tokens is JSON_TOKENS_FACTOR times the others', room for the whitespace a model may put between.
DIGITS_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 30,
    "maxItems": 30,
}
JSON_TOKENS_FACTOR = 3


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    index: int
    json: bool
    replica: str | None = None
    text: str = ""
    finished: bool = False
    error: str | None = None
    # When each content chunk arrived (perf_counter).
    chunk_times: list[float] = field(default_factory=list)
    # The usage's cached prompt tokens: for a moved stream, what its last replica found cached.
    cached_tokens: int = 0


@dataclass
class RunResult:
    mode: str
    run: int
    streams: int
    on_victim: int
    finished: int
    equal_to_reference: int
    json_valid: int
    json_streams: int
    migrations: float
    prefill_p50_s: float
    # The cold prefills of every stream the victim served, summed.
    moved_prefill_s: float
    # Per stream the victim served: the extra latency of its move, and that over its prompt's cold prefill.
    extra_latency_s: list[float]
    extra_over_prefill: list[float]
    # The moved streams' prompt tokens their last replica found cached (a KV tier's blocks included).
    moved_cached_tokens: list[int]

    @property
    def extra_over_prefill_p99(self) -> float | None:
        return nearest_rank(self.extra_over_prefill, 99)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "extra_over_prefill_p99": self.extra_over_prefill_p99}


def app_args(model: str, replicas: int, mode: str, disk: Path | None, disk_gb: float) -> dict[str, Any]:
    """The deployment; with ``disk`` the engines share a disk tier there (and a host tier each), so a
    moved stream's blocks, written behind by the replica that died, are read rather than computed."""
    engine: dict[str, Any] = {"model": model}
    if disk is not None:
        engine.update(kv_offloading_size=disk_gb, kv_disk_path=str(disk), kv_disk_size_gb=disk_gb)
    return {
        "engine": engine,
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 1},
        "router": {"policy": "placed"},
        "ingress": {"num_replicas": 1, "migrate_streams": mode == "migrate"},
    }


def bodies(model: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One chat per stream: its own system prompt (its own routing key) and question, greedy."""
    rng = random.Random(seed)
    out = []
    for i in range(args.streams):
        body: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": f"Session {i}. " + words_text(rng, args.prompt_tokens)},
                {"role": "user", "content": "Go on."},
            ],
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        if i < round(args.json_share * args.streams):
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "d", "schema": DIGITS_SCHEMA}}
            body["max_tokens"] = JSON_TOKENS_FACTOR * args.max_tokens
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


async def stream(client: httpx.AsyncClient, out: Stream, body: dict[str, Any]) -> None:
    """Stream ``body``, filling ``out`` as its chunks arrive (so a watcher can read it meanwhile)."""
    try:
        streamed_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=streamed_body) as response:
            out.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for event in aiter_events(response.aiter_lines()):
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    continue
                usage = event.get("usage") or {}
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or out.cached_tokens
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        out.chunk_times.append(time.perf_counter())
                        out.text += piece
                    if choice.get("finish_reason"):
                        out.finished = True
    except httpx.HTTPError as exc:
        out.error = repr(exc)


async def prefill_times(client: httpx.AsyncClient, requests: list[dict[str, Any]]) -> list[float]:
    """Each prompt's cold prefill alone: the latency of one token under a salt no other request has."""
    times = []
    for i, body in enumerate(requests):
        plain = {k: v for k, v in body.items() if k != "response_format"}
        started = time.perf_counter()
        response = await client.post(
            "/v1/chat/completions", json={**plain, "max_tokens": 1, "cache_salt": f"prefill-{i}"}
        )
        if response.status_code != 200:
            raise RuntimeError(f"prefill probe: HTTP {response.status_code}: {response.text[:300]}")
        times.append(time.perf_counter() - started)
    return times


async def streamed(client: httpx.AsyncClient, requests: list[dict[str, Any]], salt: str | None) -> list[Stream]:
    records = [Stream(i, "response_format" in b) for i, b in enumerate(requests)]
    extra = {"cache_salt": salt} if salt is not None else {}
    await asyncio.gather(*(stream(client, r, {**b, **extra}) for r, b in zip(records, requests, strict=True)))
    return records


def engine_actors() -> dict[str, str]:
    """Each engine replica's ring name -> its actor's name."""
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name=APP)
    return dict(handle.broadcast("replica_names").results(timeout_s=60))


async def killed(
    client: httpx.AsyncClient, requests: list[dict[str, Any]], kill_after: int, timeout_s: float
) -> tuple[list[Stream], str, float]:
    """Stream every request; once all have started, kill the replica serving most of them as soon
    as each of its streams has ``kill_after`` chunks (or finished). The streams, the victim and
    when it was killed (perf_counter)."""
    import ray

    records = [Stream(i, "response_format" in b) for i, b in enumerate(requests)]
    tasks = [asyncio.create_task(stream(client, r, b)) for r, b in zip(records, requests, strict=True)]
    deadline = time.perf_counter() + timeout_s
    while not all(r.replica or r.error or t.done() for r, t in zip(records, tasks, strict=True)):
        if time.perf_counter() > deadline:
            raise TimeoutError("the streams did not all start")
        await asyncio.sleep(0.01)
    counts: dict[str, int] = {}
    for r in records:
        if r.replica:
            counts[r.replica] = counts.get(r.replica, 0) + 1
    victim = max(sorted(counts), key=lambda name: counts[name])
    actor = (await asyncio.to_thread(engine_actors))[victim]
    mine = [r for r in records if r.replica == victim]
    while not all(len(r.chunk_times) >= kill_after or r.finished or r.error for r in mine):
        if time.perf_counter() > deadline:
            raise TimeoutError("the victim's streams did not reach --kill-after")
        await asyncio.sleep(0.005)
    killed_at = time.perf_counter()
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=False)
    await asyncio.gather(*tasks)
    return records, victim, killed_at


def move_gap(s: Stream, killed_at: float) -> float | None:
    """The extra latency of a stream's move: its gap across the kill less its median gap before."""
    before = [t for t in s.chunk_times if t <= killed_at]
    after = [t for t in s.chunk_times if t > killed_at]
    if len(before) < 2 or not after:
        return None
    usual = statistics.median(b - a for a, b in zip(before, before[1:]))
    return after[0] - before[-1] - usual


def json_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), DIGITS_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def run_mode(base: str, model: str, mode: str, seed: int, args: argparse.Namespace) -> RunResult:
    requests = bodies(model, args, seed)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        prefills = await prefill_times(client, requests)
        reference = await streamed(client, requests, salt="reference")
        bad = [r for r in reference if r.error or not r.finished]
        if bad:
            raise RuntimeError(f"the undisturbed run failed: {bad[0].error}")
        records, victim, killed_at = await killed(client, requests, args.kill_after, args.timeout)
    metrics = await asyncio.to_thread(scrape_metrics, base)
    on_victim = [r for r in records if r.replica == victim]
    gaps = [(r.index, g) for r in on_victim if r.finished and (g := move_gap(r, killed_at)) is not None]
    json_records = [r for r in records if r.json]
    return RunResult(
        mode=mode,
        run=seed,
        streams=len(records),
        on_victim=len(on_victim),
        finished=sum(1 for r in records if r.finished and r.error is None),
        equal_to_reference=sum(
            1 for r, ref in zip(records, reference, strict=True) if r.error is None and r.text == ref.text
        ),
        json_valid=sum(1 for r in json_records if r.error is None and json_valid(r.text)),
        json_streams=len(json_records),
        migrations=sum_samples(metrics, "prefixserve_router_stream_migrations_total", {"result": "migrated"}),
        prefill_p50_s=statistics.median(prefills),
        moved_prefill_s=sum(prefills[r.index] for r in on_victim),
        extra_latency_s=[g for _, g in gaps],
        extra_over_prefill=[g / prefills[i] for i, g in gaps],
        moved_cached_tokens=[r.cached_tokens for r in on_victim],
    )


def build_parser() -> argparse.ArgumentParser:
    p = cluster_parser("bench_migration", __doc__ or "")
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=400, help="each stream's system prompt")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kill-after", type=int, default=40, help="chunks every victim's stream has when it dies")
    p.add_argument("--json-share", type=float, default=0.25, help="share of the streams under a JSON schema")
    p.add_argument(
        "--kv-disk-gb",
        type=float,
        default=0.0,
        help="a shared disk tier of this size (GiB) for the engines, and a host tier as large (0: none)",
    )
    p.add_argument("--runs", type=int, default=2, help="runs of each mode, alternated")
    return p


def plan(args: argparse.Namespace) -> None:
    for name in ("replicas", "streams", "prompt_tokens", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.replicas < 2:
        raise ValueError("--replicas must be >= 2: a stream needs a replica to move to")
    if not 1 <= args.kill_after < args.max_tokens:
        raise ValueError("--kill-after must be in [1, --max-tokens)")
    if not 0 <= args.json_share <= 1:
        raise ValueError("--json-share must be in [0, 1]")
    if args.kv_disk_gb < 0:
        raise ValueError("--kv-disk-gb must be >= 0")


def run(args: argparse.Namespace, _: None) -> int:
    started = time.perf_counter()
    results: list[RunResult] = []
    order = alternated(MODES, args.runs)
    with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
        bar = tqdm(total=len(order), desc="runs", unit="run", file=sys.stderr)
        for i, mode in order:
            disk = None
            if args.kv_disk_gb > 0:
                disk = Path(tempfile.mkdtemp(prefix="bench-migration-kv-"))
            base = cluster.deploy(
                app_args(args.model, args.replicas, mode, disk, args.kv_disk_gb),
                APP,
                num_replicas=args.replicas,
                timeout_s=args.timeout,
            )
            result = asyncio.run(run_mode(base, served_model(base), mode, args.seed + i, args))
            results.append(result)
            cluster.delete(APP)
            if disk is not None:
                shutil.rmtree(disk, ignore_errors=True)
            bar.update()
            tqdm.write(
                f"run {i} {mode}: {result.finished}/{result.streams} finished, "
                f"{result.equal_to_reference} equal to the reference, {result.on_victim} on the victim, "
                f"move/prefill p99 {fmt(result.extra_over_prefill_p99, '.2f')}",
                file=sys.stderr,
            )
        bar.close()
    title = (
        f"{args.replicas} replicas, {args.streams} streams x {args.max_tokens} tokens "
        f"({args.prompt_tokens}-token prompts, {args.json_share:.0%} JSON), kill after {args.kill_after}"
        + (f", shared disk tier {args.kv_disk_gb:g} GiB" if args.kv_disk_gb > 0 else ", no KV tier")
    )
    print(f"\n## A replica killed mid-stream: {title}\n")
    print(render(results))
    stem = "bench_migration_disk" if args.kv_disk_gb > 0 else "bench_migration"
    json_path = write_runs(args, stem, (r.to_json() for r in results), started)
    png_path = args.out_dir / f"{stem}.png"
    plot(results, png_path, title)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def render(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.mode,
            str(r.run),
            f"{r.finished}/{r.streams}",
            f"{r.equal_to_reference}/{r.streams}",
            f"{r.json_valid}/{r.json_streams}",
            str(r.on_victim),
            f"{r.migrations:.0f}",
            fmt(statistics.median(r.moved_cached_tokens) if r.moved_cached_tokens else None, ".0f"),
            fmt(r.prefill_p50_s, ".3f"),
            fmt(statistics.median(r.extra_latency_s) if r.extra_latency_s else None, ".3f"),
            fmt(nearest_rank(r.extra_latency_s, 99), ".3f"),
            fmt(r.extra_over_prefill_p99, ".2f"),
            fmt(ratio(nearest_rank(r.extra_latency_s, 99), r.moved_prefill_s), ".2f"),
        ]
        for r in results
    ]
    return markdown_table(
        [
            "mode",
            "run",
            "finished",
            "text = undisturbed",
            "JSON valid",
            "on the victim",
            "migrations",
            "moved: cached tokens p50",
            "cold prefill p50 (s)",
            "move extra p50 (s)",
            "move extra p99 (s)",
            "move / own prefill p99",
            "move p99 / all moved prefills",
        ],
        rows,
    )


def plot(results: Sequence[RunResult], path: Path, title: str) -> None:
    """Each moved stream's extra latency over its prompt's cold prefill, per run (the 2x line marked)."""
    with figure(path, 120, figsize=(8, 4.2)) as (_, ax):
        ax.set_title(title, fontsize=9)
        for x, r in enumerate(results):
            ax.scatter([x] * len(r.extra_over_prefill), r.extra_over_prefill, s=14)
        ax.axhline(2.0, linestyle="--", linewidth=1)
        ax.set_xticks(range(len(results)), [f"{r.mode} #{r.run}" for r in results])
        ax.set_ylabel("move's extra latency / cold prefill")


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
