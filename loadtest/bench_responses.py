"""Responses API continuations against the same conversations sent as chat completions, through the cluster.

``python -m prefixserve.loadtest.bench_responses`` brings up a local Ray cluster (R engine
replicas behind the ingress and the placed router) and sends ``--conversations`` conversations
of ``--turns`` turns each, the conversations concurrently, two ways, alternated ``--runs``
times, each run on a fresh deployment:

* **chat**: every turn a ``/v1/chat/completions`` request carrying the whole history;
* **responses**: the first turn a ``/v1/responses`` request, every later one only its new
  input and the ``previous_response_id`` of the turn before (the ingress's response store
  expands it).

Both ways the same system prompt (``instructions``), the same user turns and greedy answers.
The figure is the hit rate of the turns after the first: cached prompt tokens over prompt
tokens (``usage.prompt_tokens_details`` / ``usage.input_tokens_details``), summed over those
turns. Writes a markdown table and results/bench_responses.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from prefixserve.loadtest.cluster_run import LocalServeCluster, served_model
from prefixserve.loadtest.harness.cli import alternated, cluster_parser, plan_and_run
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_runs
from prefixserve.loadtest.harness.stats import ratio
from prefixserve.loadtest.workloads import words_text

WAYS = ("chat", "responses")


@dataclass
class RunResult:
    """One way on a fresh deployment: the later turns' tokens, summed."""

    way: str
    run: int
    prompt_tokens: int
    cached_tokens: int
    turns: int
    wall_s: float

    @property
    def hit_rate(self) -> float | None:
        return ratio(self.cached_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def app_args(model: str, replicas: int) -> dict[str, Any]:
    return {
        "engine": {"model": model},
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 1},
        "router": {"policy": "placed"},
        "ingress": {"num_replicas": 1},
    }


def script(seed: int, conversations: int, turns: int, system_tokens: int, user_tokens: int) -> list[list[str]]:
    """Each conversation's system prompt, then its user turns."""
    rng = random.Random(seed)
    return [
        [f"You assist team {c}. " + words_text(rng, system_tokens)]
        + [words_text(rng, user_tokens) for _ in range(turns)]
        for c in range(conversations)
    ]


async def chat_conversation(
    client: httpx.AsyncClient, model: str, lines: list[str], answer_tokens: int
) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn, the whole history sent each time."""
    messages: list[dict[str, str]] = [{"role": "system", "content": lines[0]}]
    out = []
    for user in lines[1:]:
        messages.append({"role": "user", "content": user})
        body = {"model": model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"chat: HTTP {response.status_code}: {response.text[:300]}")
        answer = response.json()
        usage = answer["usage"]
        out.append((usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
    return out


async def responses_conversation(
    client: httpx.AsyncClient, model: str, lines: list[str], answer_tokens: int
) -> list[tuple[int, int]]:
    """(input tokens, cached tokens) of each turn, each later turn continuing the one before by id."""
    previous: str | None = None
    out = []
    for user in lines[1:]:
        body: dict[str, Any] = {
            "model": model,
            "instructions": lines[0],
            "input": user,
            "max_output_tokens": answer_tokens,
            "temperature": 0,
        }
        if previous is not None:
            body["previous_response_id"] = previous
        response = await client.post("/v1/responses", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"responses: HTTP {response.status_code}: {response.text[:300]}")
        answer = response.json()
        usage = answer["usage"]
        out.append((usage["input_tokens"], (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0))
        previous = answer["id"]
    return out


async def run_way(base: str, model: str, way: str, seed: int, args: argparse.Namespace) -> RunResult:
    lines = script(seed, args.conversations, args.turns, args.system_tokens, args.user_tokens)
    converse = chat_conversation if way == "chat" else responses_conversation
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout) as client:
        results = await asyncio.gather(*(converse(client, model, c, args.answer_tokens) for c in lines))
    later = [turn for turns in results for turn in turns[1:]]
    return RunResult(
        way=way,
        run=seed,
        prompt_tokens=sum(p for p, _ in later),
        cached_tokens=sum(c for _, c in later),
        turns=len(later),
        wall_s=time.perf_counter() - started,
    )


def build_parser() -> argparse.ArgumentParser:
    p = cluster_parser("bench_responses", __doc__ or "")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=150)
    p.add_argument("--user-tokens", type=int, default=30)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=2, help="runs of each way, alternated")
    return p


def plan(args: argparse.Namespace) -> None:
    for name in ("replicas", "conversations", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.turns < 2:
        raise ValueError("--turns must be >= 2: the figure is of the turns after the first")


def run(args: argparse.Namespace, _: None) -> int:
    started = time.perf_counter()
    results: list[RunResult] = []
    order = alternated(WAYS, args.runs)
    with LocalServeCluster(num_cpus=args.replicas + 1, port=args.port) as cluster:
        bar = tqdm(total=len(order), desc="runs", unit="run", file=sys.stderr)
        for i, way in order:
            base = cluster.deploy(
                app_args(args.model, args.replicas),
                "bench-responses",
                num_replicas=args.replicas,
                timeout_s=args.timeout,
            )
            result = asyncio.run(run_way(base, served_model(base), way, args.seed + i, args))
            results.append(result)
            cluster.delete("bench-responses")
            bar.update()
            tqdm.write(
                f"run {i} {way}: hit rate {fmt(result.hit_rate, '.3f')} over {result.turns} turns", file=sys.stderr
            )
        bar.close()
    print(f"\n## Continuations: {args.replicas} replicas, {args.conversations} conversations x {args.turns} turns\n")
    print(render(results))
    path = write_runs(args, "bench_responses", (r.to_json() for r in results), started)
    print(f"\nwrote {path}")
    return 0


def render(results: Sequence[RunResult]) -> str:
    rows = [
        [
            r.way,
            str(r.run),
            str(r.turns),
            f"{r.cached_tokens}/{r.prompt_tokens}",
            fmt(r.hit_rate, ".3f"),
            f"{r.wall_s:.1f}",
        ]
        for r in results
    ]
    return markdown_table(["way", "run", "later turns", "cached/prompt tokens", "hit rate", "wall (s)"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
