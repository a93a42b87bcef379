"""Conversation affinity: the router-side history index (router/policies/history.py) and ``placed``'s use of it."""

from __future__ import annotations

import math

import pytest

from prefixserve.replica.kv.hashing import BlockHasher
from prefixserve.router.policies import (
    KIND_HISTORY,
    KIND_NEW_CONVERSATION,
    KIND_SPILL,
    Placed,
    Replica,
)
from prefixserve.router.policies.history import HistoryIndex
from prefixserve.router.policies.placed import conversation_move_bound
from prefixserve.router.policies.recent import RecentCounts

BS = 16
HASHER = BlockHasher()


def chain(tokens: list[int]) -> list[bytes]:
    return HASHER.hash_blocks(tokens, BS, None)


SYSTEM = list(range(1000, 1000 + 4 * BS))  # 4 static blocks
STATIC_BLOCKS = 4


def conversation(user: int, turns: int) -> list[int]:
    """The system prompt, then ``turns`` blocks of the user's own history."""
    return SYSTEM + [user * 100_000 + t for t in range(turns * BS)]


def test_held_counts_leading_blocks_per_replica():
    index = HistoryIndex(100)
    a, b = chain(conversation(1, 3)), chain(conversation(2, 2))
    index.record("r1", a)
    index.record("r2", b)
    assert index.held(a) == {"r1": 7, "r2": 4}  # r2 holds the shared system blocks only
    assert index.held(chain(conversation(1, 5))) == {"r1": 7, "r2": 4}
    assert index.held(chain([7] * BS * 2)) == {}


def test_remove_and_forget_drop_what_a_replica_holds():
    index = HistoryIndex(100)
    a = chain(conversation(1, 3))
    index.record("r1", a)
    index.record("r2", a)
    index.remove("r1", a[5:])
    assert index.held(a) == {"r1": 5, "r2": 7}
    index.forget("r2")
    assert index.held(a) == {"r1": 5}
    index.record("r3", a[:2])  # the freed slot is reused without inheriting r2's blocks
    assert index.held(a) == {"r1": 5, "r3": 2}


def test_index_at_its_bound_evicts_never_grows():
    index = HistoryIndex(50)
    for user in range(100):
        index.record(f"r{user % 4}", chain(conversation(user, 6)))
        assert len(index) <= 50
    assert index.evictions > 0
    # The latest conversation's prefix survives its own tail: a chain's leading blocks go last.
    last = chain(conversation(99, 6))
    index.record("r9", last)
    index.record("r9", chain(conversation(500, 40))[STATIC_BLOCKS:])  # 40 other blocks push 40 out
    assert index.held(last).get("r9", 0) >= 4


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_entries"):
        HistoryIndex(0)


def _replicas(loads: dict[str, int]) -> list[Replica]:
    return [Replica(n, f) for n, f in loads.items()]


def test_a_continuing_conversation_goes_to_the_replica_holding_its_history():
    policy = Placed(clock=lambda: 0.0)
    names = [f"r{i}" for i in range(4)]
    key = "app"
    owner = policy.rank(_replicas(dict.fromkeys(names, 0)), key).chosen.name
    other = next(n for n in names if n != owner)
    policy.history.record(other, chain(conversation(7, 3)))
    loads = dict.fromkeys(names, 1)
    loads[other] = 2  # busier than the owner, under the cap
    d = policy.rank(_replicas(loads), key, history=chain(conversation(7, 4)), static_blocks=STATIC_BLOCKS)
    assert (d.chosen.name, d.kind) == (other, KIND_HISTORY)
    assert (d.predicted_blocks, d.best_blocks) == (7, 7)


def test_a_history_holder_over_the_cap_is_passed_over():
    policy = Placed(clock=lambda: 0.0)
    names = [f"r{i}" for i in range(4)]
    owner = policy.rank(_replicas(dict.fromkeys(names, 0)), "app").chosen.name
    other = next(n for n in names if n != owner)
    policy.history.record(other, chain(conversation(7, 3)))
    loads = dict.fromkeys(names, 0)
    loads[other] = 40
    d = policy.rank(_replicas(loads), "app", history=chain(conversation(7, 4)), static_blocks=STATIC_BLOCKS)
    assert d.chosen.name != other and d.kind != KIND_HISTORY


def _send(policy: Placed, loads: dict[str, int], history: list[bytes] | None) -> str:
    d = policy.rank(_replicas(loads), "app", history=history, static_blocks=STATIC_BLOCKS)
    loads[d.chosen.name] += 1
    return d.kind or ""


