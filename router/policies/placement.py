"""Ring-placed bounded loads: which replicas each routing key is placed on (pure logic).

Job: the state behind the ``placed`` routing policy (router/policies/placed.py). Bounded
loads on *requests* (``bounded_load``) spill a busy key on instantaneous noise
and throw its cache away; Mirrokni, Thorup and Zadimoghaddam bound *keys*. This
table keeps, per routing key, a decayed request rate and a decayed prefill work,
and places whole keys on ring replicas so that no replica's share of either
exceeds ``(1 + epsilon)`` times its fair share:

* a new key goes to its first ring successor with room (the ring owner unless
  that replica already holds more than its bound);
* every ``rebalance_interval_s`` a rebalance, O(keys) and vectorized with numpy:
  decays every statistic, forgets keys that went quiet, gives a key whose rate
  exceeds ``hot_share`` of a replica's fair share its next ring successors
  (one copy per ``hot_share`` of a fair share: hot-key replication) and takes
  them back when it cools (with hysteresis), then makes every replica over
  ``(1 + epsilon)`` of its fair share, in rate or in prefill work, shed whole
  keys with the fewest moves, each to its next ring successor with room: every
  move costs the key one cold prefill on its new replica whatever its size, so
  the smallest key covering the whole excess goes first, then the largest. With
  precise information, keys whose prefix the replica no longer holds come before
  all others (moving them loses nothing).

A copy made between rebalances: ``add_copy(key, replica)`` places a key on a replica that
computed its prefix for a request its placement could not take (``placed`` sends a one-shot key's
requests past its placement when its own requests in flight outgrow it and its share of the
requests fills another replica). The copy then serves the key's later requests, as a hot-key copy
does, instead of being made for one request and left to be evicted; rebalancing keeps or takes
it back by the key's rate, as it does its own copies.

Statistics: a key's rate is an exponentially decayed request count (time
constant ``tau_s``), its work a decayed count of uncached prompt tokens. They
are kept in units of a reference time ``t0`` (an event at time t adds
``exp((t - t0) / tau)``) and renormalized at each rebalance, so recording a
request is O(1) and decaying is one vector multiply. A replica's load is the
sum over the keys placed on it of their statistics divided by their number of
copies.

Precise mode: ``set_cached(replica, key, cached)`` records whether a replica
holds the key's prefix blocks (fed from KV events). It changes choices only
between otherwise acceptable replicas (with room): placing a new key, choosing a
destination or a copy, ordering the keys a replica sheds. A key with no
information is treated as in approximate mode, so missed or late events degrade
to approximate placement, never to a wrong answer.

KV footprint: with ``set_capacity(replica, tokens)`` (how many tokens of KV a replica holds)
and ``set_footprint(key, tokens)`` (the tokens of a key's static prefix), a replica also has room
for a key only while the footprints of the keys placed on it and requested in the last ``tau_s``
(each copy whole) fit ``kv_fill`` of its capacity; an empty replica still always has room. Rate
and work balance say nothing of how many prompts a pool holds: ten tenants of equal traffic and
long prompts can balance two replicas' rates at eight prompts against two, and the eight evict
each other. A key whose footprint is not known yet counts as the mean of those known. The
footprints on each replica are recounted at every rebalance (and when a capacity is learnt) and
kept between them as keys are placed, copied and moved and as their footprints are learnt, so a
young router's first placements count them too. Without capacities (or footprints) nothing changes.

Retained keys: ``retain(key, until)`` marks a key whose requests ask their replica to pin its
prefix (OpenAI's ``prompt_cache_retention``, replica/kv/pins.py): until then rebalancing neither
moves it off its primary replica nor forgets it, since its cache is where it is. Hot-key copies
are still added and taken back. Only the table that rebalances (the leader) needs to know.

Agreement: ``snapshot()`` is a JSON-serializable table (version, members,
per key: replicas and decayed statistics as of the snapshot); ``apply(snapshot)``
on another instance makes its placement and statistics equal, so fed the same
requests afterwards the two decide alike. Times never travel (each process
has its own monotonic clock): statistics travel as values decayed to the
publisher's "now".

Time comes from the caller (``now`` arguments); the policy passes its injected clock.

Pure Python + numpy: must not import Ray, HTTP frameworks or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

# A key whose decayed count fell below this is forgotten (a key seen once is
# forgotten after tau * ln(1000), about 35 minutes at tau = 300 s).
FORGET_BELOW = 1e-3
# A replicated key keeps its copies until its rate falls below this fraction of
# the rate that created them (hysteresis: no flapping around the threshold).
SHRINK_HYSTERESIS = 0.75
# Renormalize the decayed units when this many time constants passed without a
# rebalance (exp(60) is still far from float overflow).
_MAX_AGE_TAUS = 60.0
SNAPSHOT_FORMAT = 1

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class FloatCells(Protocol):
    """A float64 array's cells read and written as Python floats: its buffer's memoryview."""

    @property
    def obj(self) -> object: ...  # the array

    def __getitem__(self, index: int, /) -> float: ...

    def __setitem__(self, index: int, value: float, /) -> None: ...


def cells(array: FloatArray) -> FloatCells:
    """``array``'s cells as :class:`FloatCells` (``array.data``, a memoryview of format ``d``)."""
    return cast(FloatCells, array.data)


