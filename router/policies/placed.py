"""``placed`` (the default policy): keys placed on ring replicas, hot keys replicated, conversations followed.

Job: the per-request decision over the placement table (router/policies/placement.py,
which says where each key lives and rebalances it) and the history index
(router/policies/history.py, which replica holds how much of a prompt). The class
docstring states the decision. Pure Python.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol

from prefixserve.router.policies.base import (
    KIND_HISTORY,
    KIND_NEW_CONVERSATION,
    KIND_NO_KEY,
    KIND_OWNER,
    KIND_PLACED,
    KIND_REPLICATED,
    KIND_SPILL,
    Decision,
    R,
    Replica,
    ReplicaLoad,
    ReplicaView,
    RingOptions,
    adapters_full,
    check_candidates,
    effective_in_flight,
    holds_adapter,
)
from prefixserve.router.policies.consistent import RingPolicy
from prefixserve.router.policies.history import DEFAULT_MAX_ENTRIES, HistoryIndex
from prefixserve.router.policies.placement import PlacementTable
from prefixserve.router.policies.recent import RecentCounts
from prefixserve.router.ring import HashRing

BALANCE_EPSILON: float | None = None
# Off by default: request-count balance costs TTFT p99 everywhere and hit rate on small
# clusters (docs/benchmarks/routing_conversations.md); 300 s is the measured setting.
RECENT_TAU_S: float | None = None
MOVE_EPSILON: float | None = 0.25


@dataclass(frozen=True)
class PlacedOptions(RingOptions):
    """Options of ``placed`` (router/policies/placement.py explains the mechanism).

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
    kv_host_weight, kv_disk_weight: in precise mode, what a prefix block a replica holds in
        its host tier, or that its shared disk directory holds, counts for against a device
        block (1) when the KV events say whether the replica holds a key's prefix
        (replica/contract/kv_events.py ``TierWeights``): cheaper than a recompute (0).
    leader: rebalance on its own; False for a follower that only applies
        snapshots published by the leader (``apply_snapshot``).
    noise_z: rebalancing moves a key, and ``move_epsilon`` a conversation, only for
        an excess above this many standard deviations of the (Poisson) request counts
        behind it (>= 0; 0 trusts every count): a young or small cluster does not pay
        cold prefills for noise.
    history_max_entries: bound of the router-side history index (router/policies/history.py;
        block hashes, least recently used evicted; 0 disables history matching).
    new_epsilon: a new conversation goes to the least loaded replica of its key's
        set: the placement, grown by ring successors to one replica per ``1 +
        new_epsilon`` fair shares (mean in-flight, at least 1) of the key's own
        in-flight requests (counted by ``rank``, ended by ``done``); a key that is not
        conversational (see ``conversation_spread``) grows to at most
        ``PlacementTable.rate_copies`` replicas (its share of the requests); None keeps
        new conversations on the placement alone.
    conversation_spread: a key at least half of whose recent decisions followed a
        history (a conversational app) has its set grown by this many more ring
        successors for new conversations (0, the default: off; on small clusters with
        long static prefixes the copies thrash the caches).
    balance_epsilon: with a history, the history and new-conversation branches take
        a replica only under ``mean * (1 + balance_epsilon) + 1`` in flight (and the
        ordinary cap); past it the request falls to the placement and spill logic.
        None: the ordinary cap alone.
    recent_tau_s: time constant (seconds) of the per-replica decayed counts of
        requests sent (router/policies/recent.py). A conversational key's new
        conversation goes to the replica of its set sent the fewest recently (then
        the least in flight): a conversation stays where it starts, so these are its
        sessions' future load. None (the default): by in-flight alone.
    recent_epsilon: with ``recent_tau_s``, a conversational key's new conversation
        whose whole set is over the cap goes to the first ring successor under it
        whose recent count is under ``mean * (1 + recent_epsilon) + 1``, else spills
        as any request.
    move_epsilon: with ``recent_tau_s``, a later turn whose history holders were all
        sent ``conversation_move_bound(mean, move_epsilon, noise_z)`` recent requests
        or more is placed as a new conversation (it recomputes its history once).
        None: never moved for balance.
    kv_fill: the share of a replica's KV capacity (its reported ``kv_capacity_tokens``) the
        static prefixes of the keys placed on it may fill (``observe``'s ``static_tokens``): a
        new or shed key goes past a replica they would overfill (placement.py, "KV footprint").
    retain_s: how long after a request asking for ``prompt_cache_retention`` its key stays where
        it is placed (``retain``): rebalancing neither moves nor forgets it, its replica holding
        its pinned prefix (the engines' ``cache_retention_ttl_s``, a day, by default).
    clock: seconds, monotonic (default ``time.monotonic``); tests inject one.
    """

    epsilon: float = 0.2
    work_epsilon: float | None = 0.5
    tau_s: float = 300.0
    rebalance_interval_s: float = 10.0
    hot_share: float = 0.5
    precise: bool = False
    kv_host_weight: float = 0.9
    kv_disk_weight: float = 0.6
    leader: bool = True
    noise_z: float = 2.0
    history_max_entries: int = DEFAULT_MAX_ENTRIES
    new_epsilon: float | None = 0.25
    conversation_spread: int = 0
    balance_epsilon: float | None = BALANCE_EPSILON
    recent_tau_s: float | None = RECENT_TAU_S
    recent_epsilon: float = 0.1
    move_epsilon: float | None = MOVE_EPSILON
    retain_s: float = 86400.0
    kv_fill: float = 0.9
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
            "recent_tau_s",
            "recent_epsilon",
            "move_epsilon",
            "retain_s",
        ):
            v = getattr(self, name)
            if name in ("work_epsilon", "new_epsilon", "balance_epsilon", "recent_tau_s", "move_epsilon") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        z = self.noise_z
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"noise_z must be a finite number >= 0, got {z!r}")
        for name in ("kv_host_weight", "kv_disk_weight", "kv_fill"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
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


def conversation_move_bound(mean: float, move_epsilon: float, noise_z: float) -> float:
    """Recent requests at which a conversation's replica is over its share: ``m + max(e m, z sqrt(m)) + 1``.

    For mean recent count m, ``move_epsilon`` e and ``noise_z`` z: proportional slack
    on a large cluster's counts, z standard deviations of a Poisson count on a small
    one's, where a few dozen requests split unevenly by chance alone and a move
    recomputes a conversation's whole history for that noise.
    """
    return mean + max(move_epsilon * mean, noise_z * math.sqrt(mean)) + 1.0


# Bounds on ``placed``'s memos (a full memo is dropped and refills): its per-key ring orders in
# candidate positions hold at most this many positions in all (32 MB of references), and each key
# at most this many rankings (one per first choice and placement). Orders of ring points are the
# ring's own memo (HashRing.order).
_MAX_MEMO_POSITIONS = 4_000_000
_MAX_RANKINGS_PER_KEY = 8
# Keys whose history-branch share ``placed`` tracks (conversation_spread); the table is cleared when full.
_MAX_CONVERSATIONAL_KEYS = 200_000
# Decisions of its own after which a key is judged conversational or not by them alone.
_OWN_EVIDENCE = 8


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


class PromptHistory(Protocol):
    """A prompt's chained block hashes as the hosts hold them (replica/contract/prompt_blocks.py PromptBlocks)."""

    @property
    def hashes(self) -> Sequence[bytes]: ...

    @property
    def static_blocks(self) -> int: ...


class Placed(RingPolicy):
    """Ring-placed bounded loads (the default): keys placed on ring replicas, hot keys replicated.

    Per request: the key's request is counted (router/policies/placement.py places a new
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
        self.table = PlacementTable(
            o.epsilon, o.tau_s, o.hot_share, o.precise, o.work_epsilon, o.noise_z, kv_fill=o.kv_fill
        )
        # key -> the share of its latest ranked prompt's blocks its static prefix covers: with an
        # answer's prompt tokens, the tokens of its KV footprint (``observe``).
        self._static_share: dict[str, float] = {}
        self.history = HistoryIndex(o.history_max_entries) if o.history_max_entries else None
        self.recent = RecentCounts(o.recent_tau_s) if o.recent_tau_s is not None else None
        self._next_rebalance: float | None = None
        self._table_members: tuple[tuple[str, int], ...] = ()
        self._turns: dict[str, int] = {}  # replicated key -> requests counted (tie rotation)
        self._key_in_flight: dict[str, int] = {}  # key -> its requests ranked and not yet ``done``
        self._conversational: dict[str, list[int]] = {}  # key -> [history decisions, decisions]
        self._fleet_turns = [0, 0]  # every key's [history decisions, decisions], halved as a key's are
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
        self._static_share = {k: s for k, s in self._static_share.items() if k in self.table}
        return changed

    def _set_view(self, candidates: Sequence[ReplicaView], names: list[str]) -> HashRing:
        """Adopt a new candidate list: check it, sync the ring and table, map names to positions."""
        check_candidates(candidates)
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
        events_held: Mapping[str, int] | None = None,
        adapter: str | None = None,
    ) -> Decision[R]:
        """Rank for one request of ``key``; ``count=False`` for a retry of a request already counted.

        ``history``: the chained block hashes of the request's whole prompt (Contract 2,
        or the ingress's text blocks: any chained hashes the caller computes alike for
        every request); ``static_blocks``: how many of them the static prefix covers.
        With a history, a request of which some replica holds more than the static
        prefix goes to the one holding most (KIND_HISTORY) if under the cap; a new
        conversation to the least loaded of the key's set (PlacedOptions.new_epsilon)
        under the cap. Call ``done(key)`` when a counted request ends.
        ``events_held``: per replica, the leading blocks of ``history`` its KV events say it holds
        (the standalone router's index); a replica counts as holding the larger of that and what
        the history index says. Not stored: when the events say a block is gone, it is.
        ``adapter``: the LoRA adapter the request runs with (its key already names it). Among
        the replicas the decision would take alike (the key's set under the cap, the spill's
        ring successors) those whose reported load holds the adapter come first: a replica
        without it reads the adapter's files before the request's prefill. When none of the
        key's replicas holds it (and no history decides), the request goes to a replica holding
        it under the cap, else, when the key's replica holds all the adapters it can, to the
        first ring successor under the cap with room for one more (KIND_SPILL).

        The class docstring states the decision; this path reads each candidate
        once and reuses, per key, its ring order in candidate positions and the
        ranking for its first choice while the caller passes the same candidate
        names in the same order (tests/router/policies/test_placement.py checks it against a
        direct statement of the decision on random inputs).
        """
        names = [c.name for c in candidates]
        if key is None:
            if names != self._view_names:
                check_candidates(candidates)
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
                if load.kv_capacity_tokens != self.table.capacity(c.name):
                    self.table.set_capacity(c.name, load.kv_capacity_tokens)
            loads.append(f)
        cap = in_flight_cap(sum(loads) / len(candidates))
        holding: frozenset[int] = frozenset()
        if adapter is not None:
            holding = frozenset(p for p, c in enumerate(candidates) if holds_adapter(c, adapter))
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
        if history and (self.history is not None or events_held):
            pos = self._view_pos
            if self.history is not None:
                held = {pos[n]: b for n, b in self.history.held(history).items() if n in pos}
            for n, b in (events_held or {}).items():
                p = pos.get(n)
                if p is not None and b > held.get(p, 0):
                    held[p] = b
            best = max(held.values(), default=0)
        conv_cap = cap
        if history is not None and self.options.balance_epsilon is not None:
            conv_cap = min(cap, sum(loads) / len(candidates) * (1.0 + self.options.balance_epsilon) + 1.0)
        recent: list[float] = []
        recent_bound = move_bound = math.inf
        turns = self._conversational.get(key)
        conversational = turns is not None and 2 * turns[0] >= turns[1]
        if history is not None and self.recent is not None and conversational:
            # A conversational key (most of its requests follow a history): its replicas' recent
            # requests are its sessions' future load. A one-shot key keeps the placement's balance.
            recent = self.recent.counts(names, now)
            mean_recent = sum(recent) / len(recent)
            recent_bound = mean_recent * (1.0 + self.options.recent_epsilon) + 1.0
            if self.options.move_epsilon is not None:
                move_bound = conversation_move_bound(mean_recent, self.options.move_epsilon, self.options.noise_z)
        if history:
            self._static_share[key] = min(static_blocks, len(history)) / len(history)
        if best > static_blocks:
            # A conversation's later turn: the replica holding most of its history, if under the cap
            # (the least loaded of several, the placement's first).
            holders = [p for p, b in held.items() if b == best and loads[p] < conv_cap]
            if recent:
                holders = [p for p in holders if recent[p] < move_bound]
            if holders:
                chosen = min(holders, key=lambda p: (loads[p], p not in placed, p))
                kind = KIND_HISTORY
        move = -1
        if chosen < 0 and adapter is not None and not any(p in holding for p in placed):
            # The key's replicas lack its adapter. A replica holding it under the cap (it ran the
            # adapter lately, so likely the key's prefix too); else, when the key's replica holds
            # all the adapters it can (loading one more evicts another, which comes back to load
            # again), the first ring successor under the cap with room for it.
            move = next((p for p in order if p in holding and loads[p] < cap), -1)
            if move < 0 and adapters_full(candidates[first]):
                move = next((p for p in order if loads[p] < cap and not adapters_full(candidates[p])), -1)
        if chosen >= 0 or move >= 0:
            pass
        elif history is not None and self.options.new_epsilon is not None and count:
            # A new conversation (nothing beyond the static prefix held anywhere): the least
            # loaded replica of the key's set under the cap. The set is the placement, grown
            # by the next ring successors while the key's own in-flight requests exceed what
            # ``1 + new_epsilon`` replicas' fair shares hold, so it grows with the key's load
            # from its first requests and shrinks when they finish.
            share = max(1.0, sum(loads) / len(candidates)) * (1.0 + self.options.new_epsilon)
            want = min(len(order), math.ceil((self._key_in_flight.get(key, 0) + 1) / share))
            # ...but a key whose requests do not continue conversations (a tenant's one-shot
            # prompts) only as far as its share of the requests needs: one replica per ``1 +
            # epsilon`` fair shares (a replica's bound), rounded up. Its requests in flight at
            # once on a small cluster are noise, and a copy of its static prefix evicts another
            # tenant's and costs a prefill; copies for a share under that are the rebalance's
            # (hot_share), on the evidence of its counts. A key that is all of the traffic grows
            # from its first requests; a conversational key grows by in-flight alone (its
            # sessions stay where they start, so they must spread as they start), and so does a
            # young key among conversations, until its own decisions show what it is.
            one_shot = not conversational and not self._young_in_conversational_traffic(turns)
            if one_shot:
                want = max(1, min(want, table.rate_copies(key, now, per_copy=1.0 + self.epsilon)))
            # A key whose requests mostly continue conversations (an app's users' chats):
            # its new conversations also spread over its next ring successors, since a
            # conversation stays where it starts and one static-prefix miss buys all its turns.
            if conversational and self.options.conversation_spread:
                want = min(len(order), max(want, len(placed)) + self.options.conversation_spread)
            group = list(placed)
            if want > len(group):
                group += [p for p in order if p not in placed][: want - len(group)]
            under = [p for p in group if loads[p] < conv_cap]
            if recent and not under:
                # The whole set over the cap: the first ring successor under it whose recent
                # requests are within recent_epsilon of the mean (a spill that would not pile
                # conversations onto a replica their sessions already load).
                more = next((p for p in order if loads[p] < conv_cap and recent[p] < recent_bound), None)
                under = [more] if more is not None else []
            if holding and under:
                under = [p for p in under if p in holding] or under
            if recent and under:
                # Of those, the fewest requests sent recently: a conversation stays where it
                # starts, so they are the load its sessions will bring, which in flight is not.
                low_recent = min(recent[p] for p in under)
                under = [p for p in under if recent[p] == low_recent]
            if under:
                low = min(loads[p] for p in under)
                tied = [p for p in under if loads[p] == low]
                turn = self._turns.get(key, 0)
                if len(group) > 1:
                    self._turns[key] = turn + 1
                chosen = tied[turn % len(tied)]
                kind = KIND_NEW_CONVERSATION if chosen in placed else KIND_SPILL
                if one_shot and chosen not in placed and self.options.leader:
                    # The key's share of the requests fills this replica too, and the request
                    # computes its prefix there: a copy the key's later requests use (as the
                    # rebalance's copies are), not one made for a single request.
                    table.add_copy(key, names[chosen])
        if chosen >= 0:
            pass
        elif move >= 0:
            chosen = move
            kind = KIND_SPILL
        elif len(placed) == 1 and loads[first] < cap:  # the common case: one replica, under the cap
            chosen = first
            kind = KIND_OWNER if first == order[0] else KIND_PLACED
        else:
            under = [p for p in placed if loads[p] < cap]
            if holding and under:
                under = [p for p in under if p in holding] or under
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
                # The first ring successor outside the placement under the cap (one holding the
                # request's adapter first), else the least loaded.
                spill = next((p for p in order if loads[p] < cap and p not in placed and p in holding), None)
                if spill is None:
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
            fleet = self._fleet_turns
            for t in (turns, fleet):
                t[0] += kind == KIND_HISTORY
                t[1] += 1
                if t[1] >= 64:
                    t[0] //= 2
                    t[1] //= 2
        if count:
            self._key_in_flight[key] = self._key_in_flight.get(key, 0) + 1
            if self.recent is not None:
                self.recent.add(names[chosen], now)
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

    def rank_prompt(
        self,
        candidates: Sequence[R],
        key: str | None,
        blocks: PromptHistory | None,
        count: bool = True,
        events_held: Mapping[str, int] | None = None,
        adapter: str | None = None,
    ) -> Decision[R]:
        """``rank`` with the prompt's block hashes as both hosts hold them (None: the prompt has none)."""
        return self.rank(
            candidates,
            key,
            count=count,
            history=blocks.hashes if blocks is not None else None,
            static_blocks=blocks.static_blocks if blocks is not None else 0,
            events_held=events_held,
            adapter=adapter,
        )

    def _young_in_conversational_traffic(self, turns: list[int] | None) -> bool:
        """Whether a key too young to judge by its own decisions (every request of a new key
        starts a conversation, whether or not it will continue) is in traffic with conversations
        (a recent decision followed a history): its new conversations then spread as a
        conversational key's do, not only as far as its share of the requests surely carries it."""
        if turns is not None and turns[1] >= _OWN_EVIDENCE:
            return False
        return self._fleet_turns[0] > 0

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

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None = None) -> int:
        """Record the prefill work of one request of ``key`` (see the class docstring), and the
        tokens of its static prefix, its KV footprint: ``prompt_tokens`` times the share of the
        blocks the static prefix covered in the key's latest ranked prompt. Returns those tokens
        (0 when the key was ranked with no history)."""
        uncached = prompt_tokens - (cached_tokens or 0)
        self.table.observe(key, max(0, uncached), self._clock())
        static_tokens = round(prompt_tokens * self._static_share.get(key, 0.0))
        if static_tokens:
            self.table.set_footprint(key, static_tokens)
        return static_tokens

    def refused(self, key: str) -> None:
        """A request of ``key`` ranked with ``count=True`` was refused by its replica as a client error:
        take its count back (a key seen only in refused requests leaves the table). Call ``done`` too."""
        self.table.unrecord(key, self._clock())

    def retain(self, key: str) -> None:
        """A request of ``key`` (ranked with ``count=True``) asked its replica to pin its prefix:
        keep the key where it is placed for ``retain_s`` (router/policies/placement.py)."""
        self.table.retain(key, self._clock() + self.options.retain_s)

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
        self._static_share = {k: s for k, s in self._static_share.items() if k in self.table}
