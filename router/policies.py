"""Routing policies: given candidate replicas, their in-flight counts and a key, rank them.

Job: one object per policy with one method, ``rank(candidates, key) -> Decision``.
The ranking lists every candidate, best first, so that the caller can fall
back to the next one when a replica fails or refuses.

Policies:

* ``round_robin``: rotates over the candidates (ordered by name) per call.
* ``random``: a shuffle from the ``random.Random`` passed in.
* ``power_of_two``: Ray Serve's default; sample two, the one with fewer
  in-flight requests first.
* ``consistent_hash``: the ring alone (router/ring.py); a replica's keys stay on
  it however loaded it is.
* ``bounded_load`` (the default): the ring with bounded loads; a key goes to its
  ring owner unless that holds ``ceil((1 + epsilon) * (n + 1) / R)`` requests,
  in which case it spills to the next ring successor under that capacity,
  which then caches the prefix too.

A request without a key (no static prefix) has no affinity: ring policies rank
by load (fewest in-flight first, ties by name).

Invariants: a ranking is a permutation of the candidates; the ring policies'
decisions depend only on (candidate names, weights, in-flight counts, key), so
several router processes agree without sharing state; ring membership is the
candidate set, rebuilt only when it changes. ``Decision.spilled`` tells router
metrics when the chosen replica is not the key's ring owner.

Pure Python: must not import Ray, HTTP frameworks or torch. A thin adapter over
Ray Serve's RunningReplica (name = replica id, in_flight = queue length)
satisfies ReplicaView.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from prefixserve.router.ring import DEFAULT_EPSILON, HashRing, RingServer, bounded_capacity


@runtime_checkable
class ReplicaView(Protocol):
    """What a policy needs to know of a replica: a stable name and its in-flight requests."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


@dataclass(frozen=True)
class Replica:
    """A plain ReplicaView (tests, simulators, the nginx-path tools)."""

    name: str
    in_flight: int = 0


R = TypeVar("R", bound=ReplicaView)


@dataclass(frozen=True)
class Decision(Generic[R]):
    """A policy's answer.

    ranking: every candidate, best first.
    owner: name of the key's ring owner among the candidates (ring policies
        with a key), else None.
    """

    ranking: list[R]
    owner: str | None = None

    @property
    def chosen(self) -> R:
        return self.ranking[0]

    @property
    def spilled(self) -> bool:
        """True when the first choice is not the key's ring owner."""
        return self.owner is not None and self.ranking[0].name != self.owner


class Policy(Protocol):
    name: str

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]: ...


def _check(candidates: Sequence[ReplicaView]) -> None:
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate replica")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate replica names must be unique, got {names}")


def by_load(candidates: Sequence[R]) -> list[R]:
    """Fewest in-flight requests first, ties broken by name."""
    return sorted(candidates, key=lambda c: (c.in_flight, c.name))


class RoundRobin:
    """Rotate over the candidates, ordered by name so that the candidate order does not matter."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        i = self._next % len(ordered)
        self._next += 1
        return Decision(ordered[i:] + ordered[:i])


class Random:
    """A uniformly random order, drawn from the RNG passed in (seed it for reproducible runs)."""

    name = "random"

    def __init__(self, rng: _random.Random | None = None, seed: int | None = None) -> None:
        self._rng = rng if rng is not None else _random.Random(seed)

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        self._rng.shuffle(ordered)
        return Decision(ordered)


class PowerOfTwo:
    """Power of two choices (Ray Serve's default): of two sampled replicas, the less loaded first.

    The rest follow by load. Ties between the two go to the first sampled.
    """

    name = "power_of_two"

    def __init__(self, rng: _random.Random | None = None, seed: int | None = None) -> None:
        self._rng = rng if rng is not None else _random.Random(seed)

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        if len(ordered) == 1:
            return Decision(ordered)
        a, b = self._rng.sample(ordered, 2)
        pair = [b, a] if b.in_flight < a.in_flight else [a, b]
        rest = by_load([c for c in ordered if c is not a and c is not b])
        return Decision(pair + rest)


class _RingPolicy:
    """Keeps a ring over the current candidate set, rebuilt only when the set changes."""

    def __init__(self, weights: Mapping[str, int] | None = None) -> None:
        self._weights = dict(weights or {})
        self._ring: HashRing | None = None
        self._members: tuple[tuple[str, int], ...] = ()

    def ring_for(self, candidates: Sequence[ReplicaView]) -> HashRing:
        # Sorted by name: the ring must not depend on the order Ray lists replicas in.
        members = tuple(sorted((c.name, self._weights.get(c.name, 1)) for c in candidates))
        if self._ring is None or members != self._members:
            self._ring = HashRing([RingServer(n, w) for n, w in members])
            self._members = members
        return self._ring

    @property
    def ring(self) -> HashRing | None:
        """The ring of the last call (for metrics: ring size)."""
        return self._ring


class ConsistentHash(_RingPolicy):
    """The ring alone: the key's ring owner first, then its ring successors."""

    name = "consistent_hash"

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        if key is None:
            return Decision(by_load(candidates))
        ring = self.ring_for(candidates)
        by_name = {c.name: c for c in candidates}
        order = ring.successors(key)
        return Decision([by_name[n] for n in order], owner=order[0])


class BoundedLoad(_RingPolicy):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    The first choice is the first ring successor of the key holding fewer than
    ``ceil((1 + epsilon) * (n + 1) / R)`` in-flight requests (n over all R
    candidates); the remaining candidates follow in ring order, those under
    capacity first. epsilon trades balance (small) against affinity (large).
    """

    name = "bounded_load"

    def __init__(self, epsilon: float = DEFAULT_EPSILON, weights: Mapping[str, int] | None = None) -> None:
        bounded_capacity(0, 1, epsilon)  # validates epsilon
        super().__init__(weights)
        self.epsilon = epsilon

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        if key is None:
            return Decision(by_load(candidates))
        ring = self.ring_for(candidates)
        by_name = {c.name: c for c in candidates}
        order = ring.successors(key)
        cap = bounded_capacity(sum(c.in_flight for c in candidates), len(candidates), self.epsilon)
        under = [n for n in order if by_name[n].in_flight < cap]
        over = [n for n in order if by_name[n].in_flight >= cap]
        return Decision([by_name[n] for n in under + over], owner=order[0])


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    Random.name: Random,
    PowerOfTwo.name: PowerOfTwo,
    ConsistentHash.name: ConsistentHash,
    BoundedLoad.name: BoundedLoad,
}
DEFAULT_POLICY = BoundedLoad.name


def make_policy(name: str = DEFAULT_POLICY, **kwargs) -> Policy:
    """Build a policy by name; kwargs go to its constructor (rng/seed, epsilon, weights)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for routing policy {name!r}: {e}") from None
