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

import math
import random as _random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from operator import itemgetter
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from prefixserve.common.config_util import from_dict
from prefixserve.router.history import DEFAULT_MAX_ENTRIES, HistoryIndex
from prefixserve.router.placement import PlacementTable
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


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica reports of its own load (optional; the ``load`` attribute of a candidate).

    num_waiting: requests queued, not yet admitted.
    num_running: requests admitted (prefilling or decoding).
    kv_usage: fraction of KV blocks in use, 0..1.
    queued_prefill_tokens: prompt tokens of the waiting requests not covered by the
        prefix cache (the prefill work ahead of a new request).

    Policies read it with ``load_of(candidate)``: a candidate without a ``load``
    attribute (or with None) is known by its ``in_flight`` count alone.
    """

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_waiting", "num_running", "queued_prefill_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ReplicaLoad.{name} must be an integer >= 0, got {v!r}")
        if (
            isinstance(self.kv_usage, bool)
            or not isinstance(self.kv_usage, (int, float))
            or not (0.0 <= self.kv_usage <= 1.0)
        ):
            raise ValueError(f"ReplicaLoad.kv_usage must be a number in [0, 1], got {self.kv_usage!r}")


def load_of(candidate: object) -> ReplicaLoad | None:
    """The candidate's reported load (its optional ``load`` attribute), or None when it has none."""
    load = getattr(candidate, "load", None)
    return load if isinstance(load, ReplicaLoad) else None


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


@dataclass(frozen=True)
class BoundedLoadOptions(RingOptions):
    """Options of bounded_load: the ring's, plus epsilon (the load slack over the mean, >= 0)."""

    epsilon: float = DEFAULT_EPSILON

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)):
            raise ValueError(f"epsilon must be a number >= 0, got {self.epsilon!r}")
        bounded_capacity(0, 1, self.epsilon)  # validates epsilon


