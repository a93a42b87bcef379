"""Scheduler unit tests with a fake (pure Python) step: budgets, chunking, prefix hits,
preemption order, sequences that can never run leaving the queue, and a randomized run
that checks the KV invariants after every step."""

from __future__ import annotations

import random

import pytest
from scheduler_helpers import fake_step, make_seq, random_sequences

from prefixserve.replica.core.request import SeqStatus
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager


def test_budget_and_max_num_seqs():
    kv = KVCacheManager(64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10), kv)
    seqs = [make_seq(f"r{i}", list(range(100 * i, 100 * i + 6))) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # r0 takes 6 tokens, r1 the remaining 4 (chunked), r2 waits for a seat.
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("r0", 0, 6), ("r1", 0, 4)]
    assert [s.samples for s in out.scheduled] == [True, False]
    fake_step(sched, out)
    out = sched.schedule()
    # r0 decodes one token, r1 finishes its prompt; still two seats only.
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("r0", 6, 1), ("r1", 4, 2)]
    assert sched.num_waiting == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    kv = KVCacheManager(64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False), kv)
    a, b = make_seq("a", list(range(8))), make_seq("b", list(range(50, 58)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["a"]
    fake_step(sched, out)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]


def test_prefix_hits_at_admission_and_in_the_same_step():
    kv = KVCacheManager(64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    shared = list(range(10))
    a, b = make_seq("a", shared + [77, 78]), make_seq("b", shared + [88])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # b is admitted in the same step and shares a's two full blocks (8 tokens), computed now.
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("a", 0, 12), ("b", 8, 3)]
    assert b.request.num_cached_tokens == 8
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]


def test_preemption_takes_the_youngest_and_admits_nothing_that_step():
    kv = KVCacheManager(6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    a = make_seq("a", list(range(8)), max_tokens=8)
    b = make_seq("b", list(range(10, 18)), max_tokens=8)
    c = make_seq("c", list(range(20, 24)), max_tokens=8)
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    fake_step(sched, out)  # a and b hold 2 blocks each, 2 free
    sched.add(c)
    out = sched.schedule()  # a, b decode into new blocks (2), c cannot get one
    assert [s.seq.seq_id for s in out.scheduled] == ["a", "b"]
    fake_step(sched, out)
    assert kv.num_free_blocks == 0
    for _ in range(3):
        fake_step(sched, sched.schedule())  # tokens 10..12 fit in the third blocks
    out = sched.schedule()  # a needs a 4th block: b (the youngest) is preempted
    assert [s.seq_id for s in out.preempted] == ["b"]
    assert [s.seq.seq_id for s in out.scheduled] == ["a"]
    assert list(sched.waiting)[:2] == [b, c] and b.num_computed_tokens == 0 and b.status is SeqStatus.WAITING
    assert not kv.has_request("b")
    while sched.has_unfinished():
        fake_step(sched, sched.schedule())
        kv.check_invariants()
    assert all(s.num_output_tokens == 8 for s in (a, b, c))
    assert kv.num_free_blocks == 6 and sched.num_preemptions >= 1


def test_randomized_run_keeps_invariants_and_frees_everything():
    rng = random.Random(1234)
    kv = KVCacheManager(40, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), kv)
    pending = random_sequences(rng, 40, num_prefixes=3, prefix_len=(4, 13), suffix_len=(1, 20), max_tokens=(1, 12))
    done = []
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                sched.add(pending.pop())
        out = sched.schedule()
        assert out.num_batched_tokens <= 24 and sched.num_running <= 6
        if out.preempted:
            assert all(s.start > 0 or s.seq.status is SeqStatus.RUNNING for s in out.scheduled)
        done += fake_step(sched, out)
        for seq in sched.running:
            assert kv.num_tokens(seq.seq_id) == seq.num_computed_tokens
        kv.check_invariants()
        steps += 1
        assert steps < 2000, "no progress"
    assert len(done) == 40 and all(s.num_output_tokens == s.request.params.max_tokens for s in done)
    assert kv.usage == 0.0 and kv.num_requests == 0
    assert kv.stats.prefix_hit_tokens > 0


def test_a_sequence_that_can_never_run_leaves_the_queue_and_blocks_nobody():
    kv = KVCacheManager(4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), kv)
    with pytest.raises(ValueError, match="needs 5 sequences at once but max_num_seqs is 4"):
        sched.add(make_seq("wide", [1, 2, 3], n=5))
    assert sched.num_waiting == 0
    huge, small, after = make_seq("huge", list(range(20))), make_seq("small", [7, 8]), make_seq("after", [9])
    for s in (huge, small):
        sched.add(s)
    out = sched.schedule()
    # 20 tokens need 5 blocks of a 4-block pool: rejected at once, and "small" runs in the same step.
    assert out.rejected == [huge] and huge.status is SeqStatus.FINISHED
    assert [s.seq.seq_id for s in out.scheduled] == ["small"] and out.changed_state
    sched.add(after)
    while sched.has_unfinished():
        fake_step(sched, sched.schedule())
    assert small.num_output_tokens == after.num_output_tokens == 4
    assert kv.num_free_blocks == 4
    out = sched.schedule()
    assert out.is_empty and not out.changed_state  # nothing to do: the engine waits instead of stepping


def test_a_waiting_sequence_that_fits_later_waits_its_turn():
    kv = KVCacheManager(4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), kv)
    a, b = make_seq("a", list(range(12)), max_tokens=2), make_seq("b", list(range(50, 58)), max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # b does not fit beside a (3 + 2 blocks of 4) but will once a finishes: it waits, not rejected.
    assert [s.seq.seq_id for s in out.scheduled] == ["a"] and not out.rejected
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.rejected
        fake_step(sched, out)
    assert b.num_output_tokens == 2
