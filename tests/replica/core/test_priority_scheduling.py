"""The priority scheduling policy (vLLM's --scheduling-policy priority): the waiting queue in
(priority, arrival) order, the lowest priority preempted first, and fcfs left as it was."""

from __future__ import annotations

import random

import pytest
from scheduler_helpers import FakeDevice, fake_step, make_seq

from prefixserve.replica.core.request import SeqStatus, Sequence
from prefixserve.replica.core.request_queue import FCFSQueue, PriorityQueue, priority_key
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager


def priority_scheduler(num_blocks: int, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(scheduling_policy="priority", **config), kv)


def admission_order(sched: Scheduler) -> list[str]:
    """Run to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [s.seq.seq_id for s in out.scheduled if s.seq.seq_id not in order]
        fake_step(sched, out)
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = priority_scheduler(64, max_num_seqs=1, max_num_batched_tokens=100)
    # (id, priority, arrival): lower priority first, then the earlier arrival, then the order added.
    requests = [("p2", 2, 0.0), ("p0-late", 0, 3.0), ("p1", 1, 1.0), ("p0", 0, 2.0), ("n1", -1, 4.0)]
    for rid, priority, arrival in requests:
        sched.add(make_seq(rid, [1, 2, 3], max_tokens=1, priority=priority, arrival_time=arrival))
    sched.add(make_seq("p0-late-too", [1, 2, 3], max_tokens=1, arrival_time=3.0))
    expected = ["n1", "p0", "p0-late", "p0-late-too", "p1", "p2"]
    assert [s.seq_id for s in sched.waiting] == expected
    assert admission_order(sched) == expected


def test_fcfs_ignores_priority():
    kv = KVCacheManager(64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100), kv)
    for i, priority in enumerate([3, -1, 0]):
        sched.add(make_seq(f"r{i}", [1, 2, 3], max_tokens=1, priority=priority, arrival_time=float(-i)))
    assert admission_order(sched) == ["r0", "r1", "r2"]


def _fill_then_grow(sched: Scheduler, first: Sequence, second: Sequence):
    """Admit two 8-token prompts into 6 blocks of 4 and decode until one needs a 4th block."""
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {first.seq_id, second.seq_id}
    fake_step(sched, out)  # 2 blocks each, 2 free
    for _ in range(4):  # tokens 9..12: the third blocks
        fake_step(sched, sched.schedule())
    assert sched.kv.num_free_blocks == 0
    return sched.schedule()  # the first in running order needs a 4th block


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_lowest_priority_under_priority_and_the_youngest_under_fcfs(policy):
    kv = KVCacheManager(6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, scheduling_policy=policy), kv)
    low = make_seq("low", list(range(8)), max_tokens=8, priority=5, arrival_time=0.0)
    high = make_seq("high", list(range(10, 18)), max_tokens=8, priority=0, arrival_time=1.0)
    out = _fill_then_grow(sched, low, high)
    victim, survivor = (low, high) if policy == "priority" else (high, low)
    assert [s.seq_id for s in out.preempted] == [victim.seq_id]
    assert [s.seq.seq_id for s in out.scheduled] == [survivor.seq_id]
    assert victim.status is SeqStatus.WAITING and victim.num_computed_tokens == 0
    while sched.has_unfinished():
        fake_step(sched, sched.schedule())
        kv.check_invariants()
    assert low.num_output_tokens == high.num_output_tokens == 8 and kv.num_free_blocks == 6


def test_among_equal_priorities_the_latest_arrival_is_preempted():
    sched = priority_scheduler(6, max_num_seqs=8, max_num_batched_tokens=100)
    late = make_seq("late", list(range(8)), max_tokens=8, priority=1, arrival_time=2.0)
    early = make_seq("early", list(range(10, 18)), max_tokens=8, priority=1, arrival_time=1.0)
    out = _fill_then_grow(sched, late, early)  # added late first: arrival decides, not the order added
    assert [s.seq_id for s in out.preempted] == ["late"]
    assert [s.seq.seq_id for s in out.scheduled] == ["early"]


def test_a_waiting_request_of_higher_priority_does_not_preempt_a_running_one():
    sched = priority_scheduler(4, max_num_seqs=8, max_num_batched_tokens=100)
    low = make_seq("low", list(range(8)), max_tokens=2, priority=9)
    sched.add(low)
    fake_step(sched, sched.schedule())  # low holds 2 of the 4 blocks (8 prompt tokens + 1)
    urgent = make_seq("urgent", list(range(20, 32)), max_tokens=1, priority=-9, arrival_time=1.0)
    sched.add(urgent)  # needs 3 blocks, low leaves 1 free: it waits for low to finish, as in vLLM
    out = sched.schedule()
    assert out.preempted == [] and [s.seq.seq_id for s in out.scheduled] == ["low"]
    fake_step(sched, out)
    assert low.is_finished
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["urgent"]


def test_a_preempted_request_waits_at_its_priority_not_at_the_front():
    sched = priority_scheduler(6, max_num_seqs=8, max_num_batched_tokens=100)
    low = make_seq("low", list(range(8)), max_tokens=8, priority=5)
    high = make_seq("high", list(range(10, 18)), max_tokens=8, priority=0, arrival_time=1.0)
    later_high = make_seq("later-high", list(range(30, 34)), max_tokens=1, priority=0, arrival_time=3.0)
    sched.add(low)
    sched.add(high)
    fake_step(sched, sched.schedule())
    sched.add(later_high)  # waits: the blocks left go to the running ones' decodes
    for _ in range(4):
        fake_step(sched, sched.schedule())
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["low"]
    # Under fcfs low would be next; here the later request of a better priority comes first.
    assert [s.seq_id for s in sched.waiting] == ["later-high", "low"]


def test_queues_keep_their_orders():
    rng = random.Random(7)
    seqs = [
        make_seq(f"r{i}", [i], priority=rng.randrange(-3, 4), arrival_time=float(rng.randrange(5))) for i in range(60)
    ]
    for i, s in enumerate(seqs):
        s.request.arrival_order = i
    heap, fifo = PriorityQueue(), FCFSQueue()
    for s in seqs:
        heap.push(s)
        fifo.push(s)
    gone = seqs[10]
    heap.remove(gone)
    fifo.remove(gone)
    expected = sorted((s for s in seqs if s is not gone), key=priority_key)
    assert list(heap) == expected and len(heap) == 59
    assert list(fifo) == [s for s in seqs if s is not gone]
    fifo.push_preempted(gone)
    heap.push_preempted(gone)
    assert fifo.peek() is gone
    assert [heap.pop() for _ in range(len(heap))] == sorted(seqs, key=priority_key)
    with pytest.raises(ValueError):
        heap.remove(gone)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_randomized_priority_run_admits_in_order_preempts_the_lowest_and_frees_everything(mode):
    rng = random.Random(4321)
    kv = KVCacheManager(16, block_size=4, enable_prefix_caching=False, num_host_blocks=8 if mode == "swap" else 0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, preemption_mode=mode, scheduling_policy="priority"),
        kv,
    )
    pending = [
        make_seq(
            f"r{i}",
            [rng.randrange(1000) for _ in range(rng.randrange(2, 24))],
            max_tokens=rng.randrange(1, 20),
            priority=rng.randrange(-2, 3),
            arrival_time=float(i),
        )
        for i in range(40)
    ]
    device = FakeDevice(kv)  # every KV move keeps each computed position's token
    done = []
    for _ in range(5000):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        before = list(sched.waiting)
        out = sched.schedule()
        running_keys = [priority_key(s) for s in sched.running]
        assert running_keys == sorted(running_keys)
        for victim in out.preempted:
            assert all(priority_key(victim) >= k for k in running_keys)
        left = [s for s in before if s not in set(sched.waiting)]
        assert left == before[: len(left)], "admission skipped a better waiting request"
        device.step(out)
        done += fake_step(sched, out)
        kv.check_invariants()
        if not pending and not sched.has_unfinished():
            break
    assert len(done) == 40 and kv.num_free_blocks == 16 and sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_preemptions > 0
