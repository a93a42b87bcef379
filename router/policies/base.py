"""What every routing policy shares: the replica view, the decision, options, the decision kinds.

Job: a policy is one object with one method, ``rank(candidates, key) -> Decision``.
The ranking lists every candidate, best first, so that the caller can fall
back to the next one when a replica fails or refuses.

A request without a key (no static prefix) has no affinity: ring policies rank
by load (fewest in-flight first, ties by name).

Invariants: a ranking is a permutation of the candidates; the ring policies'
decisions depend only on (candidate names, weights, in-flight counts, key), so
several router processes agree without sharing state; ring membership is the
candidate set, rebuilt only when it changes. ``Decision.spilled`` tells router
metrics when the chosen replica is not the key's ring owner.

Options: each policy class declares the options it takes once, as a frozen
dataclass in its ``Options`` attribute; ``make_policy(name, **options)`` and the
policy constructors validate them (an unknown option is an error naming the
options the policy takes). Callers pass options through (``pick_options``
selects, from settings a caller has, those a policy takes) instead of
re-encoding which policy takes what.

Load: a candidate is a ReplicaView (``name``, ``in_flight``); it may also carry
an optional ``load`` attribute, a ``ReplicaLoad`` the replica reported (queue
depth, running requests, KV usage, queued prefill tokens). Policies that use it
read it through ``load_of``; without it they use ``in_flight`` alone.

Pure Python: must not import Ray, HTTP frameworks or torch. A thin adapter over
Ray Serve's RunningReplica (name = replica id, in_flight = queue length)
satisfies ReplicaView.
"""

from __future__ import annotations