def test_new_conversations_grow_the_set_with_the_keys_load_and_shrink_after():
    static, conv = Placed(clock=lambda: 0.0), Placed(clock=lambda: 0.0)
    static_loads, conv_loads = {"r0": 0, "r1": 0}, {"r0": 0, "r1": 0}
    for user in range(200, 208):  # conversations that continued: the key is an app's chats
        for turn in (1, 2, 3):
            _send(conv, {"r0": 0, "r1": 0}, chain(conversation(user, turn)))
            conv.done("app")
    for user in range(8):  # eight conversations in flight at once, as a closed-loop client keeps them
        _send(static, static_loads, None)
        _send(conv, conv_loads, chain(conversation(user, 1)))
    assert sorted(static_loads.values()) == [0, 8]  # the static key alone: all on its owner (under the cap)
    assert sorted(conv_loads.values()) == [4, 4]
    owner = max(static_loads, key=static_loads.__getitem__)
    for _ in range(8):
        conv.done("app")
    assert conv.key_in_flight("app") == 0
    kinds = [_send(conv, loads := {"r0": 0, "r1": 0}, chain(conversation(100, 1)))]
    assert max(loads, key=loads.__getitem__) == owner and kinds == [KIND_NEW_CONVERSATION]


def test_a_tenants_requests_in_flight_at_once_stay_on_its_placement_while_its_rate_is_a_small_share():
    def one_shot(tenant: int, question: int) -> list[bytes]:  # the tenant's system prompt, then a question
        return chain([50_000 * (tenant + 1) + i for i in range(4 * BS)] + [question] * BS)

    policy = Placed(clock=lambda: 0.0)
    idle = {"r0": 0, "r1": 0}
    for question in range(4):  # six tenants, four requests each, all finished
        for tenant in range(6):
            history = one_shot(tenant, question)
            policy.rank(_replicas(idle), f"tenant-{tenant}", history=history, static_blocks=STATIC_BLOCKS)
            policy.done(f"tenant-{tenant}")
    (home,) = policy.placement("tenant-0")
    loads = {**idle, home: 1}
    first = policy.rank(_replicas(idle), "tenant-0", history=one_shot(0, 4), static_blocks=STATIC_BLOCKS)
    assert first.chosen.name == home
    # The tenant's next request while one is in flight: a copy of its prompt on the other
    # replica would evict another tenant's, for a load that is one request.
    d = policy.rank(_replicas(loads), "tenant-0", history=one_shot(0, 5), static_blocks=STATIC_BLOCKS)
    assert (d.chosen.name, d.kind) == (home, KIND_NEW_CONVERSATION)
    assert policy.key_in_flight("tenant-0") == 2


def test_a_one_shot_keys_copy_made_for_its_requests_in_flight_serves_its_later_requests():
    def one_shot(tenant: int, question: int) -> list[bytes]:
        return chain([50_000 * (tenant + 1) + i for i in range(4 * BS)] + [question] * BS)

    policy = Placed(clock=lambda: 0.0)
    idle = {"r0": 0, "r1": 0}
    for question in range(20):  # a hot tenant (all but every fifth request) among quiet ones
        key = "hot" if question % 5 else f"quiet-{question}"
        tenant = 0 if key == "hot" else question
        policy.rank(_replicas(idle), key, history=one_shot(tenant, question), static_blocks=STATIC_BLOCKS)
        policy.done(key)
    (home,) = policy.placement("hot")
    assert policy.table.rate_copies("hot", 0.0) == 2
    (other,) = set(idle) - {home}
    loads = dict(idle)
    first = policy.rank(_replicas(loads), "hot", history=one_shot(0, 100), static_blocks=STATIC_BLOCKS)
    assert first.chosen.name == home
    loads[home] += 1
    # Its next request while that one is in flight: its set grows, as far as its share carries it.
    d = policy.rank(_replicas(loads), "hot", history=one_shot(0, 101), static_blocks=STATIC_BLOCKS)
    assert (d.chosen.name, d.kind) == (other, KIND_SPILL)
    assert policy.placement("hot") == [home, other]  # the prefix it computed there serves the key from now on
    policy.done("hot")
    policy.done("hot")
    later = policy.rank(_replicas({home: 1, other: 0}), "hot", history=one_shot(0, 102), static_blocks=STATIC_BLOCKS)
    assert later.chosen.name == other and later.kind == KIND_NEW_CONVERSATION