class PlacementTable:
    """Keys, their decayed statistics and the replicas they are placed on (see the module docstring).

    ``successors(key)`` gives the member names in the key's ring order (the
    owner first); it is asked once per key per membership.
    """

    def __init__(
        self,
        epsilon: float,
        tau_s: float,
        hot_share: float,
        precise: bool = False,
        work_epsilon: float | None = None,
        noise_z: float = 0.0,
        kv_fill: float = 0.9,
    ) -> None:
        self.epsilon = float(epsilon)
        # The share of a replica's KV capacity the static prefixes placed on it may fill: the rest
        # holds the requests' own blocks (questions, answers, histories).
        self.kv_fill = float(kv_fill)
        # Rebalancing acts on decayed request counts, which carry Poisson noise of about
        # sqrt(count): a replica sheds, and a key gains a copy, only when its excess
        # exceeds noise_z standard deviations. Each move costs a cold prefill, and on a
        # small or young cluster the noise is the same size as the imbalance.
        self.noise_z = float(noise_z)
        # Slack of prefill work over its fair share (None: rates only). Looser than
        # epsilon: work and rate pull apart (hot keys hit, so they carry rate with
        # little work), and a tight bound on both leaves no replica with room for both.
        self.work_epsilon = None if work_epsilon is None else float(work_epsilon)
        self.tau_s = float(tau_s)
        self.hot_share = float(hot_share)
        self.precise = precise
        self.version = 0
        self.members: tuple[str, ...] = ()
        self._index: dict[str, int] = {}
        self._share: FloatArray = np.zeros(0)
        self._successors: Callable[[str], Sequence[str]] = lambda _key: ()
        self._t0: float | None = None
        # Per key slot (arrays grow by doubling; free slots are reused).
        self._slot: dict[str, int] = {}
        self._keys: list[str | None] = []
        self._free: list[int] = []
        self._rate: FloatArray = np.zeros(0)
        self._work: FloatArray = np.zeros(0)
        self._primary: IntArray = np.zeros(0, dtype=np.int64)  # member index, -1: unplaced or free slot
        self._copies: IntArray = np.zeros(0, dtype=np.int64)  # replicas the key is placed on (0: unplaced)
        self._live: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)  # the slot holds a key
        self._seen: FloatArray = np.zeros(0)  # time of the key's last request
        self._extra: dict[int, list[int]] = {}  # slot -> copies beyond the primary, in ring order
        self._succ: list[tuple[int, ...] | None] = []  # slot -> member indices in ring order (lazy)
        # slot -> its placement (member indices, primary first), filled on a request and dropped by
        # whatever changes the slot's placement: the per-request path reads no numpy for it.
        self._placed_memo: dict[int, tuple[int, ...]] = {}
        self._cached: dict[str, dict[str, bool]] = {}  # key -> replica -> holds its prefix (precise mode)
        self._retained: dict[str, float] = {}  # key -> until when rebalancing keeps it where it is
        # Per member: the placed load (decayed units of t0), kept current between rebalances.
        self._load_rate: FloatArray = np.zeros(0)
        self._views: tuple[FloatCells, FloatCells, FloatCells] | None = None  # _request_views
        self._load_work: FloatArray = np.zeros(0)
        self._total_rate = 0.0
        self._total_work = 0.0
        # KV footprint (module docstring): per slot, its static prefix's tokens (0: not known yet);
        # per member, its capacity in tokens (0: unknown) and the footprint placed on it.
        self._foot: FloatArray = np.zeros(0)
        self._capacity_of: dict[str, float] = {}
        self._capacity: FloatArray = np.zeros(0)
        self._load_foot: FloatArray = np.zeros(0)
        # Per slot: the footprint counted on each replica it is placed on (what a move or a new
        # copy carries, and what a footprint learnt later corrects).
        self._foot_counted: FloatArray = np.zeros(0)
        self._foot_known = [0.0, 0]  # the known footprints' sum and count (``_foot_prior``)
        self._now: float | None = None  # the latest time the table was told (footprints count the recent keys)

    # -- membership -----------------------------------------------------------------
    def set_members(
        self, names: Sequence[str], weights: Sequence[int], successors: Callable[[str], Sequence[str]]
    ) -> None:
        """Make ``names`` the members (ring weights alike); placements on departed members are dropped.

        A key left with no replica is placed again at its next request.
        """
        old = self.members
        self.members = tuple(names)
        self._index = {n: i for i, n in enumerate(self.members)}
        w = np.asarray(weights, dtype=np.float64)
        self._share = w / w.sum() if len(w) else w
        self._successors = successors
        remap = np.asarray([self._index.get(n, -1) for n in old] + [-1], dtype=np.int64)
        self._primary = np.where(self._primary >= 0, remap[self._primary], -1)
        for slot in list(self._extra):
            kept = [int(remap[i]) for i in self._extra[slot] if remap[i] >= 0]
            if self._primary[slot] < 0 and kept:
                self._primary[slot] = kept.pop(0)
            if kept:
                self._extra[slot] = kept
            else:
                del self._extra[slot]
        # Copies: 1 per placed primary plus the extras; 0 for a key left unplaced
        # (it keeps its statistics and is placed again at its next request).
        self._copies = (self._primary >= 0).astype(np.int64)
        for slot, extra in self._extra.items():
            self._copies[slot] += len(extra)
        self._succ = [None] * len(self._succ)
        self._placed_memo.clear()
        self._capacity = np.asarray([self._capacity_of.get(n, 0.0) for n in self.members], dtype=np.float64)
        self._recompute_loads()
        self.version += 1

    # -- requests -------------------------------------------------------------------
    def _unit(self, now: float) -> float:
        """The weight of one event at ``now`` in the table's decayed units."""
        if self._t0 is None:
            self._t0 = now
        age = (now - self._t0) / self.tau_s
        if age > _MAX_AGE_TAUS:
            self._renormalize(now)
            age = 0.0
        return math.exp(age)

    def placement(self, key: str) -> list[str]:
        """The replicas ``key`` is placed on, primary first ([] when unknown or unplaced)."""
        return [self.members[i] for i in self.placement_indices(key)]

    def placement_indices(self, key: str) -> tuple[int, ...]:
        """``placement(key)`` as member indices (into ``members``); () when unknown or unplaced."""
        slot = self._slot.get(key)
        if slot is None:
            return ()
        placed = self._placed_memo.get(slot)
        if placed is None:
            if self._primary[slot] < 0:
                return ()
            placed = self._placed(slot)
        return placed

    def _placed(self, slot: int) -> tuple[int, ...]:
        """The member indices of a placed slot, primary first (memoized until its placement changes)."""
        placed = self._placed_memo.get(slot)
        if placed is None:
            placed = self._placed_memo[slot] = (int(self._primary[slot]), *self._extra.get(slot, ()))
        return placed

    def _unplace(self, slot: int) -> None:
        """Forget the memoized placement of ``slot`` (call on every change of its primary or copies)."""
        self._placed_memo.pop(slot, None)

    def record(self, key: str, now: float) -> list[str]:
        """Count one request of ``key`` at ``now``, placing the key if it has no replica; its placement."""
        return [self.members[i] for i in self.record_indices(key, now)]

    def record_indices(self, key: str, now: float) -> tuple[int, ...]:
        """``record(key, now)`` returning the placement as member indices, primary first."""
        if not self.members:
            raise ValueError("the placement table has no members")
        w = self._unit(now)
        self._now = now
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)
        rate, seen, load_rate = self._request_views()
        rate[slot] += w
        self._total_rate += w
        seen[slot] = now
        placed = self._placed_memo.get(slot)  # only a placed slot has one
        if placed is None:
            if self._primary[slot] < 0:
                self._place_new(slot)
                # Not memoized yet: most keys placed now are never requested again.
                return (int(self._primary[slot]),)
            placed = self._placed(slot)
        # The key's request adds its rate to each replica it is placed on (no work: observe adds that).
        share = w / len(placed)
        for i in placed:
            load_rate[i] += share
        return placed

    def _request_views(self) -> tuple[FloatCells, FloatCells, FloatCells]:
        """Views of the arrays every request writes (``_rate``, ``_seen``, ``_load_rate``), made
        again whenever one of them was replaced (grown, recomputed, applied).

        A scalar through a memoryview is a Python float: on a router whose caches the client and
        the replicas evict between requests, numpy's scalar indexing costs several times as much.
        """
        views = self._views
        if (
            views is None
            or views[0].obj is not self._rate
            or views[1].obj is not self._seen
            or views[2].obj is not self._load_rate
        ):
            views = self._views = (cells(self._rate), cells(self._seen), cells(self._load_rate))
        return views

    def observe(self, key: str, uncached_tokens: int, now: float) -> None:
        """Add ``uncached_tokens`` of prefill work to ``key`` (ignored for a key the table does not know)."""
        slot = self._slot.get(key)
        if slot is None or uncached_tokens <= 0:
            return
        w = self._unit(now) * uncached_tokens
        self._work[slot] += w
        self._total_work += w
        if self._primary[slot] >= 0:
            self._add_load(slot, 0.0, w)

    def _add_load(self, slot: int, rate: float, work: float) -> None:
        placed = self._placed(slot)
        for i in placed:
            if rate:
                self._load_rate[i] += rate / len(placed)
            if work:
                self._load_work[i] += work / len(placed)

    def _new_slot(self, key: str) -> int:
        if not self._free:
            old = len(self._keys)
            size = max(64, 2 * old)
            self._rate = np.concatenate([self._rate, np.zeros(size - old)])
            self._work = np.concatenate([self._work, np.zeros(size - old)])
            self._foot = np.concatenate([self._foot, np.zeros(size - old)])
            self._foot_counted = np.concatenate([self._foot_counted, np.zeros(size - old)])
            self._primary = np.concatenate([self._primary, np.full(size - old, -1, dtype=np.int64)])
            self._copies = np.concatenate([self._copies, np.zeros(size - old, dtype=np.int64)])
            self._live = np.concatenate([self._live, np.zeros(size - old, dtype=np.bool_)])
            self._seen = np.concatenate([self._seen, np.zeros(size - old)])
            self._keys.extend([None] * (size - old))
            self._succ.extend([None] * (size - old))
            self._free = list(range(size - 1, old - 1, -1))
        slot = self._free.pop()
        self._unplace(slot)
        self._slot[key] = slot
        self._keys[slot] = key
        self._rate[slot] = self._work[slot] = self._foot[slot] = self._foot_counted[slot] = 0.0
        self._primary[slot] = -1
        self._copies[slot] = 0
        self._live[slot] = True
        return slot

    def successor_indices(self, key: str) -> tuple[int, ...] | None:
        """Member indices in ``key``'s ring order (memoized per membership); None for a key the table does not know."""
        slot = self._slot.get(key)
        return None if slot is None else self.successors_of(slot)

    def successors_of(self, slot: int) -> tuple[int, ...]:
        """Member indices in the ring order of the key in ``slot``."""
        succ = self._succ[slot]
        if succ is None:
            key = self._keys[slot]
            assert key is not None
            names = self._successors(key)
            try:
                succ = tuple(map(self._index.__getitem__, names))
            except KeyError:  # a name that is not a member: skipped
                succ = tuple(self._index[n] for n in names if n in self._index)
            self._succ[slot] = succ
        return succ

    # -- room and placement ---------------------------------------------------------
    def _room(self, i: int, rate: float, work: float | None, foot: float | None = None) -> bool:
        """Whether member ``i`` stays within its bounds after taking a key's rate (and work and
        footprint, unless None).

        Bounds: (1 + epsilon) of its fair share of the rate, (1 + work_epsilon)
        of the work, ``kv_fill`` of its KV capacity when known. An empty replica
        always has room (the ceiling of Mirrokni et al.'s bound).
        """
        if self._load_rate[i] <= 0.0:
            return True
        if not self._fits(i, foot):
            return False
        # The totals already count the key (a new key's request is counted before it is placed).
        if self._load_rate[i] + rate > (1.0 + self.epsilon) * self._share[i] * self._total_rate:
            return False
        if work is None or self.work_epsilon is None or self._total_work <= 0.0:
            return True
        return bool(self._load_work[i] + work <= (1.0 + self.work_epsilon) * self._share[i] * self._total_work)

    def holds(self, key: str, replica: str) -> bool | None:
        """Precise mode's knowledge: True/False when known, None when unknown (or not precise)."""
        if not self.precise:
            return None
        return self._cached.get(key, {}).get(replica)

    def _pick(self, slot: int, order: Sequence[int], rate: float, work: float, foot: float = 0.0) -> int | None:
        """The first member of ``order`` with room, preferring (precise mode) one holding the key.

        Room in rate, work and KV footprint if any member has it, else in rate and footprint,
        else in rate alone. The walk stops at the first member with room (approximate mode)
        or the first with room holding the key (precise mode): room is asked of no member
        past it.
        """
        key = self._keys[slot] if self.precise else None
        tiers = ((work, foot), (None, foot), (None, 0.0)) if foot else ((work, 0.0), (None, 0.0))
        for bound, kv in tiers:
            first: int | None = None
            for i in order:
                if not self._room(i, rate, bound, kv):
                    continue
                if key is None:
                    return i
                if first is None:
                    first = i
                if self.holds(key, self.members[i]):
                    return i
            if first is not None:
                return first
        return None

    def _place_new(self, slot: int) -> None:
        rate, work, foot = float(self._rate[slot]), float(self._work[slot]), self._footprint(slot)
        succ = self.successors_of(slot)
        chosen = self._pick(slot, succ, rate, work, foot)
        primary = self._primary[slot] = succ[0] if chosen is None else chosen
        self._copies[slot] = 1
        self._extra.pop(slot, None)
        self._unplace(slot)
        self._add_load(slot, rate, work)
        self._load_foot[primary] += foot
        self._foot_counted[slot] = foot
        self.version += 1

    def add_copy(self, key: str, replica: str) -> bool:
        """Place ``key`` on ``replica`` too, which computed its prefix for a request its placement
        could not take; True if added. Not added (False) for a key the table does not know or has
        not placed, a replica that is not a member or already holds the key, or one whose KV the
        copy's footprint would overfill (the copy would only evict). The copy stays until a
        rebalance finds the key's rate too small for it (hysteresis as for its own copies)."""
        slot = self._slot.get(key)
        i = self._index.get(replica)
        if slot is None or i is None or self._primary[slot] < 0:
            return False
        placed = self._placed(slot)
        foot = float(self._foot_counted[slot])
        if i in placed or not self._fits(i, foot):
            return False
        rate, work = float(self._rate[slot]), float(self._work[slot])
        self._add_load(slot, -rate, -work)
        self._extra[slot] = [*self._extra.get(slot, ()), i]
        self._copies[slot] += 1
        self._unplace(slot)
        self._add_load(slot, rate, work)
        self._load_foot[i] += foot
        self.version += 1
        return True

    @property
    def _foot_prior(self) -> float:
        """The mean known footprint, counted for a key not known yet."""
        total, count = self._foot_known
        return total / count if count else 0.0

    def _fits(self, i: int, foot: float | None) -> bool:
        """Whether member ``i``'s KV capacity (when known) holds ``foot`` more tokens of static prefixes."""
        return not (foot and self._capacity[i] > 0.0 and self._load_foot[i] + foot > self.kv_fill * self._capacity[i])

    def _footprint(self, slot: int) -> float:
        """The tokens ``slot``'s key counts for on each replica it is placed on (the known mean
        when its own are not known); 0 while no replica's capacity is known."""
        if not self._capacity_of:
            return 0.0
        return float(self._foot[slot]) or self._foot_prior

    # -- rebalance ------------------------------------------------------------------
    def _renormalize(self, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
            return
        f = math.exp(-(now - self._t0) / self.tau_s)
        self._rate *= f
        self._work *= f
        self._load_rate *= f
        self._load_work *= f
        self._total_rate *= f
        self._total_work *= f
        self._t0 = now

    def _recompute_loads(self) -> None:
        n = len(self.members)
        placed = self._primary >= 0
        copies = np.maximum(self._copies, 1)
        idx = self._primary[placed]
        self._load_rate = np.bincount(idx, (self._rate / copies)[placed], minlength=n).astype(np.float64)
        self._load_work = np.bincount(idx, (self._work / copies)[placed], minlength=n).astype(np.float64)
        for slot, extra in self._extra.items():
            c = float(copies[slot])
            for i in extra:
                self._load_rate[i] += self._rate[slot] / c
                self._load_work[i] += self._work[slot] / c
        self._total_rate = float(self._rate.sum())  # free slots hold 0
        self._total_work = float(self._work.sum())
        self._recount_footprints(placed, idx)

    def _recount_footprints(self, placed: npt.NDArray[np.bool_] | None = None, idx: IntArray | None = None) -> None:
        """Each member's placed footprint: the keys placed on it requested in the last ``tau_s``,
        each copy whole, a key not known yet counting as the known mean."""
        n = len(self.members)
        if placed is None or idx is None:
            placed = self._primary >= 0
            idx = self._primary[placed]
        known = self._live & (self._foot > 0.0)
        self._foot_known = [float(self._foot[known].sum()), int(known.sum())]
        if not self._capacity_of:
            self._load_foot = np.zeros(n)
            self._foot_counted = np.zeros(len(self._foot))
            return
        foot = np.where(self._foot > 0.0, self._foot, self._foot_prior)
        if self._now is not None:
            foot = np.where(self._seen >= self._now - self.tau_s, foot, 0.0)
        self._foot_counted = np.where(placed, foot, 0.0)
        self._load_foot = np.bincount(idx, foot[placed], minlength=n).astype(np.float64)
        for slot, extra in self._extra.items():
            for i in extra:
                self._load_foot[i] += foot[slot]

    def retain(self, key: str, until: float) -> None:
        """Keep ``key`` (a key the table knows) where it is placed until ``until`` (module docstring)."""
        if key in self._slot:
            self._retained[key] = max(until, self._retained.get(key, until))

    def retained(self, key: str) -> bool:
        return key in self._retained

    def _retained_mask(self) -> npt.NDArray[np.bool_]:
        mask = np.zeros(len(self._live), dtype=np.bool_)
        mask[[s for k in self._retained if (s := self._slot.get(k)) is not None]] = True
        return mask

    def rebalance(self, now: float) -> bool:
        """Decay, forget, replicate hot keys, shed from overloaded replicas; True if any placement changed."""
        self._renormalize(now)
        self._now = now
        version = self.version
        self._retained = {k: u for k, u in self._retained.items() if u > now and k in self._slot}
        if not self.members:
            return False
        self._forget()
        self._replicate()
        self._recompute_loads()
        self._shed()
        return self.version != version

    def _forget(self) -> None:
        quiet = np.nonzero(self._live & (self._rate < FORGET_BELOW) & ~self._retained_mask())[0]
        for slot in quiet.tolist():
            self._drop(slot)
        if len(quiet):
            self.version += 1

    def _drop(self, slot: int) -> None:
        """Forget the key of ``slot`` and free the slot (the caller takes its statistics out of the loads)."""
        key = self._keys[slot]
        assert key is not None
        if self._primary[slot] >= 0 and self._foot_counted[slot]:
            for i in self._placed(slot):
                self._load_foot[i] -= self._foot_counted[slot]
        if self._foot[slot] > 0.0:
            self._foot_known[0] -= float(self._foot[slot])
            self._foot_known[1] -= 1
        del self._slot[key]
        self._cached.pop(key, None)
        self._retained.pop(key, None)
        self._keys[slot] = None
        self._live[slot] = False
        self._primary[slot] = -1
        self._copies[slot] = 0
        self._rate[slot] = self._work[slot] = self._foot[slot] = self._foot_counted[slot] = 0.0
        self._extra.pop(slot, None)
        self._unplace(slot)
        self._succ[slot] = None
        self._free.append(slot)

    def unrecord(self, key: str, now: float) -> None:
        """Take back one request of ``key`` counted at about ``now``: its replica refused it (a client
        error says nothing of the key's traffic). A key left with nothing else is forgotten at once,
        so that refused requests leave no keys in the table."""
        slot = self._slot.get(key)
        if slot is None:
            return
        unit = self._unit(now)
        w = min(unit, float(self._rate[slot]))
        self._rate[slot] -= w
        self._total_rate -= w
        if self._primary[slot] >= 0:
            self._add_load(slot, -w, 0.0)
        if self._rate[slot] < FORGET_BELOW * unit and self._work[slot] <= 0 and key not in self._retained:
            self._drop(slot)
            self.version += 1

    def _replicate(self) -> None:
        n = len(self.members)
        if n < 2 or self._total_rate <= 0:
            return
        unit = self.hot_share * self._total_rate / n  # rate one copy may carry
        placed = self._copies > 0
        # Copies are added for the rate a key surely carries (its count less noise_z sigma).
        sure = np.maximum(self._rate - self.noise_z * np.sqrt(self._rate), 0.0)
        up = np.ceil(sure / unit).astype(np.int64)
        down = np.ceil(self._rate / (SHRINK_HYSTERESIS * unit)).astype(np.int64)
        want = np.where(up > self._copies, up, np.where(down < self._copies, down, self._copies))
        want = np.clip(want, 1, n)
        changed = np.nonzero(placed & (want != self._copies))[0]
        for slot in changed.tolist():
            self._set_copies(slot, int(want[slot]))

    def _set_copies(self, slot: int, want: int) -> None:
        extra = self._extra.get(slot, [])
        primary = int(self._primary[slot])
        if want - 1 < len(extra):
            extra = extra[: want - 1]
        else:
            succ = self.successors_of(slot)
            start = succ.index(primary) if primary in succ else 0
            ring = [succ[(start + j) % len(succ)] for j in range(1, len(succ))]
            taken = {primary, *extra}
            candidates = [i for i in ring if i not in taken]
            if self.precise:  # copies where the prefix already is first, otherwise in ring order
                key = self._keys[slot]
                assert key is not None
                candidates.sort(key=lambda i: 0 if self.holds(key, self.members[i]) else 1)
            extra = extra + candidates[: want - 1 - len(extra)]
        if extra:
            self._extra[slot] = extra
        else:
            self._extra.pop(slot, None)
        self._copies[slot] = 1 + len(extra)
        self._unplace(slot)
        self.version += 1

    def _shed(self) -> None:
        n = len(self.members)
        cap_rate = (1.0 + self.epsilon) * self._share * self._total_rate
        if self._total_work > 0 and self.work_epsilon is not None:
            cap_work = (1.0 + self.work_epsilon) * self._share * self._total_work
        else:
            cap_work = np.full(n, np.inf)
        # The bounds widen by noise_z sigma of each replica's own count (relative for work).
        slack = self.noise_z * np.sqrt(np.maximum(self._load_rate, 0.0))
        cap_rate = cap_rate + slack
        cap_work = cap_work * (1.0 + slack / np.maximum(self._load_rate, 1.0))
        cap_foot = np.where(self._capacity > 0.0, self.kv_fill * self._capacity, np.inf)
        over = np.nonzero((self._load_rate > cap_rate) | (self._load_work > cap_work) | (self._load_foot > cap_foot))[0]
        if not len(over):
            return
        # Candidates: single-copy keys on an overloaded replica, grouped by replica.
        single = (self._copies == 1) & np.isin(self._primary, over) & ~self._retained_mask()
        slots = np.nonzero(single)[0]
        owners = self._primary[slots]
        for r in over.tolist():
            mine = self._shed_order(slots[owners == r], r, cap_rate[r], cap_work[r], cap_foot[r])
            for slot in mine.tolist():
                if (
                    self._load_rate[r] <= cap_rate[r]
                    and self._load_work[r] <= cap_work[r]
                    and self._load_foot[r] <= cap_foot[r]
                ):
                    break
                self._move(slot, r)

    def _shed_order(
        self, mine: IntArray, r: int, cap_rate: float, cap_work: float, cap_foot: float = math.inf
    ) -> IntArray:
        """The order in which replica ``r`` offers its single-copy keys ``mine`` when over its caps.

        Every move costs the key one cold prefill on its new replica (its prefix stays
        cached where it was), whatever the key's size, so the replica sheds with the
        fewest moves: first the smallest key that covers the whole excess alone, then
        the rest largest first. The excess is the rate's, or else the work's, or else the
        KV footprint's. Precise mode puts the keys whose prefix ``r`` is known not to hold
        in front (moving them costs nothing), in the same order among themselves.
        """
        if not len(mine):
            return mine
        rate_excess = self._load_rate[r] - cap_rate
        work_excess = self._load_work[r] - cap_work
        if rate_excess > 0:
            size, excess = self._rate[mine], rate_excess
        elif work_excess > 0:
            size, excess = self._work[mine], work_excess
        else:
            size = np.where(self._foot[mine] > 0.0, self._foot[mine], self._foot_prior)
            excess = self._load_foot[r] - cap_foot
        by_size = np.argsort(-size, kind="stable")
        mine, size = mine[by_size], size[by_size]
        covering = np.nonzero(size >= excess)[0]
        if len(covering):
            best = int(covering[-1])  # sorted by size descending: the last cover is the smallest
            mine = np.concatenate([mine[best : best + 1], mine[:best], mine[best + 1 :]])
        if self.precise:
            name = self.members[r]
            known_gone = np.fromiter(
                (0 if self.holds(self._keys[s] or "", name) is False else 1 for s in mine.tolist()),
                dtype=np.int64,
                count=len(mine),
            )
            mine = mine[np.argsort(known_gone, kind="stable")]
        return mine

    def _move(self, slot: int, src: int) -> None:
        rate, work, foot = float(self._rate[slot]), float(self._work[slot]), float(self._foot_counted[slot])
        succ = self.successors_of(slot)
        start = succ.index(src) if src in succ else 0
        after = [succ[(start + j) % len(succ)] for j in range(1, len(succ))]
        dst = self._pick(slot, after, rate, work, foot)
        if dst is None:
            return
        self._primary[slot] = dst
        self._unplace(slot)
        self._load_rate[src] -= rate
        self._load_work[src] -= work
        self._load_rate[dst] += rate
        self._load_work[dst] += work
        self._load_foot[src] -= foot
        self._load_foot[dst] += foot
        self.version += 1

    # -- precise mode ---------------------------------------------------------------
    def set_cached(self, replica: str, key: str, cached: bool) -> None:
        """Record whether ``replica`` holds ``key``'s prefix blocks (from KV events)."""
        if cached:
            self._cached.setdefault(key, {})[replica] = True
        else:
            known = self._cached.get(key)
            if known is not None or key in self._slot:
                self._cached.setdefault(key, {})[replica] = False

    # -- KV footprint ---------------------------------------------------------------
    def set_capacity(self, replica: str, tokens: float) -> None:
        """How many tokens of KV ``replica`` holds (0: unknown); the footprints are recounted against it."""
        if self._capacity_of.get(replica, 0.0) == max(float(tokens), 0.0):
            return
        if tokens > 0:
            self._capacity_of[replica] = float(tokens)
        else:
            self._capacity_of.pop(replica, None)
        i = self._index.get(replica)
        if i is not None:
            self._capacity[i] = self._capacity_of.get(replica, 0.0)
        self._recount_footprints()  # the keys placed while no capacity was known counted nothing

    def capacity(self, replica: str) -> float:
        """The tokens of KV ``replica`` holds as last told (0: unknown)."""
        return self._capacity_of.get(replica, 0.0)

    def set_footprint(self, key: str, tokens: float) -> None:
        """The tokens of ``key``'s static prefix (the largest told), counted at once on the replicas
        it is placed on (until then it counted as the mean of those known)."""
        slot = self._slot.get(key)
        if slot is None or tokens <= self._foot[slot]:
            return
        old = float(self._foot[slot])
        self._foot[slot] = float(tokens)
        known = self._foot_known
        known[0] += tokens - old
        known[1] += old == 0.0
        if self._primary[slot] >= 0 and self._capacity_of:
            delta = tokens - float(self._foot_counted[slot])
            for i in self._placed(slot):
                self._load_foot[i] += delta
            self._foot_counted[slot] = tokens

    def footprints(self) -> dict[str, tuple[float, float]]:
        """Per member: (the KV footprint placed on it, its capacity), tokens (0: unknown)."""
        return {n: (float(self._load_foot[i]), float(self._capacity[i])) for i, n in enumerate(self.members)}

    # -- inspection and agreement ---------------------------------------------------
    def loads(self) -> dict[str, tuple[float, float]]:
        """Per member: (placed request rate, placed prefill work), decayed counts as of the last event."""
        return {n: (float(self._load_rate[i]), float(self._load_work[i])) for i, n in enumerate(self.members)}

    def stats(self, key: str) -> tuple[float, float] | None:
        """A key's (decayed request count, decayed uncached tokens) in the table's units, None if unknown."""
        slot = self._slot.get(key)
        return None if slot is None else (float(self._rate[slot]), float(self._work[slot]))

    def rate_copies(self, key: str, now: float, per_copy: float | None = None) -> int:
        """The replicas the key's share of the request rate fills: one per ``per_copy`` (default
        ``hot_share``) of a replica's fair share, rounded up as hot-key copies are, 1 to one per
        member (1 if unknown).

        The share is the one the key surely has: its observed share less ``noise_z`` binomial
        standard deviations of a share estimated from the table's (decayed) request count. A
        tenant that sent two of the first three requests has not shown that it needs two
        replicas, and a copy of its prefix costs a cold prefill and another tenant's cached
        blocks; a key that sent every request has, from its first few.
        """
        slot = self._slot.get(key)
        n = len(self.members)
        if slot is None or n < 2 or self._total_rate <= 0:
            return 1
        count = self._total_rate / self._unit(now)  # requests seen, decayed to now (may renormalize)
        share = float(self._rate[slot]) / self._total_rate
        share -= self.noise_z * math.sqrt(max(share * (1.0 - share), 0.0) / max(count, 1.0))
        return min(n, max(1, math.ceil(share * n / (self.hot_share if per_copy is None else per_copy))))

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def keys(self) -> list[str]:
        """Every key the table knows."""
        return list(self._slot)

    def snapshot(self, now: float) -> dict[str, Any]:
        """The table as JSON-serializable data, statistics decayed to ``now`` (see the module docstring)."""
        f = 1.0 if self._t0 is None else math.exp(-(now - self._t0) / self.tau_s)
        keys: dict[str, Any] = {}
        for key, slot in self._slot.items():
            keys[key] = {
                "replicas": self.placement(key),
                "rate": float(self._rate[slot]) * f,
                "work": float(self._work[slot]) * f,
                "foot": float(self._foot[slot]),
                "age": max(0.0, now - float(self._seen[slot])),
            }
        return {"format": SNAPSHOT_FORMAT, "version": self.version, "members": list(self.members), "keys": keys}

    def apply(self, snapshot: Mapping[str, Any], now: float) -> None:
        """Replace keys, placements and statistics with a snapshot's (taken at the publisher's "now").

        Call ``set_members`` first (the snapshot's ``members``). Replicas the
        snapshot names that are not members are dropped; a key left without one
        is placed again at its next request. Precise-mode knowledge is kept.
        """
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown placement snapshot format {snapshot.get('format')!r}")
        entries = snapshot.get("keys")
        if not isinstance(entries, Mapping):
            raise ValueError("placement snapshot: 'keys' must map routing keys to entries")
        for key in list(self._slot):
            self._slot.pop(key)
        self._keys = []
        self._free = []
        self._rate = np.zeros(0)
        self._work = np.zeros(0)
        self._foot = np.zeros(0)
        self._foot_counted = np.zeros(0)
        self._primary = np.zeros(0, dtype=np.int64)
        self._copies = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=np.bool_)
        self._seen = np.zeros(0)
        self._extra = {}
        self._succ = []
        self._placed_memo = {}
        self._t0 = self._now = now
        for key, entry in entries.items():
            slot = self._new_slot(str(key))
            self._rate[slot] = float(entry["rate"])
            self._work[slot] = float(entry["work"])
            self._foot[slot] = float(entry.get("foot", 0.0))
            self._seen[slot] = now - float(entry.get("age", 0.0))
            idx = [self._index[n] for n in entry["replicas"] if n in self._index]
            if idx:
                self._primary[slot] = idx[0]
                self._copies[slot] = len(idx)
                if len(idx) > 1:
                    self._extra[slot] = idx[1:]
        self._recompute_loads()
        self.version = int(snapshot["version"])
