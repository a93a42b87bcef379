"""``placed``'s routing-decision latency: ``Placed.rank`` timed alone, as the router times it.

Job: the figures of docs/benchmarks/router.md's decision-latency table
(``prefixserve_router_decision_seconds`` measures the same call in the router).

``python -m prefixserve.loadtest.bench_policies [--replicas 2,16,64]``. Pure Python.
"""

from __future__ import annotations

import argparse
import random as _random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.loadtest.harness.report import markdown_header, markdown_row
from prefixserve.router.policies import Placed, ReplicaLoad


@dataclass(frozen=True)
class _BenchView:
    """A candidate as router/serve/request_router.py hands it to the policy (name, own in-flight, reported load)."""

    replica: Any
    name: str
    in_flight: int
    load: ReplicaLoad | None = None


def bench_rank(
    num_replicas: int = 64,
    num_keys: int = 2000,
    num_requests: int = 20_000,
    cold: bool = False,
    in_flight_per_replica: int = 8,
    rate: float = 1000.0,
    seed: int = 0,
) -> dict[str, float]:
    """Microseconds per ``Placed.rank`` call, timed alone as the router's decision-latency metric times it.

    Traffic: Zipf (s 0.8) over ``num_keys`` keys (``cold``: every request a key never
    seen, so no per-key memo helps); the first ``num_requests // 2`` requests warm the
    process up untimed (with other never-seen keys when ``cold``: the ring's per-point
    cache and the table are warm, the keys are not); ``rate`` requests per second on the
    policy's injected clock (a rebalance every 10 s of it, timed with the request that triggers it);
    ``in_flight_per_replica`` requests outstanding per replica on average; every
    candidate reports a load (queued + running) refreshed every ``num_replicas``
    requests. Fresh candidate views are built per request (outside the timing), as
    the Serve router does. Returns p50, p99, mean and max in microseconds.
    """
    rng = _random.Random(seed)
    names = [f"SERVE_REPLICA::app#Engine#{rng.getrandbits(40):010x}" for _ in range(num_replicas)]
    now = [0.0]
    policy = Placed(clock=lambda: now[0])
    weights = [1.0 / (k + 1) ** 0.8 for k in range(num_keys)]
    keys = [f"{rng.getrandbits(64):016x}" for _ in range(num_keys)]
    in_flight = [0] * num_replicas
    reported = [ReplicaLoad()] * num_replicas
    outstanding: list[int] = []
    index = {n: i for i, n in enumerate(names)}
    warmup = num_requests // 2
    stream = rng.choices(range(num_keys), weights, k=warmup + num_requests)
    times: list[float] = []
    for step, k in enumerate(stream):
        key = f"cold-{step}-{rng.getrandbits(32):08x}" if cold else keys[k]
        now[0] += rng.expovariate(rate)
        if step % num_replicas == 0:
            reported = [ReplicaLoad(max(0, f - 4), min(f, 4)) for f in in_flight]
        views = [_BenchView(None, n, in_flight[i], reported[i]) for i, n in enumerate(names)]
        start = time.perf_counter()
        decision = policy.rank(views, key)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        chosen = index[decision.chosen.name]
        in_flight[chosen] += 1
        outstanding.append(chosen)
        if len(outstanding) > in_flight_per_replica * num_replicas:
            in_flight[outstanding.pop(rng.randrange(len(outstanding)))] -= 1
    times.sort()
    n = len(times)
    return {
        "p50": times[n // 2] * 1e6,
        "p99": times[min(n - 1, (99 * n) // 100)] * 1e6,
        "mean": sum(times) / n * 1e6,
        "max": times[-1] * 1e6,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Print the decision-latency table of docs/benchmarks/router.md."""
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_policies",
        description="placed's routing-decision latency (bench_rank), median of repeats",
    )
    p.add_argument("--replicas", default="2,16,64", help="comma list of cluster sizes")
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(markdown_header("replicas | keys | p50 (us) | p99 (us) | mean (us) | runs (p50 / p99)", "rlrrrl"))
    for r in (int(s) for s in args.replicas.split(",") if s):
        for cold in (False, True):
            runs = [bench_rank(r, args.keys, args.requests, cold=cold, seed=s) for s in range(args.repeats)]
            med = {f: statistics.median(run[f] for run in runs) for f in ("p50", "p99", "mean")}
            label = "cold (every key new)" if cold else f"{args.keys} Zipf, warm"
            spread = ", ".join(f"{run['p50']:.0f}/{run['p99']:.0f}" for run in runs)
            print(markdown_row([r, label, *(f"{med[f]:.1f}" for f in ("p50", "p99", "mean")), spread]), flush=True)


if __name__ == "__main__":
    main()