def test_a_keys_rate_copies_are_one_replica_per_hot_share_of_a_fair_share_of_its_requests():
    policy = Placed(clock=lambda: 0.0)  # hot_share 0.5: a key with a fair share fills two replicas
    idle = dict.fromkeys([f"r{i}" for i in range(4)], 0)
    for _ in range(80):
        policy.rank(_replicas(idle), "app")
    assert policy.table.rate_copies("app", 0.0) == 4  # all of the traffic: every replica
    for i in range(240):
        policy.rank(_replicas(idle), f"tenant-{i % 6}")
    assert policy.table.rate_copies("app", 0.0) == 2  # a quarter of the requests: 0.25 * 4 / 0.5
    assert policy.table.rate_copies("tenant-0", 0.0) == 1  # an eighth: 0.125 * 4 / 0.5
    assert policy.table.rate_copies("never-seen", 0.0) == 1


def test_a_share_seen_on_a_few_requests_does_not_buy_a_copy():
    policy = Placed(clock=lambda: 0.0)
    idle = dict.fromkeys(["r0", "r1"], 0)
    for key in ("hot", "other", "hot"):
        policy.rank(_replicas(idle), key)
    # Two of three requests: a two-thirds share, within noise of a quarter.
    assert policy.table.rate_copies("hot", 0.0) == 1
    for _ in range(40):
        policy.rank(_replicas(idle), "hot")
    assert policy.table.rate_copies("hot", 0.0) == 2  # 42 of 43: it surely fills both
    no_noise = Placed(noise_z=0.0, clock=lambda: 0.0)
    for key in ("hot", "other", "hot"):
        no_noise.rank(_replicas(idle), key)
    assert no_noise.table.rate_copies("hot", 0.0) == 2


def test_a_young_keys_new_conversations_spread_in_conversational_traffic_not_in_one_shot_traffic():
    def young_key_split(continuing: bool) -> list[int]:
        policy = Placed(clock=lambda: 0.0)
        idle = {"r0": 0, "r1": 0}
        for user in range(4):  # the traffic so far: an app's conversations, continued or not
            policy.rank(_replicas(idle), "app", history=chain(conversation(user, 1)), static_blocks=STATIC_BLOCKS)
            policy.done("app")
            turn = (user, 2) if continuing else (100 + user, 1)
            policy.rank(_replicas(idle), "app", history=chain(conversation(*turn)), static_blocks=STATIC_BLOCKS)
            policy.done("app")
        loads = dict(idle)
        for user in range(3):  # a new key's first three conversations, in flight at once
            d = policy.rank(
                _replicas(loads), "new-app", history=chain(conversation(500 + user, 1)), static_blocks=STATIC_BLOCKS
            )
            loads[d.chosen.name] += 1
        return sorted(loads.values())

    # Its share (3 of 11 requests) does not surely fill two replicas, but a key this young
    # cannot yet show it is one-shot: among conversations it spreads as they do.
    assert young_key_split(continuing=True) == [1, 2]
    assert young_key_split(continuing=False) == [0, 3]


def test_the_index_never_sends_to_a_replica_that_is_not_a_candidate():
    policy = Placed(clock=lambda: 0.0)
    policy.history.record("gone", chain(conversation(7, 5)))  # stale: its replica left, its events were lost
    d = policy.rank(
        _replicas({"r0": 0, "r1": 0}), "app", history=chain(conversation(7, 6)), static_blocks=STATIC_BLOCKS
    )
    assert d.chosen.name in ("r0", "r1") and d.kind != KIND_HISTORY


def test_what_the_router_sent_counts_as_held_from_the_next_turn_on():
    policy = Placed(clock=lambda: 0.0)
    names = {f"r{i}": 0 for i in range(8)}
    first = policy.rank(_replicas(names), "app", history=chain(conversation(1, 1)), static_blocks=STATIC_BLOCKS)
    d = policy.rank(_replicas(names), "app", history=chain(conversation(1, 2)), static_blocks=STATIC_BLOCKS)
    assert (d.chosen.name, d.kind, d.predicted_blocks) == (first.chosen.name, KIND_HISTORY, 5)


