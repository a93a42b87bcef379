"""Routing policies (router/policies/) against fake replicas shaped like Ray Serve's."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from prefixserve.router.policies import (
    POLICIES,
    RING_POLICIES,
    BoundedLoad,
    ConsistentHash,
    Decision,
    Placed,
    Replica,
    ReplicaView,
    accepted_options,
    check_options,
    make_policy,
    pick_options,
)
from prefixserve.router.ring import HashRing, bounded_capacity


@dataclass
class _ReplicaId:
    unique_id: str

    def to_full_id_str(self) -> str:
        return f"SERVE_REPLICA::default#Engine#{self.unique_id}"


class FakeRunningReplica:
    """The parts of ray.serve's RunningReplica a router adapter reads."""

    def __init__(self, unique_id: str, queue_len: int):
        self.replica_id = _ReplicaId(unique_id)
        self.queue_len = queue_len


class ServeReplicaAdapter:
    """The thin adapter the Serve router uses: name = full replica id, in_flight = queue length."""

    def __init__(self, replica: FakeRunningReplica):
        self.replica = replica

    @property
    def name(self) -> str:
        return self.replica.replica_id.to_full_id_str()

    @property
    def in_flight(self) -> int:
        return self.replica.queue_len


def _fleet(seed: int, n: int, max_load: int = 5) -> list[ServeReplicaAdapter]:
    rng = random.Random(seed)
    ids = ["".join(rng.choices("abcdefghijklmnop0123456789", k=8)) for _ in range(n)]
    return [ServeReplicaAdapter(FakeRunningReplica(i, rng.randint(0, max_load))) for i in ids]


def _keys(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(64):016x}" for _ in range(n)]


def _is_permutation(decision: Decision, candidates) -> bool:
    return sorted(c.name for c in decision.ranking) == sorted(c.name for c in candidates)


def test_adapter_satisfies_replica_view():
    assert isinstance(_fleet(0, 1)[0], ReplicaView)
    assert isinstance(Replica("a", 1), ReplicaView)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_a_permutation(name):
    kwargs = {"seed": 7} if name in ("random", "power_of_two") else {}
    policy = make_policy(name, **kwargs)
    for i, key in enumerate([None, *_keys(1, 30)]):
        fleet = _fleet(i, 1 + i % 6)
        d = policy.rank(fleet, key)
        assert _is_permutation(d, fleet)
        assert all(c in fleet for c in d.ranking)  # the very objects, for the caller's fallback


def test_make_policy_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="bounded_load.*consistent_hash.*placed.*power_of_two.*random.*round_robin"):
        make_policy("least_conn")
    with pytest.raises(ValueError, match=r"unknown round_robin policy option keys \['epsilon'\]; known keys: none"):
        make_policy("round_robin", epsilon=0.1)
    with pytest.raises(ValueError, match="epsilon"):
        make_policy("bounded_load", epsilon=-1)
    assert isinstance(make_policy(), Placed)


@pytest.mark.parametrize(
    ("name", "bad", "accepted"),
    [
        ("bounded_load", "seed", "['epsilon', 'weights']"),
        ("consistent_hash", "epsilon", "['weights']"),
        ("random", "weights", "['rng', 'seed']"),
        ("power_of_two", "epsilon", "['rng', 'seed']"),
    ],
)
def test_unknown_option_names_it_and_the_policys_options(name, bad, accepted):
    with pytest.raises(ValueError) as info:
        make_policy(name, **{bad: 1})
    assert f"['{bad}']" in str(info.value) and accepted in str(info.value)
    with pytest.raises(ValueError, match=bad):
        check_options(name, **{bad: 1})
    # the class itself checks as strictly as make_policy
    with pytest.raises(ValueError, match=bad):
        POLICIES[name](**{bad: 1})


def test_options_are_declared_once_per_policy():
    assert accepted_options("round_robin") == ()
    assert accepted_options("bounded_load") == ("weights", "epsilon")
    assert set(RING_POLICIES) == {"consistent_hash", "bounded_load", "placed"}
    settings = {"seed": 3, "epsilon": 0.5, "weights": None}
    assert pick_options("bounded_load", settings) == {"epsilon": 0.5}
    assert pick_options("random", settings) == {"seed": 3}
    assert pick_options("round_robin", settings) == {}
    with pytest.raises(ValueError, match="unknown routing policy"):
        pick_options("nearest", settings)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("bounded_load", {"epsilon": "0.2"}, "epsilon must be a number"),
        ("consistent_hash", {"weights": {"a": 0}}, "weight of 'a'"),
        ("consistent_hash", {"weights": {"a": 101}}, "from 1 to 100"),
        ("consistent_hash", {"weights": ["a"]}, "weights must map"),
        ("random", {"seed": "x"}, "seed must be an integer"),
        ("random", {"rng": 3}, "rng must be a random.Random"),
    ],
)
def test_bad_option_values_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, **options)


def test_seeded_policies_match_a_generator_of_the_same_seed():
    fleet = _fleet(2, 6)
    for name in ("random", "power_of_two"):
        a, b = make_policy(name, seed=9), make_policy(name, rng=random.Random(9))
        assert [[c.name for c in a.rank(fleet, None).ranking] for _ in range(10)] == [
            [c.name for c in b.rank(fleet, None).ranking] for _ in range(10)
        ]