import random as _random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from prefixserve.common.config_util import from_dict
from prefixserve.router.ring import RingServer


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


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica reports of its own load (optional; the ``load`` attribute of a candidate).

    num_waiting: requests queued, not yet admitted.
    num_running: requests admitted (prefilling or decoding).
    kv_usage: fraction of KV blocks in use, 0..1.
    queued_prefill_tokens: prompt tokens of the waiting requests not covered by the
        prefix cache (the prefill work ahead of a new request).
    adapters: the LoRA adapters the replica holds loaded (a request for one of them starts
        without reading the adapter's files); a vLLM server reports those its running and
        waiting requests use.
    adapter_capacity: how many adapters it holds loaded at most (prefixserve's
        ``max_cpu_loras``, vLLM's ``max_lora``); 0: unknown.
    kv_capacity_tokens: how many tokens of KV its cache holds (its blocks times their size,
        vLLM's ``cache_config_info``); 0: unknown.

    Policies read it with ``load_of(candidate)``: a candidate without a ``load``
    attribute (or with None) is known by its ``in_flight`` count alone.
    """

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int = 0
    adapters: frozenset[str] = frozenset()
    adapter_capacity: int = 0
    kv_capacity_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_waiting", "num_running", "queued_prefill_tokens", "adapter_capacity", "kv_capacity_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ReplicaLoad.{name} must be an integer >= 0, got {v!r}")
        if (
            isinstance(self.kv_usage, bool)
            or not isinstance(self.kv_usage, (int, float))
            or not (0.0 <= self.kv_usage <= 1.0)
        ):
            raise ValueError(f"ReplicaLoad.kv_usage must be a number in [0, 1], got {self.kv_usage!r}")
        if not isinstance(self.adapters, frozenset) or not all(isinstance(a, str) for a in self.adapters):
            raise ValueError(f"ReplicaLoad.adapters must be a frozenset of adapter names, got {self.adapters!r}")

    def corrected(self, own_at_report: int, own_now: int) -> ReplicaLoad:
        """This report corrected by a router's own in-flight change since it arrived.

        Both hosts (router/serve, router/standalone) apply this one rule: requests the
        router sent since count as waiting; requests that ended since come off waiting
        first, then running; neither goes below 0.
        """
        waiting, running = self.num_waiting, self.num_running
        delta = own_now - own_at_report
        if delta > 0:
            waiting += delta
        elif delta < 0:
            done = -delta
            taken = min(waiting, done)
            waiting -= taken
            running = max(0, running - (done - taken))
        return replace(self, num_waiting=waiting, num_running=running)


def load_of(candidate: object) -> ReplicaLoad | None:
    """The candidate's reported load (its optional ``load`` attribute), or None when it has none."""
    load = getattr(candidate, "load", None)
    return load if isinstance(load, ReplicaLoad) else None


def holds_adapter(candidate: object, adapter: str) -> bool:
    """Whether the candidate reported holding LoRA adapter ``adapter`` loaded."""
    load = load_of(candidate)
    return load is not None and adapter in load.adapters


def adapters_full(candidate: object) -> bool:
    """Whether the candidate reported holding as many adapters as it can (loading one evicts another)."""
    load = load_of(candidate)
    return load is not None and 0 < load.adapter_capacity <= len(load.adapters)


R = TypeVar("R", bound=ReplicaView)


@dataclass(frozen=True)
class Decision(Generic[R]):
    """A policy's answer.

    ranking: every candidate, best first.
    owner: name of the key's ring owner among the candidates (ring policies
        with a key), else None.
    kind: why the first choice was made, for metrics, where a policy says
        (``placed``: one of the KIND_* constants), else None.
    predicted_blocks / best_blocks: ``placed`` with a history: leading prompt blocks
        its index says the chosen replica holds, and the most any candidate holds.
    """

    ranking: list[R]
    owner: str | None = None
    kind: str | None = None
    predicted_blocks: int | None = None
    best_blocks: int | None = None

    @property
    def chosen(self) -> R:
        return self.ranking[0]

    @property
    def spilled(self) -> bool:
        """True when the first choice is not the key's ring owner."""
        return self.owner is not None and self.ranking[0].name != self.owner


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]: ...


# ------------------------------------------------------------------- options


@dataclass(frozen=True)
class NoOptions:
    """A policy without options (round_robin)."""


@dataclass(frozen=True)
class SeedOptions:
    """Options of the randomized policies (random, power_of_two).

    seed: seeds the policy's own generator (None: fresh OS entropy).
    rng: a generator to draw from instead (a caller sharing its RNG); wins over seed.
    """

    seed: int | None = None
    rng: _random.Random | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.rng is not None and not isinstance(self.rng, _random.Random):
            raise ValueError(f"rng must be a random.Random, got {type(self.rng).__name__}")

    def generator(self) -> _random.Random:
        return self.rng if self.rng is not None else _random.Random(self.seed)


@dataclass(frozen=True)
class RingOptions:
    """Options of the ring policies.

    weights: {replica name: ring weight}; replicas not named weigh 1.
    """

    weights: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.weights is None:
            return
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"weights must map replica names to integers, got {type(self.weights).__name__}")
        for name, weight in self.weights.items():
            if not isinstance(name, str):
                raise ValueError(f"weights keys must be replica names, got {name!r}")
            RingServer(name, weight)  # the ring's own bounds on a weight


class Configured(ABC):
    """A policy built from its declared ``Options`` (keyword arguments, checked strictly)."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions

    def __init__(self, **options: Any) -> None:
        self.options: Any = from_dict(self.Options, options, f"{self.name} policy option")

    @abstractmethod
    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        """Every candidate, best first (see the module docstring)."""


def check_candidates(candidates: Sequence[ReplicaView]) -> None:
    """ValueError unless there is at least one candidate and their names are unique."""
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate replica")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate replica names must be unique, got {names}")


def by_load(candidates: Sequence[R]) -> list[R]:
    """Fewest in-flight requests first, ties broken by name."""
    return sorted(candidates, key=lambda c: (c.in_flight, c.name))


def effective_in_flight(c: ReplicaView) -> int:
    """The in-flight count of a candidate: its own, or what it reports queued and running when more."""
    load = load_of(c)
    if load is None:
        return c.in_flight
    return max(c.in_flight, load.num_waiting + load.num_running)


# Decision kinds: ``placed``'s Decision.kind, and where a request landed relative to its key's
# ring owner and the policy's first choice (prefixserve_router_decisions_total{kind}, set by
# ``landed_kind`` below: owner, spill, fallback, no_key, no_ring).
KIND_OWNER = "owner"  # the key's ring owner (placed: where the key is placed)
KIND_PLACED = "placed"  # the key's placed primary, moved off its ring owner by a rebalance
KIND_REPLICATED = "replicated"  # another replica the (hot) key is placed on
# Moved off the owner by load: placed found no placed replica under the in-flight cap and took
# the next ring successor under it; in the metric, the policy put a replica other than the owner first.
KIND_SPILL = "spill"
KIND_FALLBACK = "fallback"  # not the policy's first choice: that replica was full or refused it
KIND_NO_KEY = "no_key"  # no routing key (no static prefix): routed by load alone
KIND_NO_RING = "no_ring"  # a key, but a policy without a ring (round_robin, random, power_of_two)
KIND_HISTORY = "history"  # the replica holding the longest cached prefix of the whole prompt
KIND_NEW_CONVERSATION = "new_conversation"  # nothing beyond the static prefix held: least loaded of the set


def landed_kind(keyed: bool, owner: str | None, first: str | None, landed: str) -> str:
    """The decision kind of a request that landed on ``landed`` (the metric's KIND_* above).

    ``keyed``: the request had a routing key; ``owner``: its key's ring owner (None without a ring);
    ``first``: the policy's first choice (None: unknown). Every host (Ray Serve, standalone) counts alike.
    """
    if not keyed:
        return KIND_NO_KEY
    if owner is not None and landed == owner:
        return KIND_OWNER
    if first is not None and landed != first:
        return KIND_FALLBACK
    return KIND_SPILL if owner is not None else KIND_NO_RING
