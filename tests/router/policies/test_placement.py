"""The ``placed`` policy (router/policies/placed.py) and its placement table, on an injected clock."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.loadtest.bench_placement import bench_rebalance
from prefixserve.loadtest.bench_policies import bench_rank
from prefixserve.router.policies import (
    KIND_NO_KEY,
    KIND_OWNER,
    KIND_PLACED,
    KIND_REPLICATED,
    KIND_SPILL,
    Decision,
    Placed,
    Replica,
    ReplicaLoad,
    effective_in_flight,
    in_flight_cap,
    make_policy,
    pick_options,
)
from prefixserve.router.policies import placed as placed_module
from prefixserve.router.policies.placement import PlacementTable
from prefixserve.router.ring import HashRing

NAMES = [f"10.0.0.{i}:8000" for i in range(1, 5)]


class Clock:
    """A settable clock: the policy's time, no wall clock involved."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Loaded:
    """A ReplicaView carrying a replica-reported load."""

    name: str
    in_flight: int
    load: ReplicaLoad | None = None


def fleet(in_flight: dict[str, int] | None = None, names: list[str] = NAMES) -> list[Replica]:
    return [Replica(n, (in_flight or {}).get(n, 0)) for n in names]


def policy(clock: Clock, **options: object) -> Placed:
    # The mechanism tests drive a few dozen requests, every count trusted; the noise
    # gate (noise_z, on by default) has its own test.
    options.setdefault("noise_z", 0.0)
    p = make_policy("placed", clock=clock, **options)
    assert isinstance(p, Placed)
    return p


def keys_owned_by(owner: str, count: int, names: list[str] = NAMES) -> list[str]:
    ring = HashRing(names)
    found = [k for k in (f"key-{i}" for i in range(10_000)) if ring.owner(k) == owner]
    return found[:count]


def skewed_snapshot(
    version: int, rates: list[float], others_each: int, other_rate: float
) -> tuple[list[str], list[str], dict[str, object]]:
    """A leader's snapshot over NAMES in which NAMES[0] holds keys of its own at ``rates`` and every
    other replica ``others_each`` of its own keys at ``other_rate``: (NAMES[0]'s keys, the others', it)."""
    ring = HashRing(NAMES)
    a = NAMES[0]
    mine = keys_owned_by(a, len(rates))
    others = [k for n in NAMES[1:] for k in keys_owned_by(n, others_each)]
    snap = {
        "format": 1,
        "version": version,
        "members": NAMES,
        "weights": {},
        "keys": {
            **{k: {"replicas": [a], "rate": r, "work": 0.0} for k, r in zip(mine, rates)},
            **{k: {"replicas": [ring.owner(k)], "rate": other_rate, "work": 0.0} for k in others},
        },
    }
    return mine, others, snap


def drive(p: Placed, clock: Clock, keys: list[str], seconds: float, rate: float = 10.0) -> None:
    """Requests of ``keys`` in turn at ``rate`` per second for ``seconds``, all replicas idle."""
    n = int(seconds * rate)
    for i in range(n):
        clock.t += 1.0 / rate
        p.rank(fleet(), keys[i % len(keys)])


# ------------------------------------------------------------------- the decision


def test_new_keys_go_to_their_ring_owner_when_it_has_room() -> None:
    clock = Clock()
    p = policy(clock)
    ring = HashRing(NAMES)
    # one key per owner: every owner is empty, so each key lands on its owner
    keys = [keys_owned_by(n, 1)[0] for n in NAMES]
    for k in keys:
        d = p.rank(fleet(), k)
        assert d.chosen.name == ring.owner(k) == d.owner and not d.spilled and d.kind == KIND_OWNER
        assert p.placement(k) == [ring.owner(k)]


def test_a_new_key_goes_to_its_first_ring_successor_with_room() -> None:
    clock = Clock()
    p = policy(clock, epsilon=0.1)
    keys = [f"k{i}" for i in range(200)]
    ring = HashRing(NAMES)
    for i, k in enumerate(keys):
        clock.t = i * 0.01
        before = p.table.loads()
        total = sum(r for r, _ in before.values())
        placed = p.rank(fleet(), k).chosen.name
        # the reference rule: the first successor whose placed rate stays within (1+eps) of the fair share
        succ = ring.successors(k)
        w = math.exp((clock.t - 0.0) / 300.0)
        rates = {n: before.get(n, (0.0, 0.0))[0] for n in NAMES}
        room = [n for n in succ if rates[n] <= 0 or rates[n] + w <= 1.1 * (total + w) / 4]
        assert placed == (room[0] if room else succ[0])


def test_keyless_requests_go_least_loaded() -> None:
    p = policy(Clock())
    d = p.rank(fleet({NAMES[0]: 3, NAMES[1]: 1, NAMES[2]: 2, NAMES[3]: 1}), None)
    assert [c.name for c in d.ranking] == [NAMES[1], NAMES[3], NAMES[2], NAMES[0]]
    assert d.kind == KIND_NO_KEY and d.owner is None