class _Configured(ABC):
    """A policy built from its declared ``Options`` (keyword arguments, checked strictly)."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions

    def __init__(self, **options: Any) -> None:
        self.options: Any = from_dict(self.Options, options, f"{self.name} policy option")

    @abstractmethod
    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        """Every candidate, best first (see the module docstring)."""


def _check(candidates: Sequence[ReplicaView]) -> None:
    if not candidates:
        raise ValueError("a routing policy needs at least one candidate replica")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate replica names must be unique, got {names}")


def by_load(candidates: Sequence[R]) -> list[R]:
    """Fewest in-flight requests first, ties broken by name."""
    return sorted(candidates, key=lambda c: (c.in_flight, c.name))


class RoundRobin(_Configured):
    """Rotate over the candidates, ordered by name so that the candidate order does not matter."""

    name = "round_robin"
    Options = NoOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._next = 0

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        i = self._next % len(ordered)
        self._next += 1
        return Decision(ordered[i:] + ordered[:i])


class Random(_Configured):
    """A uniformly random order, drawn from the RNG passed in (seed it for reproducible runs)."""

    name = "random"
    Options = SeedOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._rng = self.options.generator()

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        self._rng.shuffle(ordered)
        return Decision(ordered)


class PowerOfTwo(_Configured):
    """Power of two choices (Ray Serve's default): of two sampled replicas, the less loaded first.

    The rest follow by load. Ties between the two go to the first sampled.
    """

    name = "power_of_two"
    Options = SeedOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._rng = self.options.generator()

    def rank(self, candidates: Sequence[R], key: str | None) -> Decision[R]:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        if len(ordered) == 1:
            return Decision(ordered)
        a, b = self._rng.sample(ordered, 2)
        pair = [b, a] if b.in_flight < a.in_flight else [a, b]
        rest = by_load([c for c in ordered if c is not a and c is not b])
        return Decision(pair + rest)


class _RingPolicy(_Configured):
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
    Options = BoundedLoadOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.epsilon = self.options.epsilon

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


# Decision kinds: ``placed``'s Decision.kind, and where a request landed relative to its key's
# ring owner and the policy's first choice (prefixserve_router_decisions_total{kind}, set by
# router/serve_router.decision_kind: owner, spill, fallback, no_key, no_ring).
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


BALANCE_EPSILON: float | None = None


@dataclass(frozen=True)
class PlacedOptions(RingOptions):
    """Options of ``placed`` (router/placement.py explains the mechanism).

    epsilon: slack of a replica's placed request rate over its fair share
        before it sheds keys (the hit-vs-balance dial; > 0).
    work_epsilon: the same slack for prefill work (uncached tokens, from
        ``observe``); None balances rates only.
    tau_s: time constant of the decayed per-key statistics (seconds, > 0).
    rebalance_interval_s: seconds between rebalances (> 0).
    hot_share: a key is placed on one replica per ``hot_share`` of a replica's
        fair share of the request rate it carries (0.5: a key above half a
        replica's share gets its next ring successor too).
    precise: use ``set_cached`` knowledge (which replicas hold a key's prefix).
    leader: rebalance on its own; False for a follower that only applies
        snapshots published by the leader (``apply_snapshot``).
    noise_z: rebalancing moves a key only for an excess above this many standard
        deviations of the (Poisson) request counts behind it (>= 0; 0 trusts every
        count): a young or small cluster does not pay cold prefills for noise.
    history_max_entries: bound of the router-side history index (router/history.py;
        block hashes, least recently used evicted; 0 disables history matching).
    new_epsilon: a new conversation goes to the least loaded replica of its key's
        set: the placement, grown by ring successors to one replica per ``1 +
        new_epsilon`` fair shares (mean in-flight, at least 1) of the key's own
        in-flight requests (counted by ``rank``, ended by ``done``); None keeps new
        conversations on the placement alone.
    conversation_spread: a key at least half of whose recent decisions followed a
        history (a conversational app) has its set grown by this many more ring
        successors for new conversations (0, the default: off; on small clusters with
        long static prefixes the copies thrash the caches).
    balance_epsilon: with a history, the history and new-conversation branches take
        a replica only under ``mean * (1 + balance_epsilon) + 1`` in flight (and the
        ordinary cap); past it the request falls to the placement and spill logic.
        None: the ordinary cap alone.
    clock: seconds, monotonic (default ``time.monotonic``); tests inject one.
    """

    epsilon: float = 0.2
    work_epsilon: float | None = 0.5
    tau_s: float = 300.0
    rebalance_interval_s: float = 10.0
    hot_share: float = 0.5
    precise: bool = False
    leader: bool = True
    noise_z: float = 2.0
    history_max_entries: int = DEFAULT_MAX_ENTRIES
    new_epsilon: float | None = 0.25
    conversation_spread: int = 0
    balance_epsilon: float | None = BALANCE_EPSILON
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("history_max_entries", "conversation_spread"):
            h = getattr(self, name)
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {h!r}")
        for name in (
            "epsilon",
            "work_epsilon",
            "tau_s",
            "rebalance_interval_s",
            "hot_share",
            "new_epsilon",
            "balance_epsilon",
        ):
            v = getattr(self, name)
            if name in ("work_epsilon", "new_epsilon", "balance_epsilon") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        z = self.noise_z
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"noise_z must be a finite number >= 0, got {z!r}")
        for name in ("precise", "leader"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.clock is not None and not callable(self.clock):
            raise ValueError(f"clock must be a callable returning seconds, got {self.clock!r}")


def in_flight_cap(mean: float) -> float:
    """The absolute in-flight cap of ``placed``: ``m + max(0.5 m, 3 sqrt(m)) + 1`` for mean in-flight m.

    Proportional slack at high load, sqrt slack (about 3 standard deviations of
    a Poisson count) at low load, so a busy key is not spilled on noise.
    """
    return mean + max(0.5 * mean, 3.0 * math.sqrt(mean)) + 1.0


def effective_in_flight(c: ReplicaView) -> int:
    """The in-flight count of a candidate: its own, or what it reports queued and running when more."""
    load = load_of(c)
    if load is None:
        return c.in_flight
    return max(c.in_flight, load.num_waiting + load.num_running)


# Bounds on ``placed``'s memos (a full memo is dropped and refills): its per-key ring orders in
# candidate positions hold at most this many positions in all (32 MB of references), and each key
# at most this many rankings (one per first choice and placement). Orders of ring points are the
# ring's own memo (HashRing.order).
_MAX_MEMO_POSITIONS = 4_000_000
_MAX_RANKINGS_PER_KEY = 8
# Keys whose history-branch share ``placed`` tracks (conversation_spread); the table is cleared when full.
_MAX_CONVERSATIONAL_KEYS = 200_000


class _KeyOrder:
    """A key's ring order over the current candidate list (``Placed``'s per-request memo).

    owner: the key's ring owner's name. order: candidate positions in ring order.
    rankings: (chosen, rest of placement) positions -> a getter returning the
    candidates in ranking order (chosen, rest, remaining ring order); None until
    the key's second request (a key seen once gets its ranking built directly).
    """

    __slots__ = ("owner", "order", "rankings")

    def __init__(self, owner: str, order: tuple[int, ...]) -> None:
        self.owner = owner
        self.order = order
        self.rankings: dict[tuple[int, ...], Callable[[Sequence[Any]], Any]] | None = None

    def positions(self, head: tuple[int, ...]) -> tuple[int, ...]:
        """Candidate positions in ranking order: ``head`` (chosen, rest of placement), then the ring order."""
        order = self.order
        if len(head) == 1:  # the ring order with the chosen replica moved to the front (C-level slices)
            i = order.index(head[0])
            return order if i == 0 else (order[i], *order[:i], *order[i + 1 :])
        return (*head, *(p for p in order if p not in head))

    def rank(self, head: tuple[int, ...], candidates: Sequence[R]) -> list[R]:
        """The candidates in ranking order for ``head`` (at least two candidates)."""
        rankings = self.rankings
        if rankings is None:
            self.rankings = {}
            return [candidates[p] for p in self.positions(head)]
        getter = rankings.get(head)
        if getter is None:
            if len(rankings) >= _MAX_RANKINGS_PER_KEY:
                rankings.clear()
            getter = rankings[head] = itemgetter(*self.positions(head))
        return list(getter(candidates))


class Placed(_RingPolicy):
    """Ring-placed bounded loads (the default): keys placed on ring replicas, hot keys replicated.

    Per request: the key's request is counted (router/placement.py places a new
    key on its first ring successor with room and rebalances every
    ``rebalance_interval_s``); among the replicas the key is placed on, the
    least loaded under the in-flight cap ``in_flight_cap(mean)`` wins, else the
    next ring successor under the cap. The ranking is always the chosen replica,
    then the rest of the placement, then the remaining ring order, so a failure
    falls back as nginx's ring would. ``Decision.owner`` is the key's ring owner,
    ``Decision.kind`` one of KIND_OWNER, KIND_PLACED, KIND_REPLICATED,
    KIND_SPILL, KIND_NO_KEY.

    Inputs beyond ``rank``:

    * ``observe(key, prompt_tokens, cached_tokens=None)``: the prefill work of a
      request of ``key`` (call it once per request when its usage is known;
      uncached tokens = prompt - cached, all of them when cached is None).
      Without it the policy balances request rates alone.
    * ``set_cached(replica, key, cached)``: precise mode's knowledge of which
      replicas hold a key's prefix blocks (from KV events; see placement.py).
    * ``placement_snapshot()`` / ``apply_snapshot(snapshot)``: agreement between
      router processes; a follower (``leader=False``) that applies the leader's
      snapshots routes as the leader does.
    * candidates' optional ``load`` (ReplicaLoad): their queued + running
      requests count as in-flight when higher than the router's own count.
    """

    name = "placed"
    Options = PlacedOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o: PlacedOptions = self.options
        self.epsilon = o.epsilon
        self._clock: Callable[[], float] = o.clock if o.clock is not None else time.monotonic
        self.table = PlacementTable(o.epsilon, o.tau_s, o.hot_share, o.precise, o.work_epsilon, o.noise_z)
        self.history = HistoryIndex(o.history_max_entries) if o.history_max_entries else None
        self._next_rebalance: float | None = None
        self._table_members: tuple[tuple[str, int], ...] = ()
        self._turns: dict[str, int] = {}  # replicated key -> requests counted (tie rotation)
        self._key_in_flight: dict[str, int] = {}  # key -> its requests ranked and not yet ``done``
        self._conversational: dict[str, list[int]] = {}  # key -> [history decisions, decisions]
        # The candidate list of the last keyed call (names in the caller's order) and what was
        # derived from it: valid while the caller passes the same names in the same order and
        # the ring is the one the view was built on.
        self._view_names: list[str] | None = None
        self._view_ring: HashRing | None = None
        self._view_pos: dict[str, int] = {}  # name -> candidate position
        self._member_pos: list[int] = []  # table member index -> candidate position
        self._keyed: dict[str, _KeyOrder] = {}  # key -> its ring order in candidate positions

    # -- membership ---------------------------------------------------------------
    def _sync_members(self, candidates: Sequence[ReplicaView]) -> HashRing:
        ring = self.ring_for(candidates)
        if self._members != self._table_members:
            self.table.set_members([n for n, _ in self._members], [w for _, w in self._members], ring.order)
            self._table_members = self._members
        return ring

    def rebalance_due(self) -> bool:
        """Whether the next ``rank`` with a key rebalances first (leader only)."""
        return self.options.leader and (self._next_rebalance is None or self._clock() >= self._next_rebalance)

    def rebalance(self) -> bool:
        """Rebalance now (``rank`` does it every ``rebalance_interval_s``); True if placements changed."""
        now = self._clock()
        self._next_rebalance = now + self.options.rebalance_interval_s
        return self._rebalance(now)

    def _rebalance(self, now: float) -> bool:
        changed = self.table.rebalance(now)
        self._turns = {k: t for k, t in self._turns.items() if len(self.table.placement(k)) > 1}
        self._conversational = {k: t for k, t in self._conversational.items() if k in self.table}
        return changed

    def _set_view(self, candidates: Sequence[ReplicaView], names: list[str]) -> HashRing:
        """Adopt a new candidate list: check it, sync the ring and table, map names to positions."""
        _check(candidates)
        ring = self._sync_members(candidates)
        pos = {n: i for i, n in enumerate(names)}
        self._view_names = names
        self._view_ring = ring
        self._view_pos = pos
        self._member_pos = [pos[n] for n in self.table.members]
        self._keyed.clear()
        return ring

    def _key_order(self, key: str, memo: bool = True) -> _KeyOrder:
        """The key's ring order over the current view (memoized until the view changes, unless not ``memo``).

        From the table's ring order of the key (one ring walk per key and membership),
        or, for a key the table does not know (an uncounted request), from the ring.
        """
        entry = self._keyed.get(key)
        if entry is None:
            members = self.table.successor_indices(key)
            if members is None:
                assert self._view_ring is not None
                names = self._view_ring.order(key)
                entry = _KeyOrder(names[0], tuple(map(self._view_pos.__getitem__, names)))
            else:
                entry = _KeyOrder(self.table.members[members[0]], tuple(map(self._member_pos.__getitem__, members)))
            if memo:
                if len(self._keyed) * len(self._member_pos) >= _MAX_MEMO_POSITIONS:
                    self._keyed.clear()
                self._keyed[key] = entry
        return entry

    # -- the decision -------------------------------------------------------------
    def rank(
        self,
        candidates: Sequence[R],
        key: str | None,
        count: bool = True,
        history: Sequence[bytes] | None = None,
        static_blocks: int = 0,
    ) -> Decision[R]:
        """Rank for one request of ``key``; ``count=False`` for a retry of a request already counted.

        ``history``: the chained block hashes of the request's whole prompt (Contract 2,
        or the ingress's text blocks: any chained hashes the caller computes alike for
        every request); ``static_blocks``: how many of them the static prefix covers.
        With a history, a request of which some replica holds more than the static
        prefix goes to the one holding most (KIND_HISTORY) if under the cap; a new
        conversation to the least loaded of the key's set (PlacedOptions.new_epsilon)
        under the cap. Call ``done(key)`` when a counted request ends.

        The class docstring states the decision; this path reads each candidate
        once and reuses, per key, its ring order in candidate positions and the
        ranking for its first choice while the caller passes the same candidate
        names in the same order (tests/test_placement.py checks it against a
        direct statement of the decision on random inputs).
        """
        names = [c.name for c in candidates]
        if key is None:
            if names != self._view_names:
                _check(candidates)
            return Decision(sorted(candidates, key=lambda c: (effective_in_flight(c), c.name)), kind=KIND_NO_KEY)
        if names != self._view_names or self._ring is not self._view_ring or self._members is not self._table_members:
            self._set_view(candidates, names)
        now = self._clock()
        if self.options.leader and (self._next_rebalance is None or now >= self._next_rebalance):
            if self._next_rebalance is not None:
                self._rebalance(now)
            self._next_rebalance = now + self.options.rebalance_interval_s
        # Each candidate's in-flight count: its own, or its reported queued + running when more.
        loads: list[int] = []
        for c in candidates:
            f = c.in_flight
            load = getattr(c, "load", None)
            if isinstance(load, ReplicaLoad):
                q = load.num_waiting + load.num_running
                if q > f:
                    f = q
            loads.append(f)
        cap = in_flight_cap(sum(loads) / len(candidates))
        table = self.table
        # A key's first request memoizes nothing here (most keys seen once are never seen again).
        seen = key in table
        placed_members = table.record_indices(key, now) if count else table.placement_indices(key)
        entry = self._key_order(key, memo=seen)
        order = entry.order
        if not placed_members:  # not counted and unknown: the ring decides
            placed: tuple[int, ...] = (order[0],)
        elif len(placed_members) == 1:
            placed = (self._member_pos[placed_members[0]],)
        else:
            member_pos = self._member_pos
            placed = tuple([member_pos[i] for i in placed_members])
        first = placed[0]
        held: dict[int, int] = {}
        best = 0
        chosen = -1
        if history and self.history is not None:
            pos = self._view_pos
            held = {pos[n]: b for n, b in self.history.held(history).items() if n in pos}
            best = max(held.values(), default=0)
        conv_cap = cap
        if history is not None and self.options.balance_epsilon is not None:
            conv_cap = min(cap, sum(loads) / len(candidates) * (1.0 + self.options.balance_epsilon) + 1.0)
        if best > static_blocks:
            # A conversation's later turn: the replica holding most of its history, if under the cap
            # (the least loaded of several, the placement's first).
            holders = [p for p, b in held.items() if b == best and loads[p] < conv_cap]
            if holders:
                chosen = min(holders, key=lambda p: (loads[p], p not in placed, p))
                kind = KIND_HISTORY
        if chosen >= 0:
            pass
        elif history is not None and self.options.new_epsilon is not None and count:
            # A new conversation (nothing beyond the static prefix held anywhere): the least
            # loaded replica of the key's set under the cap. The set is the placement, grown
            # by the next ring successors while the key's own in-flight requests exceed what
            # ``1 + new_epsilon`` replicas' fair shares hold, so it grows with the key's load
            # from its first requests and shrinks when they finish.
            share = max(1.0, sum(loads) / len(candidates)) * (1.0 + self.options.new_epsilon)
            want = min(len(order), math.ceil((self._key_in_flight.get(key, 0) + 1) / share))
            # A key whose requests mostly continue conversations (an app's users' chats):
            # its new conversations also spread over its next ring successors, since a
            # conversation stays where it starts and one static-prefix miss buys all its turns.
            turns = self._conversational.get(key)
            if turns is not None and 2 * turns[0] >= turns[1] and self.options.conversation_spread:
                want = min(len(order), max(want, len(placed)) + self.options.conversation_spread)
            group = list(placed)
            if want > len(group):
                group += [p for p in order if p not in placed][: want - len(group)]
            under = [p for p in group if loads[p] < conv_cap]
            if under:
                low = min(loads[p] for p in under)
                tied = [p for p in under if loads[p] == low]
                turn = self._turns.get(key, 0)
                if len(group) > 1:
                    self._turns[key] = turn + 1
                chosen = tied[turn % len(tied)]
                kind = KIND_NEW_CONVERSATION if chosen in placed else KIND_SPILL
        if chosen >= 0:
            pass
        elif len(placed) == 1 and loads[first] < cap:  # the common case: one replica, under the cap
            chosen = first
            kind = KIND_OWNER if first == order[0] else KIND_PLACED
        else:
            under = [p for p in placed if loads[p] < cap]
            if under:
                # Least loaded; ties rotate over the key's requests, so that copies of a
                # hot key share its traffic evenly (as the placement's accounting assumes).
                low = min(loads[p] for p in under)
                tied = [p for p in under if loads[p] == low]
                turn = self._turns.get(key, 0)
                if count and len(placed) > 1:
                    self._turns[key] = turn + 1
                chosen = tied[turn % len(tied)]
                kind = KIND_REPLICATED if chosen != first else KIND_OWNER if chosen == order[0] else KIND_PLACED
            else:
                # The first ring successor outside the placement under the cap, else the least loaded.
                spill = next((p for p in order if loads[p] < cap and p not in placed), None)
                chosen = spill if spill is not None else min(order, key=loads.__getitem__)
                kind = KIND_SPILL
        predicted = held.get(chosen, 0)
        if count and history is not None:
            # The key's recent history-branch share: [history decisions, decisions], halved at 64.
            turns = self._conversational.get(key)
            if turns is None:
                if len(self._conversational) >= _MAX_CONVERSATIONAL_KEYS:
                    self._conversational.clear()  # a follower never rebalances: bound it here too
                turns = self._conversational[key] = [0, 0]
            turns[0] += kind == KIND_HISTORY
            turns[1] += 1
            if turns[1] >= 64:
                turns[0] //= 2
                turns[1] //= 2
        if count:
            self._key_in_flight[key] = self._key_in_flight.get(key, 0) + 1
        if history and count and self.history is not None:
            # What the router sent counts as held until a report says otherwise.
            self.history.record(candidates[chosen].name, history)
        if len(candidates) == 1:
            return Decision([candidates[0]], owner=entry.owner, kind=kind, predicted_blocks=predicted, best_blocks=best)
        if len(placed) == 1:
            head: tuple[int, ...] = (chosen,) if chosen == first else (chosen, first)
        else:
            head = (chosen, *(p for p in placed if p != chosen))
        return Decision(
            entry.rank(head, candidates), owner=entry.owner, kind=kind, predicted_blocks=predicted, best_blocks=best
        )

    # -- other inputs -------------------------------------------------------------
    def done(self, key: str) -> None:
        """A request of ``key`` ranked with ``count=True`` finished (or failed): its set may shrink."""
        n = self._key_in_flight.get(key, 0) - 1
        if n > 0:
            self._key_in_flight[key] = n
        else:
            self._key_in_flight.pop(key, None)

    def key_in_flight(self, key: str) -> int:
        """Requests of ``key`` ranked and not yet ``done``."""
        return self._key_in_flight.get(key, 0)

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None = None) -> None:
        """Record the prefill work of one request of ``key`` (see the class docstring)."""
        uncached = prompt_tokens - (cached_tokens or 0)
        self.table.observe(key, max(0, uncached), self._clock())

    def set_cached(self, replica: str, key: str, cached: bool) -> None:
        """Precise mode: whether ``replica`` holds ``key``'s prefix blocks (ignored unless ``precise``)."""
        self.table.set_cached(replica, key, cached)

    def placement(self, key: str) -> list[str]:
        """The replicas ``key`` is placed on, primary first ([] if unknown)."""
        return self.table.placement(key)

    def placement_snapshot(self) -> dict[str, Any]:
        """JSON-serializable placement: format, version, members with weights, per key replicas and stats."""
        snap = self.table.snapshot(self._clock())
        snap["weights"] = {n: w for n, w in self._table_members}
        return snap

    def apply_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """Adopt a leader's snapshot: its members (ring), placements and statistics."""
        members = snapshot.get("members")
        weights = snapshot.get("weights", {})
        if not isinstance(members, list) or not members or not isinstance(weights, Mapping):
            raise ValueError("placement snapshot needs a non-empty 'members' list and a 'weights' mapping")
        # The leader's ring weights (a follower configured alike already has them).
        self._weights.update({str(n): int(w) for n, w in weights.items()})
        self._sync_members([Replica(str(n)) for n in members])
        self.table.apply(snapshot, self._clock())