def test_round_robin_cycles_independent_of_candidate_order():
    fleet = [Replica(n, 0) for n in "cab"]
    policy = make_policy("round_robin")
    firsts = [policy.rank(random.Random(i).sample(fleet, 3), "ignored").chosen.name for i in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_random_is_reproducible_with_a_seeded_rng():
    fleet = _fleet(3, 5)
    a = make_policy("random", rng=random.Random(11))
    b = make_policy("random", rng=random.Random(11))
    ra = [[c.name for c in a.rank(fleet, None).ranking] for _ in range(20)]
    rb = [[c.name for c in b.rank(list(reversed(fleet)), None).ranking] for _ in range(20)]
    assert ra == rb
    assert len({r[0] for r in ra}) > 1


def test_power_of_two_prefers_the_less_loaded_of_its_sample():
    fleet = [Replica(f"r{i}", load) for i, load in enumerate([0, 3, 6, 9])]
    policy = make_policy("power_of_two", seed=5)
    wins = Counter()
    for _ in range(400):
        d = policy.rank(fleet, None)
        first, second = d.ranking[0], d.ranking[1]
        assert first.in_flight <= second.in_flight
        wins[first.name] += 1
    # The most loaded replica can never beat the other sampled one.
    assert wins["r3"] == 0
    assert wins["r0"] > wins["r1"] > wins["r2"] > 0


def test_consistent_hash_follows_the_ring_regardless_of_load_and_order():
    fleet = _fleet(4, 5, max_load=50)
    ring = HashRing(sorted(c.name for c in fleet))
    policy = ConsistentHash()
    for key in _keys(5, 300):
        d = policy.rank(random.Random(key).sample(fleet, len(fleet)), key)
        assert [c.name for c in d.ranking] == ring.successors(key)
        assert d.owner == ring.owner(key) and not d.spilled


def test_keyless_requests_go_least_loaded_first():
    fleet = [Replica("b", 2), Replica("a", 2), Replica("c", 0), Replica("d", 5)]
    for name in ("consistent_hash", "bounded_load"):
        d = make_policy(name).rank(fleet, None)
        assert [c.name for c in d.ranking] == ["c", "a", "b", "d"]
        assert d.owner is None and not d.spilled


def test_bounded_load_matches_the_ring_lookup_and_reports_spills():
    policy = BoundedLoad(epsilon=0.25)
    spills = 0
    for i, key in enumerate(_keys(6, 400)):
        fleet = _fleet(100 + i, 6, max_load=8)
        d = policy.rank(fleet, key)
        ring = HashRing(sorted(c.name for c in fleet))
        loads = {c.name: c.in_flight for c in fleet}
        assert d.chosen.name == ring.bounded_lookup(key, loads, 0.25)
        assert d.owner == ring.owner(key)
        cap = bounded_capacity(sum(loads.values()), len(fleet), 0.25)
        assert d.chosen.in_flight < cap
        assert d.spilled == (d.chosen.name != d.owner)
        spills += d.spilled
        # Under-capacity replicas come first, each group in ring order.
        names = [c.name for c in d.ranking]
        succ = ring.successors(key)
        under = [n for n in succ if loads[n] < cap]
        assert names == under + [n for n in succ if loads[n] >= cap]
    assert 0 < spills < 400


def test_bounded_load_spreads_a_hot_key_to_ring_successors_only():
    names = [f"10.0.0.{i}:8000" for i in range(8)]
    policy = BoundedLoad(epsilon=0.25)
    loads = Counter()
    for _ in range(200):
        d = policy.rank([Replica(n, loads[n]) for n in names], "hot")
        loads[d.chosen.name] += 1
    ring = HashRing(sorted(names))
    used = [n for n in ring.successors("hot") if loads[n] > 0]
    # The hot key fills its successors in ring order; capacity bounds every replica.
    assert used == ring.successors("hot")[: len(used)]
    assert max(loads.values()) <= bounded_capacity(199, 8, 0.25)
    assert len(used) >= math.ceil(200 / bounded_capacity(199, 8, 0.25))


def test_ring_membership_follows_candidates_and_moves_few_keys():
    policy = BoundedLoad(epsilon=1e9)  # infinite slack: pure ring, to observe membership
    fleet = [Replica(f"r{i}", 0) for i in range(5)]
    keys = _keys(8, 5000)
    before = {k: policy.rank(fleet, k).chosen.name for k in keys}
    assert len(policy.ring) == 5
    shrunk = [c for c in fleet if c.name != "r2"]  # r2 died: Ray stops listing it
    after = {k: policy.rank(shrunk, k).chosen.name for k in keys}
    assert len(policy.ring) == 4
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "r2"}


def test_weights_apply_to_ring_policies():
    fleet = [Replica("big", 0), Replica("small", 0)]
    policy = ConsistentHash(weights={"big": 4})
    share = Counter(policy.rank(fleet, k).chosen.name for k in _keys(9, 5000))
    assert 0.72 < share["big"] / 5000 < 0.88


def test_bad_candidates_rejected():
    with pytest.raises(ValueError, match="at least one"):
        make_policy("round_robin").rank([], None)
    with pytest.raises(ValueError, match="unique"):
        make_policy("bounded_load").rank([Replica("a"), Replica("a")], "k")