def one_key_routed() -> tuple[Placed, str, list[str]]:
    """A policy that routed one key of NAMES[0]'s once, all idle: (it, the key, the key's ring successors)."""
    p = policy(Clock())
    key = keys_owned_by(NAMES[0], 1)[0]
    p.rank(fleet(), key)
    return p, key, HashRing(NAMES).successors(key)


def test_over_the_in_flight_cap_spills_to_the_next_ring_successor_under_it() -> None:
    p, key, succ = one_key_routed()
    assert p.placement(key) == [succ[0]]
    # mean in-flight m = 4: cap = 4 + max(2, 6) + 1 = 11
    assert in_flight_cap(4.0) == 11.0
    loads = {succ[0]: 11, succ[1]: 3, succ[2]: 1, succ[3]: 1}
    d = p.rank(fleet(loads), key)
    assert d.chosen.name == succ[1] and d.kind == KIND_SPILL and d.spilled and d.owner == succ[0]
    assert [c.name for c in d.ranking] == [succ[1], succ[0], succ[2], succ[3]]
    # just under the cap: affinity holds however loaded the owner looks
    loads[succ[0]] = 10
    assert p.rank(fleet(loads), key).chosen.name == succ[0]
    # the successor over the cap too: the next one under it
    loads = {succ[0]: 30, succ[1]: 30, succ[2]: 0, succ[3]: 0}
    assert p.rank(fleet(loads), key).chosen.name == succ[2]


def test_replica_reported_load_counts_when_higher_than_the_routers_own() -> None:
    p, key, succ = one_key_routed()
    busy = [Loaded(n, 0, ReplicaLoad(num_waiting=40 if n == succ[0] else 0)) for n in NAMES]
    assert p.rank(busy, key).chosen.name == succ[1]
    quiet = [Loaded(n, 0, None) for n in NAMES]  # no load reported: in_flight alone
    assert p.rank(quiet, key).chosen.name == succ[0]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=6),
    st.lists(st.sampled_from([f"t{i}" for i in range(12)] + [None]), min_size=1, max_size=40),
)
def test_the_ranking_is_chosen_then_placement_then_ring_order(loads: list[int], keys: list[str | None]) -> None:
    clock = Clock()
    p = policy(clock, rebalance_interval_s=1.0, hot_share=0.3)
    names = [f"10.1.0.{i}:80" for i in range(len(loads))]
    cands = [Replica(n, x) for n, x in zip(names, loads)]
    ring = HashRing(names)
    for step, key in enumerate(keys):
        clock.t = step * 0.7
        d = p.rank(cands, key)
        got = [c.name for c in d.ranking]
        assert sorted(got) == sorted(names) and all(c in cands for c in d.ranking)
        if key is None:
            continue
        placed = p.placement(key)
        order = ring.successors(key)
        rest = [n for n in placed if n != got[0]]
        assert got == [got[0], *rest, *(n for n in order if n != got[0] and n not in rest)]
        assert d.owner == order[0]
        cap = in_flight_cap(sum(loads) / len(loads))
        under = [n for n in placed if dict(zip(names, loads))[n] < cap]
        if under:
            assert got[0] in under and d.kind in (KIND_OWNER, KIND_PLACED, KIND_REPLICATED)
        else:
            assert d.kind == KIND_SPILL


class ReferenceTable(PlacementTable):
    """The placement table stated directly: ring orders walked afresh, placements read from the arrays,
    ``_pick`` scanning every member (what the memoized, early-exit paths must equal)."""

    def set_members(self, names, weights, successors) -> None:  # type: ignore[no-untyped-def]
        ring = HashRing(list(zip(names, weights)))
        super().set_members(names, weights, ring.successors)

    def placement(self, key: str) -> list[str]:
        slot = self._slot.get(key)
        if slot is None or self._primary[slot] < 0:
            return []
        return [self.members[int(self._primary[slot])]] + [self.members[i] for i in self._extra.get(slot, ())]

    def record(self, key: str, now: float) -> list[str]:
        if not self.members:
            raise ValueError("the placement table has no members")
        w = self._unit(now)
        self._now = now
        slot = self._slot.get(key)
        if slot is None:
            slot = self._new_slot(key)
        self._rate[slot] += w
        self._total_rate += w
        self._seen[slot] = now
        if self._primary[slot] < 0:
            self._place_new(slot)
        else:
            placed = self.placement(key)
            for n in placed:
                self._load_rate[self._index[n]] += w / len(placed)
        return self.placement(key)

    def _pick(self, slot: int, order, rate: float, work: float, foot: float = 0.0) -> int | None:  # type: ignore[no-untyped-def]
        # Room in rate, work and footprint; else in rate and footprint; else in rate alone.
        with_room = [i for i in order if self._room(i, rate, work, foot)]
        if not with_room:
            with_room = [i for i in order if self._room(i, rate, None, foot)]
        if not with_room:
            with_room = [i for i in order if self._room(i, rate, None)]
        if not with_room:
            return None
        if self.precise:
            key = self._keys[slot]
            assert key is not None
            for i in with_room:
                if self.holds(key, self.members[i]):
                    return i
        return with_room[0]


