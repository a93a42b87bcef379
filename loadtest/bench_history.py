"""Conversation routing costs: the router's prompt hashing per request, and the history index's bound.

Job: two measurements behind docs/benchmarks/routing_conversations.md.

* ``hashing``: CPU time per request of replica/contract/prompt_blocks.py at 1k, 8k and
  32k-token chat prompts (about 4 characters a token), cold (no earlier turn
  seen: every message hashed) and warm (the previous turn seen: only the new
  messages hashed, the rest from the cache), beside ``json.loads`` of the same
  body (what the ingress already pays to parse it) and ``placed``'s decision on
  64 replicas with that history (index lookup and record included).
* ``bound``: ``requests`` synthetic conversation turns (Zipf apps, sessions of
  geometric length, a few new blocks per turn) through ``Placed.rank`` with
  histories on 64 replicas, ``history_max_entries`` at its default; the
  index size is sampled every 1,000 requests and must never exceed the bound.

``python -m prefixserve.loadtest.bench_history [--requests 1000000]``. Pure Python.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from prefixserve.loadtest.harness.report import markdown_header, markdown_row
from prefixserve.replica.contract.prompt_blocks import PromptHasher
from prefixserve.router.policies import Placed, Replica
from prefixserve.router.policies.history import DEFAULT_MAX_ENTRIES

CHARS_PER_TOKEN = 4


def conversation(tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """A chat history of about ``tokens`` tokens: a system prompt, then user / assistant turns."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10_000)}" for _ in range(4096)]

    def text(n_tokens: int) -> str:
        out, size = [], 0
        while size < n_tokens * CHARS_PER_TOKEN:
            w = rng.choice(words)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    messages = [{"role": "system", "content": text(min(1000, tokens // 4))}]
    left = tokens - min(1000, tokens // 4)
    turn = 0
    while left > 0:
        n = min(left, 150 if turn % 2 == 0 else 350)
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text(n)})
        left -= n
        turn += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": text(30)})
    return messages


def _cpu_per_call(fn: Any, repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats


def _bench_size(tokens: int, repeats: int, replicas: Sequence[Replica]) -> dict[str, float]:
    messages = conversation(tokens)
    body = json.dumps({"model": "m", "messages": messages})
    cold = _cpu_per_call(lambda: PromptHasher(cache_messages=0).message_blocks(messages), repeats)
    hasher = PromptHasher()
    hasher.message_blocks(messages[:-2])  # the previous turn
    warm = _cpu_per_call(lambda: hasher.message_blocks(messages), repeats)
    parse = _cpu_per_call(lambda: json.loads(body), repeats)
    blocks = hasher.message_blocks(messages)
    policy = Placed(clock=lambda: 0.0)
    policy.rank(replicas, "app", history=blocks.hashes, static_blocks=blocks.static_blocks)

    def decide() -> None:
        policy.rank(replicas, "app", history=blocks.hashes, static_blocks=blocks.static_blocks)
        policy.done("app")

    rank = _cpu_per_call(decide, repeats)
    return {
        "tokens": tokens,
        "chars": len(body),
        "blocks": len(blocks.hashes),
        "hash_cold_us": cold * 1e6,
        "hash_warm_us": warm * 1e6,
        "json_loads_us": parse * 1e6,
        "rank_us": rank * 1e6,
    }


def bench_hashing(sizes: Sequence[int] = (1000, 8000, 32000), repeats: int = 50) -> list[dict[str, float]]:
    """CPU microseconds per request at each prompt size (see the module docstring)."""
    replicas = [Replica(f"r{i}", i % 5) for i in range(64)]
    return [_bench_size(tokens, repeats, replicas) for tokens in sizes]


def bench_bound(
    requests: int = 1_000_000,
    num_replicas: int = 64,
    num_apps: int = 200,
    seed: int = 0,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    in_flight_per_replica: int = 8,
) -> dict[str, Any]:
    """Feed ``requests`` synthetic conversation turns to ``placed``; the index size over the run."""
    rng = random.Random(seed)
    policy = Placed(clock=lambda: 0.0, history_max_entries=max_entries)
    assert policy.history is not None
    names = [f"r{i}" for i in range(num_replicas)]
    in_flight = dict.fromkeys(names, 0)
    outstanding: deque[tuple[str, str]] = deque()
    weights = [1.0 / (a + 1) for a in range(num_apps)]
    static = {a: [rng.randbytes(16) for _ in range(rng.randrange(8, 64))] for a in range(num_apps)}
    live: list[tuple[str, list[bytes], int]] = []  # (key, history, turns left)
    sizes: list[int] = []
    started = time.perf_counter()
    for i in range(requests):
        if not live or rng.random() < 0.2:
            app = rng.choices(range(num_apps), weights)[0]
            live.append((f"app-{app}", list(static[app]), max(1, int(rng.expovariate(1 / 6)))))
        j = rng.randrange(len(live))
        key, hist, left = live[j]
        hist = hist + [rng.randbytes(16) for _ in range(rng.randrange(1, 12))]
        static_blocks = len(static[int(key[4:])])
        views = [Replica(n, in_flight[n]) for n in names]
        chosen = policy.rank(views, key, history=hist, static_blocks=static_blocks).chosen.name
        in_flight[chosen] += 1
        outstanding.append((chosen, key))
        if len(outstanding) > in_flight_per_replica * num_replicas:
            done, done_key = outstanding.popleft()
            in_flight[done] -= 1
            policy.done(done_key)
        if left > 1:
            live[j] = (key, hist, left - 1)
        else:
            live[j] = live[-1]
            live.pop()
        if i % 1000 == 0:
            sizes.append(len(policy.history))
    return {
        "requests": requests,
        "bound": max_entries,
        "max_entries_seen": max(sizes),
        "final_entries": len(policy.history),
        "evictions": policy.history.evictions,
        "wall_s": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixserve.loadtest.bench_history", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000, help="requests of the bound run (0: skip)")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    header = (
        "prompt tokens | body chars | blocks | hash cold (us) | hash warm (us) | json.loads (us)"
        " | placed rank, 64 replicas (us)"
    )
    print(markdown_header(header, "rrrrrrr"))
    for r in bench_hashing(repeats=args.repeats):
        timings = (f"{r[k]:.0f}" for k in ("hash_cold_us", "hash_warm_us", "json_loads_us", "rank_us"))
        print(markdown_row([f"{r['tokens']:,}", f"{r['chars']:,}", r["blocks"], *timings]), flush=True)
    if args.requests:
        b = bench_bound(args.requests)
        print(
            f"\nbound run: {b['requests']:,} requests, bound {b['bound']:,} entries, at most "
            f"{b['max_entries_seen']:,} seen, {b['final_entries']:,} at the end, {b['evictions']:,} evicted, "
            f"{b['wall_s']:.0f} s wall"
        )
        if b["max_entries_seen"] > b["bound"]:
            print("the index outgrew its bound", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
