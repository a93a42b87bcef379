"""Retention pins (prompt_cache_retention "24h"): the pin table's budget and time to live, the KV
manager holding pinned blocks through any churn, refreshing them on hits, unpinning them when
they expire or when running requests need the room, and the scheduler deciding at admission."""

from __future__ import annotations

import random

import pytest
from scheduler_helpers import fake_step, make_seq, random_sequences, random_steps

from prefixserve.replica.contract.retention import RETENTION_PINNED, RETENTION_UNPINNED
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.kv.pins import PinTable
from prefixserve.replica.kv.tiers import MEDIUM_HOST


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(kv: KVCacheManager, rid: str, prompt: list[int], owner: str | None = None) -> list[int]:
    """Admit a prompt (with its hits), finish it, pin it for ``owner`` when given; its block table."""
    blocks, _ = kv.get_computed_blocks(prompt)
    table = kv.allocate_slots(rid, prompt, len(prompt) - len(blocks) * kv.block_size, blocks)
    assert table is not None
    if owner is not None:
        kv.pin(rid, owner)
    kv.free(rid)
    kv.check_invariants()
    return table


def _hit_tokens(kv: KVCacheManager, prompt: list[int]) -> int:
    return kv.get_computed_blocks(prompt)[1]


def test_the_table_keeps_both_budgets_and_expires_in_refresh_order():
    pins = PinTable(max_blocks=5, max_blocks_per_owner=3, ttl_s=10.0)
    for i in range(3):
        pins.add(bytes([i]), i, "a", now=float(i))
    assert pins.room("a") == 0 and pins.room("b") == 2
    pins.add(b"b0", 10, "b", now=3.0)
    pins.add(b"b1", 11, "b", now=4.0)
    assert pins.room("b") == 0 and pins.room("c") == 0  # the replica's budget is full
    assert pins.refresh(bytes([0]), now=5.0) and not pins.refresh(b"none", now=5.0)
    pins.check_invariants()
    # Expiry follows the last refresh: block 0 (refreshed at 5) outlives blocks 1 and 2.
    assert pins.pop_expired(now=12.5) == [1, 2]
    assert pins.owned_by("a") == 1 and pins.room("c") == 2
    assert pins.pop_oldest(2, lambda pin: pin.owner == "b") == [10, 11]
    assert pins.num_expired == 2 and pins.num_released_for_room == 2
    assert pins.pop_all() == [0] and len(pins) == 0
    pins.check_invariants()


def test_pinned_blocks_survive_a_burst_that_evicts_unpinned_ones():
    for policy in ("lru", "slru", "lfu", "s3fifo"):
        kv = KVCacheManager(16, block_size=4, eviction_policy=policy, pin_budget_blocks=8)
        kept, dropped = list(range(100, 117)), list(range(200, 217))  # 4 full blocks each
        _run(kv, "kept", kept, owner="t")
        _run(kv, "dropped", dropped)
        assert kv.stats.num_pinned_blocks == 4
        for i in range(12):  # one-shot prompts that use every unpinned block many times over
            _run(kv, f"burst{i}", [1000 * (i + 1) + j for j in range(13)])
        assert _hit_tokens(kv, kept) == 16, policy
        assert _hit_tokens(kv, dropped) == 0, policy
        assert kv.num_free_blocks == 12  # the pins hold 4 blocks, counted as used


def test_the_budget_pins_a_prompt_s_head_first_and_can_pin_says_whether_all_fit():
    kv = KVCacheManager(32, block_size=4, pin_budget_blocks=6, pin_budget_per_owner=3)
    prompt = list(range(21))  # 5 full blocks
    blocks, _ = kv.get_computed_blocks(prompt)
    kv.allocate_slots("a", prompt, len(prompt), blocks)
    assert not kv.can_pin("a", "t")  # 5 new blocks, 3 allowed for one owner
    assert kv.pin("a", "t") == 3
    pinned = kv.block_table("a")[:3]
    assert {pin.block for _, pin in kv.pins.items()} == set(pinned)
    kv.free("a")
    kv.check_invariants()
    # Another owner still has its own share; the first one has none left.
    other = list(range(500, 509))  # 2 full blocks
    blocks, _ = kv.get_computed_blocks(other)
    kv.allocate_slots("b", other, len(other), blocks)
    assert kv.can_pin("b", "u") and not kv.can_pin("b", "t")
    kv.free("b")
    # A request whose prompt is pinned already needs no room: can_pin holds at a full budget.
    blocks, _ = kv.get_computed_blocks(prompt[:13])
    kv.allocate_slots("again", prompt[:13], 13 - len(blocks) * 4, blocks)
    assert kv.can_pin("again", "t")
    kv.free("again")
    kv.check_invariants()


def test_a_pin_expires_after_its_ttl_unless_a_hit_refreshes_it():
    clock = Clock()
    kv = KVCacheManager(8, block_size=4, pin_budget_blocks=8, pin_ttl_s=100.0, clock=clock)
    a, b = list(range(9)), list(range(50, 59))
    _run(kv, "a", a, owner="t")
    _run(kv, "b", b, owner="t")
    clock.now = 90.0
    _run(kv, "a-hit", a)  # an ordinary request hitting a's blocks refreshes their pins
    clock.now = 150.0
    assert kv.expire_pins() == 2  # b's two blocks, pinned at 0
    assert kv.stats.num_pinned_blocks == 2 and kv.stats.num_pins_expired == 2
    clock.now = 189.0
    assert kv.expire_pins() == 0
    clock.now = 190.0
    assert kv.expire_pins() == 2
    kv.check_invariants()
    # Expired blocks stay cached, as any freed block: they are only evictable again.
    assert _hit_tokens(kv, a) == 8


