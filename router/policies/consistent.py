"""The ring policies without placement: the consistent-hash ring alone, and the ring with bounded loads.

* ``consistent_hash``: the ring alone (router/ring.py); a replica's keys
  stay on it however loaded it is.
* ``bounded_load``: the ring with bounded loads; a key goes to its ring owner
  unless that holds ``ceil((1 + epsilon) * (n + 1) / R)`` requests, in which case
  it spills to the next ring successor under that capacity, which then caches
  the prefix too.

``RingPolicy`` keeps the ring over the candidate set; ``placed``
(router/policies/placed.py) builds on it. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prefixserve.router.policies.base import (
    Configured,
    Decision,
    R,
    ReplicaView,
    RingOptions,
    by_load,
    check_candidates,
)
from prefixserve.router.ring import DEFAULT_EPSILON, HashRing, RingServer, bounded_capacity


@dataclass(frozen=True)
class BoundedLoadOptions(RingOptions):
    """Options of bounded_load: the ring's, plus epsilon (the load slack over the mean, >= 0)."""

    epsilon: float = DEFAULT_EPSILON

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)):
            raise ValueError(f"epsilon must be a number >= 0, got {self.epsilon!r}")
        bounded_capacity(0, 1, self.epsilon)  # validates epsilon


class RingPolicy(Configured):
    """Keeps a ring over the current candidate set, rebuilt only when the set changes."""

    Options: ClassVar[type] = RingOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._weights = dict(self.options.weights or {})
        self._ring: HashRing | None = None
        self._members: tuple[tuple[str, int], ...] = ()
        self._last_names: tuple[str, ...] = ()

    def ring_for(self, candidates: Sequence[ReplicaView]) -> HashRing:
        names = tuple(c.name for c in candidates)
        if self._ring is not None and names == self._last_names:
            return self._ring  # the common case: the same candidates as last time, in the same order
        # Sorted by name: the ring must not depend on the order Ray lists replicas in.
        members = tuple(sorted((n, self._weights.get(n, 1)) for n in names))
        if self._ring is None or members != self._members:
            self._ring = HashRing([RingServer(n, w) for n, w in members])
            self._members = members
        self._last_names = names
        return self._ring

    @property
    def ring(self) -> HashRing | None:
        """The ring of the last call (for metrics: ring size)."""
        return self._ring


class ConsistentHash(RingPolicy):
    """The ring alone: the key's ring owner first, then its ring successors."""

    name = "consistent_hash"

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        check_candidates(candidates)
        if key is None:
            return Decision(by_load(candidates))
        by_name = {c.name: c for c in candidates}
        order = self.ring_for(candidates).successors(key)
        return Decision([by_name[n] for n in self._try_order(order, candidates)], owner=order[0])

    def _try_order(self, successors: list[str], candidates: Sequence[ReplicaView]) -> list[str]:
        """The key's ring successors (names of ``candidates``) in the order to try them: as they are."""
        return successors


class BoundedLoad(ConsistentHash):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    The first choice is the first ring successor of the key holding fewer than
    ``ceil((1 + epsilon) * (n + 1) / R)`` in-flight requests (n over all R
    candidates); the remaining candidates follow in ring order, those under
    capacity first. epsilon trades balance (small) against affinity (large).
    """

    name = "bounded_load"
    Options = BoundedLoadOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.epsilon = self.options.epsilon

    def _try_order(self, successors: list[str], candidates: Sequence[ReplicaView]) -> list[str]:
        """The successors under capacity first, each group in ring order."""
        in_flight = {c.name: c.in_flight for c in candidates}
        cap = bounded_capacity(sum(in_flight.values()), len(candidates), self.epsilon)
        under = [n for n in successors if in_flight[n] < cap]
        over = [n for n in successors if in_flight[n] >= cap]
        return under + over
