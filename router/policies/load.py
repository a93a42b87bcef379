"""The load-only policies: no key affinity, candidates ordered by rotation, chance or load.

* ``round_robin``: rotates over the candidates (ordered by name) per call.
* ``random``: a shuffle from the ``random.Random`` passed in.
* ``power_of_two``: Ray Serve's default; sample two, the one with fewer
  in-flight requests first.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixserve.router.policies.base import (
    Configured,
    Decision,
    NoOptions,
    R,
    SeedOptions,
    by_load,
    check_candidates,
)


def _by_name(candidates: Sequence[R]) -> list[R]:
    """The checked candidates ordered by name, so that the order they come in does not matter."""
    check_candidates(candidates)
    return sorted(candidates, key=lambda c: c.name)


class _Seeded(Configured):
    """A randomized policy: it draws from the generator its ``SeedOptions`` give."""

    Options = SeedOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._rng = self.options.generator()


class RoundRobin(Configured):
    """Rotate over the candidates, ordered by name so that the candidate order does not matter."""

    name = "round_robin"
    Options = NoOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._next = 0

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        ordered = _by_name(candidates)
        i = self._next % len(ordered)
        self._next += 1
        return Decision(ordered[i:] + ordered[:i])


class Random(_Seeded):
    """A uniformly random order, drawn from the RNG passed in (seed it for reproducible runs)."""

    name = "random"

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        ordered = _by_name(candidates)
        self._rng.shuffle(ordered)
        return Decision(ordered)


class PowerOfTwo(_Seeded):
    """Power of two choices (Ray Serve's default): of two sampled replicas, the less loaded first.

    The rest follow by load. Ties between the two go to the first sampled.
    """

    name = "power_of_two"

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        ordered = _by_name(candidates)
        if len(ordered) == 1:
            return Decision(ordered)
        a, b = self._rng.sample(ordered, 2)
        pair = [b, a] if b.in_flight < a.in_flight else [a, b]
        rest = by_load([c for c in ordered if c is not a and c is not b])
        return Decision(pair + rest)
