"""Retention benchmark: agent sessions, a burst of one-shot traffic, the sessions again.

``python -m prefixserve.loadtest.bench_retention`` brings up a local Ray cluster (R engine
replicas behind the ingress and the placed router) and runs Dynamo's agent-retention protocol
(ai-dynamo/dynamo#6213) on it, once with OpenAI's ``prompt_cache_retention: "24h"`` on every
session turn and once without, alternated ``--runs`` times, each run on a fresh deployment:

1. **warm**: ``--sessions`` agent sessions (one agent's system prompt, each session its own
   task) take ``--turns`` turns each, the sessions concurrently, each turn's answer and a new
   tool result appended to its history;
2. **burst**: ``--burst`` one-shot chats of ``--burst-tokens`` prompt tokens, each with its
   own system prompt, ``--burst-concurrency`` at a time: several times every replica's cache;
3. **resume**: every session takes one more turn.

The figure is the resumed turn's cached prompt tokens (``usage.prompt_tokens_details``)
summed over the sessions, against the last warm turn's (the pre-burst figure): what the
burst took from the sessions. Beside it: the resumed turn's latency, the pinned blocks and
the pin refusals the engines report. Writes a markdown table,
results/bench_retention_<eviction policy>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from prefixserve.loadtest.cluster_run import LocalServeCluster, scrape_metrics, served_model
from prefixserve.loadtest.harness.cli import alternated, cluster_parser, plan_and_run
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_runs
from prefixserve.loadtest.harness.stats import ratio
from prefixserve.loadtest.workloads import words_text
from prefixserve.replica.kv.block_pool import EVICTION_POLICIES
from prefixserve.router.serve.metrics import sum_samples

MODES = ("none", "24h")


@dataclass(frozen=True)
class Turn:
    """One chat request's outcome as the client saw it."""

    prompt_tokens: int
    cached_tokens: int
    latency_s: float


@dataclass
class RunResult:
    """One run: a mode on a fresh deployment."""

    mode: str
    run: int
    warm_last_cached: int  # the last warm turn's cached tokens, over the sessions (the pre-burst figure)
    warm_last_prompt: int
    resumed_cached: int
    resumed_prompt: int
    resumed_latency_p50_s: float
    burst_s: float
    pinned_blocks: float
    pin_refusals: float

    @property
    def resumed_vs_pre_burst(self) -> float | None:
        return ratio(self.resumed_cached, self.warm_last_cached)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "resumed_vs_pre_burst": self.resumed_vs_pre_burst}


def app_args(model: str, replicas: int, num_kv_blocks: int, eviction_policy: str) -> dict[str, Any]:
    """The deployment: ``num_kv_blocks`` per engine; one agent owns every pin, so its share is all the budget."""
    return {
        "engine": {
            "model": model,
            "num_kv_blocks": num_kv_blocks,
            "eviction_policy": eviction_policy,
            "cache_retention_budget": 0.5,
            "cache_retention_tenant_budget": 1.0,
        },
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 1},
        "router": {"policy": "placed"},
        "ingress": {"num_replicas": 1},
    }


class Session:
    """One agent session: the agent's system prompt, its task, the turns so far."""

    def __init__(self, system: str, task: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]

    def body(self, model: str, answer_tokens: int, retention: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "max_tokens": answer_tokens,
            "temperature": 0,
        }
        if retention != "none":
            body["prompt_cache_retention"] = retention
        return body


async def post_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[Turn, str]:
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    answer = response.json()
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    turn = Turn(usage["prompt_tokens"], cached, time.perf_counter() - started)
    return turn, answer["choices"][0]["message"]["content"] or ""


async def session_turn(
    client: httpx.AsyncClient, session: Session, model: str, rng: random.Random, args: argparse.Namespace, mode: str
) -> Turn:
    """One turn: the answer joins the history, then a tool result the next turn answers."""
    turn, text = await post_chat(client, session.body(model, args.answer_tokens, mode))
    session.messages.append({"role": "assistant", "content": text})
    session.messages.append({"role": "user", "content": "Tool result: " + words_text(rng, args.tool_tokens)})
    return turn