def reference_rank(p: Placed, candidates: list[Loaded], key: str | None, count: bool = True) -> Decision:
    """``Placed.rank``'s decision stated directly (no memo but the ring's), on ``p``'s state."""
    if not candidates or len({c.name for c in candidates}) != len(candidates):
        raise ValueError("bad candidates")
    if key is None:
        return Decision(sorted(candidates, key=lambda c: (effective_in_flight(c), c.name)), kind=KIND_NO_KEY)
    ring = p._sync_members(candidates)
    now = p._clock()
    if p.options.leader and (p._next_rebalance is None or now >= p._next_rebalance):
        if p._next_rebalance is not None:
            p._rebalance(now)
        p._next_rebalance = now + p.options.rebalance_interval_s
    for c in candidates:  # a reported KV capacity is the table's from then on
        if c.load is not None:
            p.table.set_capacity(c.name, c.load.kv_capacity_tokens)
    placed = p.table.record(key, now) if count else p.table.placement(key)
    order = ring.successors(key)
    by_name = {c.name: c for c in candidates}
    loads = {c.name: effective_in_flight(c) for c in candidates}
    cap = in_flight_cap(sum(loads.values()) / len(candidates))
    if not placed:
        placed = [order[0]]
    under = [n for n in placed if loads[n] < cap]
    if under:
        low = min(loads[n] for n in under)
        tied = [n for n in under if loads[n] == low]
        turn = p._turns.get(key, 0)
        if count and len(placed) > 1:
            p._turns[key] = turn + 1
        chosen = tied[turn % len(tied)]
        kind = KIND_REPLICATED if chosen != placed[0] else KIND_OWNER if chosen == order[0] else KIND_PLACED
    else:
        spill = [n for n in order if n not in placed and loads[n] < cap]
        chosen = spill[0] if spill else min(order, key=lambda n: loads[n])
        kind = KIND_SPILL
    rest = [n for n in placed if n != chosen]
    names = [chosen, *rest, *(n for n in order if n != chosen and n not in rest)]
    return Decision([by_name[n] for n in names], owner=order[0], kind=kind)


