"""The placement table's rebalance cost: one O(keys) numpy pass over a Zipf-loaded table.

Job: the rebalance figures of docs/benchmarks/router.md.

``python -m prefixserve.loadtest.bench_placement``. Pure Python + numpy.
"""

from __future__ import annotations

import time

import numpy as np

from prefixserve.router.policies.placement import PlacementTable
from prefixserve.router.ring import HashRing


def bench_rebalance(num_keys: int = 10_000, num_replicas: int = 64, repeats: int = 50, seed: int = 0) -> float:
    """Mean microseconds of one rebalance of a Zipf-loaded table with ``num_keys`` keys (steady state)."""
    names = [f"10.0.0.{i}:8000" for i in range(num_replicas)]
    ring = HashRing(names)
    table = PlacementTable(epsilon=0.1, tau_s=300.0, hot_share=0.5)
    table.set_members(names, [1] * num_replicas, ring.successors)
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_keys + 1) ** 0.8
    keys = [f"key-{k}" for k in range(num_keys)]
    now = 0.0
    for k in keys:  # every key seen once, then Zipf traffic over 60 s
        table.record(k, now)
    for k in rng.choice(num_keys, 50_000, p=p / p.sum()).tolist():
        now += 60.0 / 50_000
        table.record(keys[k], now)
        table.observe(keys[k], 100, now)
    table.rebalance(now)
    start = time.perf_counter()
    for i in range(repeats):
        table.rebalance(now + 10.0 * (i + 1) / repeats)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    """Print one rebalance's cost at 1k, 10k and 100k keys (docs/benchmarks/router.md)."""
    for n in (1_000, 10_000, 100_000):
        print(f"rebalance, {n} keys x 64 replicas: {bench_rebalance(n):.0f} us")


if __name__ == "__main__":
    main()
