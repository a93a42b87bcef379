"""Percentiles, latency summaries and ratios of a benchmark's samples, and the difference of two
sets of runs' medians with its bootstrap interval.

Three percentile definitions are in use and all are kept, since a benchmark's
published figures depend on the one it has always used: :func:`percentile`
interpolates between ranks (numpy's default); :func:`nearest_rank` and
:func:`floor_rank` pick a sample, at rank ``ceil(q n) - 1`` and ``floor(q n)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is unknown or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by nearest rank: always one of the samples; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def floor_rank(values: Sequence[float], q: float) -> float | None:
    """The sorted sample at index ``floor(q / 100 * n)`` (the last for q = 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def median_run(runs: Sequence[Mapping[str, Any]], key: str = "requests_per_s") -> Mapping[str, Any]:
    """Of repeated runs, the one whose ``key`` is the median (the upper middle for an even count)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of ``values_s`` (seconds) in milliseconds; all None for no values."""
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values_s) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
    }


@dataclass(frozen=True)
class MedianDifference:
    """The medians of two routers' per-run figures and their difference, with its bootstrap interval.

    low, high: the percentile bootstrap's ``confidence`` interval of the difference (each
    sample resampled with replacement, independently); an interval holding 0 says the runs
    cannot tell the two apart. a_lower_share: of every (a, b) pair of runs, the share where
    a's figure is the lower (ties count half: the Mann-Whitney U over the pairs).
    """

    a_median: float
    b_median: float
    low: float
    high: float
    a_lower_share: float

    @property
    def difference(self) -> float:
        """``median(a) - median(b)``."""
        return self.a_median - self.b_median


def median_difference(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> MedianDifference:
    """The difference of the medians of ``a`` and ``b`` with a seeded percentile-bootstrap interval
    (numpy suffices for one interval; scipy.stats.bootstrap would be a dependency for it alone)."""
    if not a or not b:
        raise ValueError("both samples need at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    ma = np.median(xa[rng.integers(0, len(xa), (resamples, len(xa)))], axis=1)
    mb = np.median(xb[rng.integers(0, len(xb), (resamples, len(xb)))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ma - mb, [tail, 100 - tail])
    pairs = xa[:, None] - xb[None, :]
    share = (np.count_nonzero(pairs < 0) + 0.5 * np.count_nonzero(pairs == 0)) / pairs.size
    return MedianDifference(float(np.median(xa)), float(np.median(xb)), float(low), float(high), float(share))
