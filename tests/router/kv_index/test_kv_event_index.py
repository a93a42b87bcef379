"""The router's KV-event index (router/kv_index/index.py): stored/removed/cleared per medium and replica,
the longest prefix per replica, bytes and int hashes meeting, the bound under any event stream, and
the sequence verdicts (next, gap, restart)."""

from __future__ import annotations

import random

import pytest
from kv_helpers import block_stored

from prefixserve.replica.contract.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    external_block_hash,
)
from prefixserve.router.kv_index.index import KVEventIndex, SequenceTracker, Verdict


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def test_longest_prefix_per_replica():
    index = KVEventIndex()
    index.apply("a", batch(block_stored([1, 2, 3])))
    index.apply("b", batch(block_stored([1, 2]), block_stored([4])))
    index.apply("c", batch(block_stored([2, 3])))  # not block 0: no prefix
    assert index.longest_prefix([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.longest_prefix([9, 1]) == {}
    assert index.longest_prefix([]) == {}
    assert index.holders(2) == {"a": frozenset({"GPU"}), "b": frozenset({"GPU"}), "c": frozenset({"GPU"})}


def test_media_are_tracked_apart_and_filtered():
    index = KVEventIndex()
    index.apply("a", batch(block_stored([1, 2]), block_stored([2, 3], medium="CPU")))
    assert index.longest_prefix([1, 2, 3]) == {"a": 3}
    assert index.longest_prefix([1, 2, 3], media={"GPU"}) == {"a": 2}
    index.apply("a", batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert index.holders(2) == {"a": frozenset({"CPU"})}
    assert index.longest_prefix([1, 2, 3], media={"GPU"}) == {"a": 1}
    index.apply("a", batch(BlockRemoved(block_hashes=[2], medium="CPU")))
    assert index.holders(2) == {}
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}
    # A medium left out (None) is vLLM's device pool.
    index.apply("b", batch(block_stored([7], medium=None)))  # type: ignore[arg-type]
    assert index.holders(7) == {"b": frozenset({"GPU"})}


def test_bytes_and_int_hashes_meet():
    digest = bytes(range(32))
    index = KVEventIndex()
    index.apply("bytes-publisher", batch(block_stored([digest])))
    index.apply("int-publisher", batch(block_stored([external_block_hash(digest)])))
    assert index.longest_prefix([digest]) == {"bytes-publisher": 1, "int-publisher": 1}
    assert index.longest_prefix([external_block_hash(digest)]) == {"bytes-publisher": 1, "int-publisher": 1}


def test_all_blocks_cleared_and_forget_touch_one_replica():
    index = KVEventIndex()
    index.apply("a", batch(block_stored([1, 2])))
    index.apply("b", batch(block_stored([1])))
    index.apply("a", batch(AllBlocksCleared(), block_stored([5])))
    assert index.longest_prefix([1, 2]) == {"b": 1}
    assert index.holders(5) == {"a": frozenset({"GPU"})}
    index.forget("b")
    assert index.longest_prefix([1]) == {}
    assert len(index) == 1 and index.replicas == ["a"]


def test_removing_what_was_never_stored_changes_nothing():
    index = KVEventIndex()
    index.apply("a", batch(BlockRemoved(block_hashes=[1, 2], medium="GPU"), block_stored([3])))
    index.apply("a", batch(BlockRemoved(block_hashes=[3], medium="CPU")))  # stored in GPU only
    assert index.holders(3) == {"a": frozenset({"GPU"})}
    assert len(index) == 1


def test_the_bound_drops_the_least_recently_stored_hashes():
    index = KVEventIndex(max_entries=4)
    index.apply("a", batch(block_stored([1, 2, 3])))
    index.apply("b", batch(block_stored([1])))  # 1 is stored again: the most recent now
    index.apply("b", batch(block_stored([4])))  # 5 pairs: hash 2 (the oldest) goes
    assert len(index) == 4
    assert index.holders(2) == {}
    assert index.longest_prefix([1, 2, 3]) == {"a": 1, "b": 1}
    assert index.stats.evicted == 1
    with pytest.raises(ValueError, match="max_entries"):
        KVEventIndex(max_entries=0)


def test_no_event_stream_grows_the_index_past_its_bound():
    """Random stores, removes, clears, bad hashes and unknown replicas: never more than the bound, and
    the per-replica counts always add up to the index's size."""
    rng = random.Random(3)
    index = KVEventIndex(max_entries=50)
    for _ in range(2000):
        replica = rng.choice("abcd")
        kind = rng.random()
        hashes = [rng.choice([rng.randrange(200), rng.randbytes(32), "junk", None, True]) for _ in range(20)]
        if kind < 0.6:
            index.apply(replica, batch(block_stored(hashes, medium=rng.choice(["GPU", "CPU", "STORAGE"]))))
        elif kind < 0.95:
            index.apply(replica, batch(BlockRemoved(block_hashes=hashes, medium=rng.choice(["GPU", "CPU"]))))
        else:
            index.apply(replica, batch(AllBlocksCleared()))
        assert len(index) <= 50
        assert sum(index.num_blocks(r) for r in "abcd") == len(index)
    assert index.stats.invalid_hashes > 0 and index.stats.evicted > 0


def test_sequence_verdicts():
    t = SequenceTracker()
    assert t.check("a", 0) is Verdict.NEXT
    assert t.check("b", 5) is Verdict.GAP  # a first frame past 0: the history is missing
    t.applied("a", 0)
    assert t.check("a", 1) is Verdict.NEXT
    assert t.check("a", 3) is Verdict.GAP
    assert t.expected("a") == 1
    t.applied("a", 3)
    assert t.check("a", 3) is Verdict.RESTART
    assert t.check("a", 0) is Verdict.RESTART
    t.forget("a")
    assert t.check("a", 0) is Verdict.NEXT