def test_running_requests_take_room_from_pins_before_any_preemption():
    kv = KVCacheManager(10, block_size=4, pin_budget_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    pinned = make_seq("p", list(range(33)), max_tokens=1, retention_owner="t")  # 8 full blocks
    sched.add(pinned)
    fake_step(sched, sched.schedule())
    assert pinned.request.cache_retention == RETENTION_PINNED and kv.stats.num_pinned_blocks == 8
    # Two requests that together need every block: the pins give way, nobody is preempted.
    for i in range(2):
        sched.add(make_seq(f"r{i}", [1000 * (i + 1) + j for j in range(15)], max_tokens=4))
    steps = 0
    while sched.has_unfinished():
        fake_step(sched, sched.schedule())
        kv.check_invariants()
        steps += 1
        assert steps < 50
    assert sched.num_preemptions == 0
    assert kv.stats.num_pins_released_for_room > 0


def test_a_request_alone_that_needs_the_pinned_room_is_admitted():
    kv = KVCacheManager(10, block_size=4, pin_budget_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    sched.add(make_seq("p", list(range(33)), max_tokens=1, retention_owner="t"))
    fake_step(sched, sched.schedule())
    big = make_seq("big", list(range(1000, 1035)), max_tokens=1)  # 9 blocks of 10
    sched.add(big)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["big"] and not out.rejected
    kv.check_invariants()


def test_released_pins_leave_the_device_for_the_host_tier():
    kv = KVCacheManager(6, block_size=4, num_host_blocks=8, host_tier=True, pin_budget_blocks=4)
    kept = list(range(17))  # 4 full blocks
    _run(kv, "kept", kept, owner="t")
    hashes = [kv.pool.block_hash[b] for _, pin in kv.pins.items() if (b := pin.block) is not None]
    assert kv.release_pins(4) == 4
    _run(kv, "burst", list(range(500, 521)))  # 6 blocks: every device block is reused
    assert all(kv.tier_medium(h) == MEDIUM_HOST for h in hashes)
    assert _hit_tokens(kv, kept) == 16  # hits from the host tier


def test_the_scheduler_serves_a_request_over_the_budget_unpinned_and_counts_it():
    kv = KVCacheManager(32, block_size=4, pin_budget_blocks=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    small = make_seq("small", list(range(9)), max_tokens=1, retention_owner="t")
    large = make_seq("large", list(range(100, 121)), max_tokens=1, retention_owner="t")
    plain = make_seq("plain", list(range(200, 221)), max_tokens=1)
    for s in (small, large, plain):
        sched.add(s)
    fake_step(sched, sched.schedule())
    assert small.request.cache_retention == RETENTION_PINNED
    assert large.request.cache_retention == RETENTION_UNPINNED
    assert plain.request.cache_retention is None
    assert sched.num_pin_refusals == 1
    assert kv.stats.num_pinned_blocks == 2  # small's two full blocks; large pinned nothing


def test_retention_needs_a_budget_and_prefix_caching():
    for kv in (KVCacheManager(8, block_size=4), KVCacheManager(8, 4, enable_prefix_caching=False, pin_budget_blocks=4)):
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
        seq = make_seq("a", list(range(9)), max_tokens=1, retention_owner="t")
        sched.add(seq)
        fake_step(sched, sched.schedule())
        assert seq.request.cache_retention == RETENTION_UNPINNED and kv.pins is None
        assert sched.num_pin_refusals == 1


def test_a_reset_unpins_everything_unless_a_request_holds_blocks():
    kv = KVCacheManager(8, block_size=4, pin_budget_blocks=4)
    _run(kv, "a", list(range(9)), owner="t")
    kv.allocate_slots("live", [7, 7, 7], 3)
    assert not kv.reset_prefix_cache() and kv.stats.num_pinned_blocks == 2
    kv.free("live")
    assert kv.reset_prefix_cache() and kv.stats.num_pinned_blocks == 0
    assert kv.num_free_blocks == 8 and _hit_tokens(kv, list(range(9))) == 0
    kv.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_invariants_hold_in_random_runs_with_pins(seed):
    rng = random.Random(seed)
    clock = Clock()
    kv = KVCacheManager(
        24,
        block_size=4,
        eviction_policy=rng.choice(["lru", "slru", "lfu", "s3fifo"]),
        pin_budget_blocks=12,
        pin_budget_per_owner=6,
        pin_ttl_s=5.0,
        clock=clock,
    )
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32), kv)
    pending = random_sequences(rng, 60, num_prefixes=4, prefix_len=(4, 20), suffix_len=(1, 8), max_tokens=(1, 6))
    for seq in pending:
        if rng.random() < 0.5:
            object.__setattr__(seq.request.prepared, "retention_owner", rng.choice(["a", "b", "c"]))
    for out in random_steps(rng, sched, pending, max_steps=2000, max_new=3):
        clock.now += rng.random()
        fake_step(sched, out)
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.stats.num_pinned_blocks <= 12