POLICIES: dict[str, type[_Configured]] = {
    RoundRobin.name: RoundRobin,
    Random.name: Random,
    PowerOfTwo.name: PowerOfTwo,
    ConsistentHash.name: ConsistentHash,
    BoundedLoad.name: BoundedLoad,
    Placed.name: Placed,
}
DEFAULT_POLICY = Placed.name
# Policies that place keys on the ring (their decisions report owners and spills).
RING_POLICIES = tuple(name for name, cls in POLICIES.items() if issubclass(cls, _RingPolicy))


def policy_class(name: str) -> type[_Configured]:
    """The policy class called ``name`` (ValueError lists the names)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


def accepted_options(name: str) -> tuple[str, ...]:
    """The option names policy ``name`` takes, as its ``Options`` declares them."""
    return tuple(f.name for f in fields(policy_class(name).Options))


def check_options(name: str, **options: Any) -> Any:
    """Validate ``options`` for policy ``name`` without building it; returns its Options."""
    return from_dict(policy_class(name).Options, options, f"{name} policy option")


def pick_options(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Of a caller's ``settings``, those policy ``name`` takes (None values left to the policy's default)."""
    taken = accepted_options(name)
    return {k: v for k, v in settings.items() if k in taken and v is not None}


def make_policy(name: str = DEFAULT_POLICY, **options: Any) -> Policy:
    """Build a policy by name; ``options`` must be among those its ``Options`` declares.

    Unknown options, and bad values, raise ValueError naming them.
    """
    return policy_class(name)(**options)