async def run_mode(base: str, model: str, mode: str, seed: int, args: argparse.Namespace) -> RunResult:
    rng = random.Random(seed)
    system = "You are a careful coding agent. " + words_text(rng, args.system_tokens)
    sessions = [Session(system, f"Task {i}: " + words_text(rng, args.tool_tokens)) for i in range(args.sessions)]
    rngs = [random.Random(seed * 1000 + i) for i in range(args.sessions)]
    limits = httpx.Limits(max_connections=args.sessions + args.burst_concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        last: list[Turn] = []
        for _ in range(args.turns):
            last = list(
                await asyncio.gather(*(session_turn(client, s, model, r, args, mode) for s, r in zip(sessions, rngs)))
            )
        burst_started = time.perf_counter()
        queue = list(range(args.burst))
        burst_rng = random.Random(seed + 7)
        texts = [(words_text(burst_rng, 40), words_text(burst_rng, args.burst_tokens)) for _ in queue]

        async def one_shots() -> None:
            while queue:
                i = queue.pop()
                system_text, question = texts[i]
                body = {
                    "model": model,
                    "messages": [{"role": "system", "content": system_text}, {"role": "user", "content": question}],
                    "max_tokens": 1,
                }
                await post_chat(client, body)

        await asyncio.gather(*(one_shots() for _ in range(args.burst_concurrency)))
        burst_s = time.perf_counter() - burst_started
        resumed = list(
            await asyncio.gather(*(session_turn(client, s, model, r, args, mode) for s, r in zip(sessions, rngs)))
        )
    metrics = await asyncio.to_thread(scrape_metrics, base)
    return RunResult(
        mode=mode,
        run=seed,
        warm_last_cached=sum(t.cached_tokens for t in last),
        warm_last_prompt=sum(t.prompt_tokens for t in last),
        resumed_cached=sum(t.cached_tokens for t in resumed),
        resumed_prompt=sum(t.prompt_tokens for t in resumed),
        resumed_latency_p50_s=statistics.median(t.latency_s for t in resumed),
        burst_s=burst_s,
        pinned_blocks=sum_samples(metrics, "prefixserve:kv_pinned_blocks"),
        pin_refusals=sum_samples(metrics, "prefixserve:kv_pin_refusals_total"),
    )


def build_parser() -> argparse.ArgumentParser:
    p = cluster_parser("bench_retention", __doc__ or "")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks (16 tokens) per engine replica")
    p.add_argument(
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        default="slru",
        help="the engines' (slru, the default, protects blocks hit again; lru is vLLM's order)",
    )
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=10, help="warm turns per session before the burst")
    p.add_argument("--system-tokens", type=int, default=200, help="the agent's system prompt")
    p.add_argument("--tool-tokens", type=int, default=30, help="each tool result a turn appends")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=160, help="one-shot chats between the warm turns and the resume")
    p.add_argument("--burst-tokens", type=int, default=400)
    p.add_argument("--burst-concurrency", type=int, default=8)
    p.add_argument("--runs", type=int, default=2, help="runs of each mode, alternated")
    return p


def plan(args: argparse.Namespace) -> None:
    for name in ("replicas", "num_kv_blocks", "sessions", "turns", "burst", "burst_concurrency", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    burst_blocks = args.burst * args.burst_tokens // 16
    if burst_blocks < 2 * args.replicas * args.num_kv_blocks:
        raise ValueError(
            f"the burst ({burst_blocks} blocks) must be at least twice the cluster's cache "
            f"({args.replicas * args.num_kv_blocks} blocks) to fill it"
        )


def run(args: argparse.Namespace, _: None) -> int:
    started = time.perf_counter()
    results: list[RunResult] = []
    order = alternated(MODES, args.runs)
    with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
        bar = tqdm(total=len(order), desc="runs", unit="run", file=sys.stderr)
        for i, mode in order:
            base = cluster.deploy(
                app_args(args.model, args.replicas, args.num_kv_blocks, args.eviction_policy),
                "bench-retention",
                num_replicas=args.replicas,
                timeout_s=args.timeout,
            )
            model = served_model(base)
            result = asyncio.run(run_mode(base, model, mode, args.seed + i, args))
            results.append(result)
            cluster.delete("bench-retention")
            bar.update()
            tqdm.write(
                f"run {i} retention {mode}: resumed {result.resumed_cached}/{result.resumed_prompt} cached tokens, "
                f"pre-burst {result.warm_last_cached}/{result.warm_last_prompt} "
                f"({fmt(result.resumed_vs_pre_burst, '.3f')}x)",
                file=sys.stderr,
            )
        bar.close()
    title = (
        f"{args.replicas} replicas x {args.num_kv_blocks} blocks ({args.eviction_policy}), "
        f"{args.sessions} sessions x {args.turns} turns, "
        f"burst {args.burst} x {args.burst_tokens} tokens"
    )
    print(f"\n## Agent sessions after a burst: {title}\n")
    print(render(results))
    stem = f"bench_retention_{args.eviction_policy}"
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
            f"{r.warm_last_cached}/{r.warm_last_prompt}",
            f"{r.resumed_cached}/{r.resumed_prompt}",
            fmt(r.resumed_vs_pre_burst, ".3f"),
            fmt(r.resumed_latency_p50_s, ".3f"),
            f"{r.pinned_blocks:.0f}",
            f"{r.pin_refusals:.0f}",
        ]
        for r in results
    ]
    return markdown_table(
        [
            "retention",
            "run",
            "pre-burst cached/prompt",
            "resumed cached/prompt",
            "resumed / pre-burst",
            "resumed latency p50 (s)",
            "pinned blocks",
            "pin refusals",
        ],
        rows,
    )


def plot(results: Sequence[RunResult], path: Path, title: str) -> None:
    """Cached share of the prompt, last warm turn against the resumed one, per run."""
    with figure(path, 120, figsize=(8, 4.2)) as (_, ax):
        ax.set_title(title, fontsize=9)
        labels = [f"{r.mode} #{r.run}" for r in results]
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [r.warm_last_cached / max(1, r.warm_last_prompt) for r in results], 0.4)
        ax.bar([x + 0.2 for x in xs], [r.resumed_cached / max(1, r.resumed_prompt) for r in results], 0.4)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("cached share of the prompt")
        ax.legend(["last warm turn", "resumed after the burst"], loc="lower center")


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