def test_a_conversational_keys_new_conversations_spread_a_one_shot_keys_do_not():
    names = [f"r{i}" for i in range(8)]
    policy = Placed(clock=lambda: 0.0, conversation_spread=4)
    idle = dict.fromkeys(names, 0)
    for key in ("chat-app", "one-shot-app"):
        base = 0 if key == "chat-app" else 200
        for user in range(base, base + 4):
            policy.rank(_replicas(idle), key, history=chain(conversation(user, 1)), static_blocks=STATIC_BLOCKS)
            policy.done(key)
            if key == "chat-app":  # every conversation continues: half the key's decisions follow a history
                d = policy.rank(_replicas(idle), key, history=chain(conversation(user, 2)), static_blocks=STATIC_BLOCKS)
                assert d.kind == KIND_HISTORY
            else:
                policy.rank(
                    _replicas(idle), key, history=chain(conversation(100 + user, 1)), static_blocks=STATIC_BLOCKS
                )  # one-shots: nothing continues
            policy.done(key)
    for key, base in (("chat-app", 0), ("one-shot-app", 200)):
        owner = policy.placement(key)[0]
        loads = {**idle, owner: 1}
        d = policy.rank(_replicas(loads), key, history=chain(conversation(900 + base, 1)), static_blocks=STATIC_BLOCKS)
        assert (d.chosen.name != owner) == (key == "chat-app"), key


def test_recent_counts_decay_with_their_time_constant_and_survive_a_rescale():
    counts = RecentCounts(10.0)
    for _ in range(4):
        counts.add("r0", 0.0)
    counts.add("r1", 5.0)
    r0, r1, r2 = counts.counts(["r0", "r1", "r2"], 10.0)
    assert r0 == pytest.approx(4 * math.exp(-1.0)) and r1 == pytest.approx(math.exp(-0.5)) and r2 == 0.0
    counts.add("r1", 1000.0)  # 100 time constants later: the reference moves, the values stay right
    assert counts.counts(["r0", "r1"], 1010.0) == pytest.approx([0.0, math.exp(-1.0)], abs=1e-12)
    assert len(counts) == 1  # a value decayed to nothing is dropped when the reference moves
    counts.forget("r1")
    assert counts.counts(["r1"], 1010.0) == [0.0]
    with pytest.raises(ValueError, match="tau_s"):
        RecentCounts(0.0)


def _long_conversation(policy: Placed, loads: dict[str, int], turns: int) -> str:
    """One conversation of ``turns`` turns, each finished but the last: its replica (it stays there)."""
    chosen = ""
    for t in range(1, turns + 1):
        d = policy.rank(_replicas(loads), "app", history=chain(conversation(1, t)), static_blocks=STATIC_BLOCKS)
        if t < turns:
            policy.done("app")
        assert chosen in ("", d.chosen.name)
        chosen = d.chosen.name
    return chosen


def test_a_new_conversation_goes_where_fewest_requests_went_recently_not_only_the_idlest():
    loads = {"r0": 0, "r1": 0}  # in flight, both replicas look alike (as the policy's candidates)
    for tau, elsewhere in ((300.0, True), (None, False)):
        policy = Placed(clock=lambda: 0.0, recent_tau_s=tau)
        first = _long_conversation(policy, loads, 6)  # its last turn in flight: the key's set has both
        d = policy.rank(_replicas(loads), "app", history=chain(conversation(2, 1)), static_blocks=STATIC_BLOCKS)
        assert (d.chosen.name != first) == elsewhere, tau


def test_the_move_bound_is_noise_on_few_requests_and_proportional_on_many():
    # Two replicas, 32 requests split 20 / 12 (mean 16): within the noise of so few, no move.
    assert conversation_move_bound(16.0, 0.25, 2.0) == 16.0 + 8.0 + 1.0 > 20
    assert conversation_move_bound(16.0, 0.25, 0.0) == 16.0 * 1.25 + 1.0 < 22
    # Many requests per replica (a large cluster's counts): the proportional bound alone.
    assert conversation_move_bound(400.0, 0.25, 2.0) == 400.0 * 1.25 + 1.0


def test_a_conversation_moves_off_a_replica_only_past_the_noise_of_its_recent_requests():
    loads = {"r0": 0, "r1": 0}
    # (move_epsilon, noise_z, turns before the checked one, moved): 8 requests against none is
    # noise on two replicas (mean 4: bound 4 + 2 * 2 + 1), 16 against none is not (8 + 5.7 + 1).
    for move, z, turns, moved in (
        (0.25, 2.0, 8, False),
        (0.25, 0.0, 8, True),
        (0.25, 2.0, 16, True),
        (None, 2.0, 16, False),
    ):
        policy = Placed(clock=lambda: 0.0, recent_tau_s=300.0, move_epsilon=move, noise_z=z)
        first = _long_conversation(policy, loads, turns)
        d = policy.rank(_replicas(loads), "app", history=chain(conversation(1, turns + 1)), static_blocks=STATIC_BLOCKS)
        assert (d.chosen.name != first) == moved and (d.kind == KIND_HISTORY) == (not moved), (move, z, turns)