# ------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class _BenchView:
    """A candidate as router/serve_router.py hands it to the policy (name, own in-flight, reported load)."""

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


def _bench_main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import statistics

    p = argparse.ArgumentParser(
        prog="python -m prefixserve.router.policies",
        description="placed's routing-decision latency (bench_rank), median of repeats",
    )
    p.add_argument("--replicas", default="2,16,64", help="comma list of cluster sizes")
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print("| replicas | keys | p50 (us) | p99 (us) | mean (us) | runs (p50 / p99) |")
    print("|---:|---|---:|---:|---:|---|")
    for r in (int(s) for s in args.replicas.split(",") if s):
        for cold in (False, True):
            runs = [bench_rank(r, args.keys, args.requests, cold=cold, seed=s) for s in range(args.repeats)]
            med = {f: statistics.median(run[f] for run in runs) for f in ("p50", "p99", "mean")}
            label = "cold (every key new)" if cold else f"{args.keys} Zipf, warm"
            spread = ", ".join(f"{run['p50']:.0f}/{run['p99']:.0f}" for run in runs)
            print(f"| {r} | {label} | {med['p50']:.1f} | {med['p99']:.1f} | {med['mean']:.1f} | {spread} |", flush=True)


if __name__ == "__main__":
    _bench_main()
