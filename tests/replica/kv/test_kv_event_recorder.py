"""The KV manager's vLLM-format block events (replica/kv/event_recorder.py): what is stored, evicted,
dropped from the host tier and reset, in order, with the chain's parent and tokens; replayed, the
events reproduce the device pool's and the host tier's hash sets exactly."""

from __future__ import annotations

import random

import pytest

from prefixserve.replica.contract.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)
from prefixserve.replica.kv.event_recorder import KVEventRecorder, TierSetReporter
from prefixserve.replica.kv.hashing import hash_blocks
from prefixserve.replica.kv.manager import KVCacheManager

BS = 4


def _manager(num_blocks: int = 8, host_blocks: int = 0) -> tuple[KVCacheManager, KVEventRecorder]:
    kv = KVCacheManager(num_blocks, BS, num_host_blocks=host_blocks, host_tier=host_blocks > 0)
    rec = KVEventRecorder()
    kv.record_events(rec)
    return kv, rec


def _admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    blocks, hit = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(rid, tokens, len(tokens) - hit, blocks) is not None


def _replay(events: list[KVEvent], media: dict[str, set[int]]) -> None:
    for e in events:
        if isinstance(e, AllBlocksCleared):
            for held in media.values():
                held.clear()
        elif isinstance(e, BlockStored):
            media.setdefault(e.medium or "GPU", set()).update(int(h) for h in e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved)
            held = media.setdefault(e.medium or "GPU", set())
            for h in e.block_hashes:
                assert h in held, "a removed block was never stored"
                held.discard(int(h))


def test_a_prompts_full_blocks_are_one_stored_event_with_parent_and_tokens():
    kv, rec = _manager()
    tokens = list(range(100, 110))  # 2 full blocks + 2 tokens
    _admit(kv, "a", tokens)
    events = rec.take()
    digests = hash_blocks(tokens, BS)
    assert events == [
        BlockStored(
            block_hashes=[external_block_hash(d) for d in digests],
            parent_block_hash=None,
            token_ids=tokens[:8],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    assert rec.take() == []
    # The next block (decode filled it) chains to the last one.
    more = tokens + [1, 2]
    assert kv.allocate_slots("a", more, 2) is not None
    (e,) = rec.take()
    assert isinstance(e, BlockStored)
    assert e.parent_block_hash == external_block_hash(digests[-1])
    assert e.token_ids == more[8:12]
    assert e.block_hashes == [external_block_hash(hash_blocks(more, BS)[2])]


def test_a_prefix_hit_stores_nothing_and_a_duplicate_block_stores_nothing():
    kv, rec = _manager()
    tokens = list(range(100, 109))
    _admit(kv, "a", tokens)
    rec.take()
    _admit(kv, "b", tokens)  # both full blocks are hits
    assert rec.take() == []


def test_eviction_is_a_removed_event_and_reset_is_all_blocks_cleared():
    kv, rec = _manager(num_blocks=4)
    first = list(range(100, 109))  # 2 full blocks (+1 token: 3 blocks)
    _admit(kv, "a", first)
    kv.free("a")
    stored = rec.take()
    _admit(kv, "b", list(range(200, 209)))  # needs 3 of 4 blocks: evicts first's
    events = rec.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and removed[0].medium == "GPU"
    gone = {h for e in removed for h in e.block_hashes}
    assert gone <= set(stored[0].block_hashes)
    kv.free("b")
    assert kv.reset_prefix_cache()
    assert rec.take() == [AllBlocksCleared()]


def test_host_tier_copies_and_drops_carry_the_cpu_medium():
    kv, rec = _manager(num_blocks=4, host_blocks=2)
    _admit(kv, "a", list(range(100, 109)))
    kv.take_swap_ops()
    kv.free("a")
    _admit(kv, "b", list(range(200, 209)))  # evicts a's blocks to the host tier
    kv.take_swap_ops()
    events = rec.take()
    assert any(isinstance(e, BlockStored) and e.medium == "CPU" and e.token_ids == [] for e in events)


def test_recorder_overflow_becomes_all_blocks_cleared():
    rec = KVEventRecorder(max_events=2)
    rec.removed([b"a" * 16])
    rec.removed([b"b" * 16])
    rec.removed([b"c" * 16])
    assert rec.take() == [AllBlocksCleared()]
    assert rec.overflows == 1
    with pytest.raises(ValueError, match="max_events"):
        KVEventRecorder(max_events=0)


@pytest.mark.parametrize("host_blocks", [0, 3])
def test_replayed_events_equal_the_pools_hash_set(host_blocks):
    """Random admissions, decodes, frees and resets: the events, applied in order, hold exactly the
    device pool's hashes (GPU) and the host tier's (CPU) after every step."""
    rng = random.Random(7)
    kv, rec = _manager(num_blocks=10, host_blocks=host_blocks)
    media: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(3, 14))] for _ in range(6)]
    live: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.45 and len(live) < 3:
            rid = f"r{step}"
            tokens = list(rng.choice(prompts))
            blocks, hit = kv.get_computed_blocks(tokens)
            if kv.allocate_slots(rid, tokens, len(tokens) - hit, blocks) is not None:
                live[rid] = tokens
        elif op < 0.75 and live:
            rid = rng.choice(sorted(live))
            live[rid].append(rng.randrange(50))
            if kv.allocate_slots(rid, live[rid], 1) is None:
                kv.free(rid)
                del live[rid]
        elif op < 0.97 and live:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        elif not live:
            assert kv.reset_prefix_cache()
        kv.take_swap_ops()
        _replay(rec.take(), media)
        device = {external_block_hash(h) for h in kv.pool.hash_to_block}
        assert media["GPU"] == device
        assert media["CPU"] == {external_block_hash(h) for h in kv._host_of_hash}


def test_a_tier_known_as_a_set_reports_its_changes_and_everything_again_after_a_clear():
    rec = KVEventRecorder()
    disk = TierSetReporter(rec)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    disk.update({a, b})
    (e,) = rec.take()
    assert isinstance(e, BlockStored) and e.medium == "STORAGE" and e.token_ids == [] and e.block_size == 0
    assert sorted(e.block_hashes) == sorted(external_block_hash(h) for h in (a, b))
    disk.update({a, b})
    assert rec.take() == []
    disk.update({b, c})
    removed, stored = rec.take()
    assert removed == BlockRemoved(block_hashes=[external_block_hash(a)], medium="STORAGE")
    assert isinstance(stored, BlockStored) and stored.block_hashes == [external_block_hash(c)]
    rec.cleared()  # a consumer forgets the replica: the disk's blocks are stored anew
    disk.update({b, c})
    events = rec.take()
    assert events[0] == AllBlocksCleared()
    assert sorted(events[1].block_hashes) == sorted(external_block_hash(h) for h in (b, c))