@pytest.mark.parametrize("seed", range(12))
def test_rank_decides_as_the_direct_statement_of_the_decision(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memoized per-request path (positions, cached placements, early-exit room) against
    ``reference_rank`` on a ``ReferenceTable``, fed the same random stream: candidate sets that
    change and reorder, loads with and without reports, counted and uncounted requests,
    keyless requests, prefill work, rebalances (hot keys, shedding), precise events, snapshots.
    Half the seeds run with tiny memo bounds, so that every memo is dropped and refilled often."""
    if seed >= 6:
        monkeypatch.setattr(placed_module, "_MAX_MEMO_POSITIONS", 40)
        monkeypatch.setattr(placed_module, "_MAX_RANKINGS_PER_KEY", 2)
    rng = random.Random(seed)
    precise = seed % 2 == 1
    clock = Clock()
    options = {
        "rebalance_interval_s": 1.0,
        "hot_share": 0.2,
        "epsilon": 0.1,
        "precise": precise,
        "noise_z": 0.0 if seed % 3 else 1.0,
    }
    fast = policy(clock, **options)
    ref = policy(clock, **options)
    ref.table = ReferenceTable(
        ref.table.epsilon, ref.table.tau_s, ref.table.hot_share, precise, ref.table.work_epsilon, ref.table.noise_z
    )
    pool = [f"10.2.0.{i}:80" for i in range(9)]
    names = rng.sample(pool, 6)
    keys = [f"k{i}" for i in range(40)]
    spread = rng.choice([3, 12, 40])
    # KV capacities (some replicas unknown) and static prefixes: placements bounded by footprints too.
    with_capacity = seed % 4 != 0
    capacities = {n: rng.choice([0, 2000, 5000, 20000]) for n in pool}
    kinds: Counter[str] = Counter()
    for step in range(1500):
        clock.t += rng.expovariate(20.0)
        r = rng.random()
        if r < 0.01:
            names = rng.sample(pool, rng.randint(1, len(pool)))  # membership changes
        elif r < 0.03:
            rng.shuffle(names)  # same members, another order
        cands = []
        for n in names:
            # some over the in-flight cap, so that requests spill
            f = rng.randint(0, spread) if rng.random() < 0.7 else rng.randint(4 * spread, 8 * spread)
            capacity = capacities.get(n, 0) if with_capacity else 0
            load = (
                None
                if rng.random() < 0.3
                else ReplicaLoad(rng.randint(0, spread), rng.randint(0, 4), kv_capacity_tokens=capacity)
            )
            cands.append(Loaded(n, f, load))
        u = rng.random()
        key = None if u < 0.05 else f"new-{step}" if u < 0.1 else keys[min(int(rng.paretovariate(1.0)) - 1, 39)]
        count = rng.random() > 0.1
        a = fast.rank(cands, key, count=count)
        b = reference_rank(ref, cands, key, count=count)
        assert [c.name for c in a.ranking] == [c.name for c in b.ranking], step
        assert all(x is y for x, y in zip(a.ranking, b.ranking))
        assert (a.owner, a.kind) == (b.owner, b.kind), step
        kinds[a.kind or ""] += 1
        if key is not None and rng.random() < 0.5:
            prompt, cached = rng.randint(1, 500), rng.choice([None, rng.randint(0, 500)])
            fast.observe(key, prompt, cached)
            ref.observe(key, prompt, cached)
            if rng.random() < 0.5:  # the key's static prefix, as observe learns it from a ranked history
                static = rng.randint(0, prompt)
                fast.table.set_footprint(key, static)
                ref.table.set_footprint(key, static)
        if precise and rng.random() < 0.3:
            k, n, held = rng.choice(keys), rng.choice(pool), rng.random() < 0.5
            fast.set_cached(n, k, held)
            ref.set_cached(n, k, held)
        if rng.random() < 0.005:  # a leader's snapshot applied to both, at times over other members
            snap = json.loads(json.dumps(fast.placement_snapshot()))
            if rng.random() < 0.5:
                snap["members"] = rng.sample(pool, rng.randint(1, len(pool)))
            fast.apply_snapshot(snap)
            ref.apply_snapshot(snap)
        if step % 100 == 99:
            assert fast.table.snapshot(clock.t) == ref.table.snapshot(clock.t)
            assert fast.table.loads() == ref.table.loads()
            assert fast.table.footprints() == ref.table.footprints()
            for k in fast.table.keys():
                assert fast.placement(k) == ref.table.placement(k)
    # the stream reached every branch of the decision
    assert {KIND_OWNER, KIND_PLACED, KIND_SPILL, KIND_NO_KEY} <= set(kinds)
    if seed % 3:
        assert kinds[KIND_REPLICATED] > 0


# ------------------------------------------------------------------- rebalancing


def test_a_hot_key_gains_ring_successors_and_loses_them_when_it_cools() -> None:
    clock = Clock()
    p = policy(clock, hot_share=0.5, rebalance_interval_s=10.0)
    cold = [f"c{i}" for i in range(40)]
    hot = "the-hot-tenant"
    # the hot key carries half the traffic: 2 replicas' fair share, 4 copies at hot_share 0.5
    drive(p, clock, [k for c in cold for k in (hot, c)], seconds=120, rate=20)
    clock.t += 10
    p.rank(fleet(), cold[0])  # the rebalance runs at the next decision after the interval
    placed = p.placement(hot)
    assert len(placed) >= 3
    succ = HashRing(NAMES).successors(hot)
    start = succ.index(placed[0])
    assert placed[1:] == [succ[(start + j) % 4] for j in range(1, len(placed))]  # next ring successors
    kinds = {p.rank(fleet({n: (0 if n == placed[1] else 1) for n in NAMES}), hot, count=False).kind}
    assert kinds == {KIND_REPLICATED}
    # the hot tenant goes quiet: its rate decays below one copy's worth and it drops the copies
    drive(p, clock, cold, seconds=1500, rate=20)
    assert len(p.placement(hot)) == 1 or p.placement(hot) == []


@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_an_imbalance_within_the_counts_noise_moves_nothing_and_a_sure_one_moves_keys(scale: float) -> None:
    clock = Clock()
    p = policy(clock, epsilon=0.1, hot_share=1.0, noise_z=2.0)
    p.rank(fleet(), "warm-up")
    a = NAMES[0]
    # a carries half the requests, each other replica a sixth: over its bound (27.5%) either
    # way; at 30 requests a's excess is within 2 sigma of its count (2 * sqrt(15) = 7.7), at
    # 600 it is not
    mine, _, snap = skewed_snapshot(3, [2.5 * scale] * 6, 2, 2.5 * scale)
    p.apply_snapshot(snap)
    p.table.rebalance(clock())
    moved = [k for k in mine if p.placement(k) != [a]]
    assert (len(moved) > 0) == (scale > 1.0)


def test_an_overloaded_replica_sheds_its_largest_keys_to_their_next_successor_with_room() -> None:
    clock = Clock()
    p = policy(clock, epsilon=0.1, hot_share=1.0)
    p.rank(fleet(), "warm-up")  # membership
    ring = HashRing(NAMES)
    a = NAMES[0]
    # replica a holds 12 keys with rates 1..12 (78 of 114 in total); the others 3 keys of rate 4 each
    mine, others, snap = skewed_snapshot(7, [float(i + 1) for i in range(12)], 3, 4.0)
    p.apply_snapshot(snap)
    p.table.rebalance(clock())
    loads = {n: r for n, (r, _) in p.table.loads().items()}
    bound = 1.1 * sum(loads.values()) / 4
    assert all(loads[n] <= bound + 1e-9 for n in NAMES[1:])  # destinations take keys only with room
    assert loads[a] < 78.0
    if loads[a] > bound:  # still over: no kept key fits anywhere else
        rate = {k: float(i + 1) for i, k in enumerate(mine)}
        assert all(loads[n] + rate[k] > bound for k in mine if p.placement(k) == [a] for n in NAMES[1:])
    moved = [k for k in mine if p.placement(k) != [a]]
    kept = [k for k in mine if p.placement(k) == [a]]
    assert moved and kept
    # fewest moves (no key covers the excess of 46.65 alone): every moved key is larger than every kept one
    assert min(mine.index(k) for k in moved) > max(mine.index(k) for k in kept)
    for k in moved:
        succ = ring.successors(k)
        assert p.placement(k)[0] in succ[succ.index(a) + 1 :] + succ[: succ.index(a)]
    assert all(p.placement(k) == [ring.owner(k)] for k in others if ring.owner(k) != a)


def test_the_smallest_key_covering_the_excess_moves_alone() -> None:
    clock = Clock()
    p = policy(clock, epsilon=0.1, hot_share=1.0)
    p.rank(fleet(), "warm-up")
    a = NAMES[0]
    # a: 13 of 43 in all (the others 2 keys of 5 each): bound 1.1 * 43 / 4 = 11.825, a's excess 1.175;
    # a destination takes at most 1.825. Smallest cover: 1.5 (not 0.25 + 0.5 and more, not 1.75,
    # which would fit as well).
    rates = [0.25, 0.5, 1.5, 1.75, 9.0]
    mine, _, snap = skewed_snapshot(3, rates, 2, 5.0)
    p.apply_snapshot(snap)
    p.table.rebalance(clock())
    moved = [r for k, r in zip(mine, rates) if p.placement(k) != [a]]
    assert moved == [1.5]


def test_statistics_decay_with_tau_and_quiet_keys_are_forgotten() -> None:
    clock = Clock()
    p = policy(clock, tau_s=100.0)
    p.rank(fleet(), "k")
    p.observe("k", prompt_tokens=300, cached_tokens=100)
    clock.t = 100.0 * math.log(2)
    p.rebalance()
    rate, work = p.table.stats("k") or (0, 0)
    assert rate == pytest.approx(0.5) and work == pytest.approx(100.0)
    clock.t = 100.0 * 20  # e^-20 < FORGET_BELOW
    p.rebalance()
    assert p.table.stats("k") is None and p.placement("k") == []


def test_a_departed_replica_moves_only_its_own_keys() -> None:
    clock = Clock()
    p = policy(clock)
    keys = [f"k{i}" for i in range(60)]
    drive(p, clock, keys, seconds=30)
    before = {k: p.placement(k) for k in keys}
    gone = NAMES[2]
    for k in keys:
        clock.t += 0.01
        d = p.rank(fleet(names=[n for n in NAMES if n != gone]), k)
        assert d.chosen.name != gone
    after = {k: p.placement(k) for k in keys}
    for k in keys:
        if gone not in before[k]:
            assert after[k] == before[k]


# ------------------------------------------------------------------- agreement


def test_a_follower_applying_the_leaders_snapshot_routes_as_the_leader() -> None:
    lc, fc = Clock(), Clock()
    leader = policy(lc, hot_share=0.3)
    follower = policy(fc, leader=False)
    keys = [f"tenant-{i}" for i in range(30)]
    drive(leader, lc, [keys[0], keys[1]] * 5 + keys, seconds=100, rate=30)
    lc.t += 20
    leader.rank(fleet(), keys[0])  # a rebalance
    snap = json.loads(json.dumps(leader.placement_snapshot()))  # travels as JSON
    fc.t = 12345.0  # another process: another monotonic clock
    follower.apply_snapshot(snap)
    assert follower.table.version == leader.table.version
    for k in keys + ["never-seen"]:
        assert follower.placement(k) == leader.placement(k)
    for i in range(300):
        loads = {n: (i * 7 + j * 3) % 13 for j, n in enumerate(NAMES)}
        k = keys[i % len(keys)]
        a = leader.rank(fleet(loads), k, count=False)
        b = follower.rank(fleet(loads), k, count=False)
        assert [c.name for c in a.ranking] == [c.name for c in b.ranking] and a.kind == b.kind
    # counted requests of new keys are placed alike too (same rule on the same state)
    for k in ["new-1", "new-2", "new-3"]:
        assert leader.rank(fleet(), k).chosen.name == follower.rank(fleet(), k).chosen.name
    with pytest.raises(ValueError, match="format"):
        follower.apply_snapshot({**snap, "format": 99})


# ------------------------------------------------------------------- precise mode


def test_precise_mode_places_a_new_key_where_its_prefix_is_cached() -> None:
    clock = Clock()
    key = keys_owned_by(NAMES[0], 1)[0]
    succ = HashRing(NAMES).successors(key)
    approx = policy(clock)
    approx.set_cached(succ[2], key, True)
    assert approx.rank(fleet(), key).chosen.name == succ[0]  # ignored unless precise
    precise = policy(clock, precise=True)
    precise.set_cached(succ[2], key, True)
    assert precise.rank(fleet(), key).chosen.name == succ[2]
    # no knowledge: the approximate answer
    other = keys_owned_by(NAMES[1], 1)[0]
    assert precise.rank(fleet(), other).chosen.name == HashRing(NAMES).owner(other)


def test_precise_mode_sheds_keys_whose_prefix_is_gone_first() -> None:
    clock = Clock()
    a = NAMES[0]
    mine, _, snap = skewed_snapshot(1, [float(i + 1) for i in range(12)], 3, 4.0)
    p = policy(clock, precise=True, epsilon=0.1, hot_share=1.0)
    p.rank(fleet(), "warm-up")
    p.apply_snapshot(snap)
    evicted = mine[0]  # the smallest key (last to go by size), but a no longer holds its prefix
    p.set_cached(a, evicted, False)
    p.table.rebalance(clock())
    assert p.placement(evicted) != [a]
    approx = policy(clock, epsilon=0.1, hot_share=1.0)
    approx.rank(fleet(), "warm-up")
    approx.apply_snapshot(snap)
    approx.set_cached(a, evicted, False)
    approx.table.rebalance(clock())
    assert approx.placement(evicted) == [a]  # without precise knowledge the smallest key stays


# ------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epsilon": 0}, "epsilon must be a finite number > 0"),
        ({"tau_s": -1}, "tau_s"),
        ({"rebalance_interval_s": float("inf")}, "rebalance_interval_s"),
        ({"hot_share": "0.5"}, "hot_share"),
        ({"precise": 1}, "precise must be true or false"),
        ({"noise_z": -1.0}, "noise_z must be a finite number >= 0"),
        ({"retain_s": 0}, "retain_s must be a finite number > 0"),
        ({"clock": 3}, "clock must be a callable"),
        ({"seed": 3}, "unknown placed policy option keys"),
    ],
)
def test_bad_placed_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy("placed", **options)


def test_placed_is_the_default_and_takes_ring_options() -> None:
    assert isinstance(make_policy(), Placed)
    assert pick_options("placed", {"epsilon": 0.2, "seed": 1, "weights": None}) == {"epsilon": 0.2}
    p = policy(Clock(), weights={NAMES[0]: 3})
    p.rank(fleet(), "k")
    assert p.placement_snapshot()["weights"][NAMES[0]] == 3


def test_rebalance_bench_runs() -> None:
    # the figure is reported (docs/benchmarks/router.md), never asserted: only that the bench works
    assert bench_rebalance(num_keys=300, num_replicas=8, repeats=2) > 0


@pytest.mark.parametrize("cold", [False, True])
def test_rank_bench_runs(cold: bool) -> None:
    # decision latency is reported (docs/benchmarks/router.md), never asserted: only that the bench works
    out = bench_rank(num_replicas=4, num_keys=50, num_requests=200, cold=cold)
    assert 0 < out["p50"] <= out["p99"] <= out["max"]


def test_table_refuses_to_route_without_members() -> None:
    with pytest.raises(ValueError, match="no members"):
        PlacementTable(0.1, 300.0, 0.5).record("k", 0.0)


def test_retained_keys_stay_on_their_replica_and_are_not_forgotten_until_retention_ends() -> None:
    clock = Clock()
    p = policy(clock, epsilon=0.1, hot_share=1.0, retain_s=1000.0)
    p.rank(fleet(), "warm-up")
    a = NAMES[0]
    rates = [float(i + 1) for i in range(12)]
    mine, _, snap = skewed_snapshot(7, rates, 3, 4.0)
    p.apply_snapshot(snap)
    for k in mine:  # every key of the overloaded replica pins its prefix there
        p.retain(k)
    p.table.rebalance(clock())
    assert all(p.placement(k) == [a] for k in mine)
    # Retention ends: the same excess sheds keys as it does without retention.
    clock.t = 1001.0
    p.apply_snapshot(snap)
    p.table.rebalance(clock())
    assert any(p.placement(k) != [a] for k in mine)


def test_a_quiet_retained_key_outlives_the_forgetting_of_its_statistics() -> None:
    clock = Clock()
    p = policy(clock, tau_s=100.0, retain_s=5000.0)
    p.rank(fleet(), "kept")
    p.retain("kept")
    p.rank(fleet(), "other")
    clock.t = 100.0 * 20  # both counts decayed below FORGET_BELOW
    p.rebalance()
    assert p.placement("kept") != [] and p.placement("other") == []
    clock.t = 5001.0
    p.rebalance()
    assert p.placement("kept") == []


def test_a_refused_request_is_taken_back_and_a_key_seen_only_in_refused_requests_leaves() -> None:
    clock = Clock()
    p = policy(clock)
    p.rank(fleet(), "kept")
    clock.t = 5.0
    p.rank(fleet(), "kept")
    p.rank(fleet(), "refused-only")
    p.refused("refused-only")
    p.refused("kept")
    assert "refused-only" not in p.table and p.placement("refused-only") == []
    twin = policy(clock)  # saw only the first request of "kept"
    clock.t = 0.0
    twin.rank(fleet(), "kept")
    clock.t = 5.0
    assert p.table.stats("kept") == pytest.approx(twin.table.stats("kept"), rel=1e-9)
    got, want = p.table.loads(), twin.table.loads()  # the replicas' loads too
    assert got.keys() == want.keys() and all(got[n] == pytest.approx(want[n], abs=1e-9) for n in got)
    p.refused("never-seen")  # nothing to take back
    assert len(p.table) == 1


# ------------------------------------------------------------------- KV footprint


def footprint_fleet(capacity: int, names: list[str] = NAMES[:2]) -> list[Loaded]:
    return [Loaded(n, 0, ReplicaLoad(kv_capacity_tokens=capacity)) for n in names]


def prompt_of(key: str, blocks: int = 12, static_blocks: int = 10) -> dict[str, object]:
    """A prompt's history hashes (its own) and how many of them its static prefix covers."""
    return {"history": [f"{key}-{i}".encode() for i in range(blocks)], "static_blocks": static_blocks}


def send_each(
    p: Placed, clock: Clock, keys: list[str], candidates: list, prompt_tokens: int, static_blocks: int = 10
) -> list[int]:
    """One request of each key, a second apart, answered with ``prompt_tokens``: the static tokens learnt."""
    learnt = []
    for i, k in enumerate(keys):
        clock.t = float(i)
        assert p.rank(candidates, k, **prompt_of(k, static_blocks=static_blocks)).chosen.name in p.table.members
        learnt.append(p.observe(k, prompt_tokens=prompt_tokens, cached_tokens=0))
    return learnt


def two_replicas(count: int, **options: object) -> tuple[Clock, Placed, tuple[str, str], list[str]]:
    """``placed`` over NAMES[:2] where rates cannot tell (a loose bound, no work counted): its clock, it,
    the two names and ``count`` keys the first owns."""
    clock = Clock()
    a, b = NAMES[:2]
    p = policy(clock, epsilon=10.0, work_epsilon=None, **options)
    return clock, p, (a, b), keys_owned_by(a, count, [a, b])


def test_new_keys_go_past_a_replica_their_static_prefixes_would_overfill() -> None:
    clock, p, (a, b), keys = two_replicas(12, kv_fill=0.9)
    assert send_each(p, clock, keys, footprint_fleet(1000), 120) == [100] * 12  # 10 of its 12 blocks
    placement = {k: p.placement(k)[0] for k in keys}
    # 0.9 x 1000 tokens hold nine prompts of 100: the rest go to the next successor, b.
    assert [placement[k] for k in keys].count(a) == 9
    assert all(placement[k] == b for k in keys[9:])
    foot = p.table.footprints()
    assert foot[a] == (900.0, 1000.0) and foot[b] == (300.0, 1000.0)


def test_without_capacities_footprints_change_nothing() -> None:
    clock, p, (a, b), keys = two_replicas(12)
    send_each(p, clock, keys, fleet(names=[a, b]), 120)
    assert all(p.placement(k) == [a] for k in keys)


def test_a_replica_over_its_footprint_sheds_keys_at_the_rebalance_and_quiet_keys_do_not_count() -> None:
    clock, p, (a, b), keys = two_replicas(10, rebalance_interval_s=1e9)
    send_each(p, clock, keys, fleet(names=[a, b]), 100, static_blocks=12)  # before any capacity is known
    assert all(p.placement(k) == [a] for k in keys)
    p.rank(footprint_fleet(500), keys[0])  # the capacities arrive with a load report
    p.table.rebalance(clock())
    on_a = [k for k in keys if p.placement(k) == [a]]
    assert len(on_a) == 4 and p.table.footprints()[a][0] <= 450.0  # 0.9 x 500
    assert all(p.placement(k) == [b] for k in keys if k not in on_a)
    # Keys not requested for tau_s hold no footprint any more (their blocks are the first evicted).
    clock.t += 301.0
    p.table.rebalance(clock.t)
    assert p.table.footprints()[a][0] == 0.0


def test_a_key_whose_footprint_is_not_known_counts_as_the_mean_of_those_known() -> None:
    clock, p, (a, b), keys = two_replicas(6)
    send_each(p, clock, keys[:4], footprint_fleet(1000), 200, static_blocks=12)
    p.table.rebalance(clock.t)  # the mean known footprint: 200
    clock.t += 1.0
    p.rank(footprint_fleet(1000), keys[4])  # 800 + 200 > 900: past a, unknown as it is
    assert p.placement(keys[4]) == [b]


def test_footprints_travel_in_the_snapshot() -> None:
    clock = Clock()
    leader, follower = policy(clock), policy(clock, leader=False)
    leader.rank(fleet(), "k", **prompt_of("k", blocks=5, static_blocks=4))
    leader.observe("k", prompt_tokens=50, cached_tokens=0)
    follower.rank(fleet(), "other")
    follower.apply_snapshot(json.loads(json.dumps(leader.placement_snapshot())))
    assert follower.table.snapshot(clock())["keys"]["k"]["foot"] == 40.0


def test_a_copy_added_between_rebalances_carries_its_share_of_the_keys_load_and_fits_the_kv() -> None:
    clock, p, (a, b), keys = two_replicas(10, rebalance_interval_s=1e9)
    send_each(p, clock, keys, footprint_fleet(1000), 100, static_blocks=12)
    table = p.table
    assert [p.placement(k) for k in keys] == [[a]] * 9 + [[b]]  # 0.9 x 1000 tokens hold nine
    for _ in range(30):  # keys[0] becomes hot: its rate fills both replicas
        p.rank(footprint_fleet(1000), keys[0])
    assert table.add_copy(keys[9], a) is False  # a full: the copy would only evict
    assert table.add_copy(keys[0], b) is True
    assert p.placement(keys[0]) == [a, b]
    assert table.add_copy(keys[0], b) is False and table.add_copy("never-seen", b) is False
    assert table.add_copy(keys[1], "not-a-member") is False
    assert table.footprints()[b] == (200.0, 1000.0)

    def shares() -> dict[str, float]:
        loads = table.loads()
        total = sum(rate for rate, _ in loads.values())
        return {n: rate / total for n, (rate, _) in loads.items()}

    before = shares()
    assert before[b] == pytest.approx(
        (1 + 31 / 2) / 40, rel=0.01
    )  # (decayed) half of keys[0]'s 31 requests, and its own key
    table.rebalance(clock.t)  # every load recomputed from the placements; the key's rate keeps its copy
    assert p.placement(keys[0]) == [a, b] and shares() == pytest.approx(before)
    assert table.footprints()[b] == (200.0, 1000.0)


def test_footprints_learnt_before_any_rebalance_bound_the_placements_at_once() -> None:
    clock, p, (a, b), keys = two_replicas(12, rebalance_interval_s=1e9)
    learnt = send_each(p, clock, keys[:9], footprint_fleet(1000), 120)
    assert learnt == [100] * 9 and p.table.footprints()[a] == (900.0, 1000.0)
    # The next key's footprint is not known yet: it counts as the mean of those known (100).
    clock.t += 1.0
    p.rank(footprint_fleet(1000), keys[9], **prompt_of(keys[9]))
    assert p.placement(keys[9]) == [b] and p.table.footprints()[b] == (100.0, 1000.0)
    p.observe(keys[9], prompt_tokens=240, cached_tokens=0)  # then it is: 200 tokens
    assert p.table.footprints()[b] == (200.0, 1000.0)


def test_every_request_is_counted_in_the_arrays_that_replaced_the_ones_before() -> None:
    """A request's count reaches the table's live arrays after each way they are replaced: grown past
    the first 64 keys, loads recomputed by a rebalance or a membership change, the units
    renormalized after a long quiet, a snapshot applied (requests write through views of the arrays)."""
    names = NAMES[:3]
    ring = HashRing(names)
    table = PlacementTable(0.2, 10.0, 0.5)
    table.set_members(names, [1, 1, 1], ring.order)
    now = 0.0

    def request(key: str) -> None:
        nonlocal now
        now += 0.01
        before = (table.stats(key) or (0.0, 0.0))[0]
        table.record(key, now)
        after = table.stats(key)
        assert after is not None and after[0] > before
        # Every replica's load is the recount of its keys' rates over their copies.
        recount = dict.fromkeys(table.members, 0.0)
        for k in table.keys():
            where = table.placement(k)
            for n in where:
                recount[n] += (table.stats(k) or (0.0, 0.0))[0] / len(where)
        assert {n: rate for n, (rate, _) in table.loads().items()} == pytest.approx(recount)

    for i in range(10):
        request(f"k{i}")
        request("k0")
    for i in range(10, 70):  # past the first 64 slots: every array grows
        request(f"k{i}")
    request("k0")
    table.rebalance(now)  # the loads recomputed
    request("k1")
    request("k0")
    now += 60 * 10.0 + 1.0  # past the renormalization age (and quiet keys forgotten at the rebalance)
    request("k2")
    table.rebalance(now)
    request("k2")
    names = [*names, NAMES[3]]
    ring = HashRing(names)
    table.set_members(names, [1, 1, 1, 1], ring.order)  # a member joins: the loads recomputed
    request("k2")
    request("k3")
    leader = PlacementTable(0.2, 10.0, 0.5)
    leader.set_members(names, [1, 1, 1, 1], ring.order)
    for i in range(5):
        leader.record(f"k{i}", now)
    table.apply(leader.snapshot(now), now)  # every array replaced by the leader's
    request("k4")
    request("k9")
