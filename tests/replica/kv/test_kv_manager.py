"""Scenario tests of the KV block manager on tiny pools: exact block ids and queue order."""

from __future__ import annotations

import random

import pytest
from kv_helpers import snapshot

from prefixserve.replica.kv.hashing import BlockHasher
from prefixserve.replica.kv.manager import KVCacheManager

BS = 4


def mgr(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, **kw)


def admit(m: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: lookup, then allocate the rest."""
    blocks, n = m.get_computed_blocks(tokens, salt)
    table = m.allocate_slots(rid, tokens, len(tokens) - n, blocks, salt)
    m.check_invariants()
    return table


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_fresh_pool_hands_out_blocks_in_order_and_grows_per_block():
    m = mgr()
    p = prompt(1, 6)
    assert m.allocate_slots("a", p, 6) == [0, 1]
    assert m.num_tokens("a") == 6
    p += [5, 6]  # two decode steps: the second block fills up, no new block
    assert m.allocate_slots("a", p[:7], 1) == [0, 1]
    assert m.allocate_slots("a", p, 1) == [0, 1]
    assert m.allocate_slots("a", p + [9], 1) == [0, 1, 2]
    assert m.num_free_blocks == 5 and m.usage == pytest.approx(3 / 8)
    m.check_invariants()


def test_shared_prefix_is_shared_not_copied():
    m = mgr()
    sys_prompt = prompt(2, 8)
    assert admit(m, "a", sys_prompt + [1, 2]) == [0, 1, 2]
    assert m.get_computed_blocks(sys_prompt + [3, 4, 5]) == ([0, 1], 8)
    assert admit(m, "b", sys_prompt + [3, 4, 5]) == [0, 1, 3]
    assert m.pool.ref_cnt[:4] == [2, 2, 1, 1]
    s = m.stats
    assert (s.num_used_blocks, s.num_free_blocks, s.prefix_query_tokens, s.prefix_hit_tokens) == (4, 4, 21, 8)
    assert s.hit_rate == pytest.approx(8 / 21)


def test_lookup_never_covers_the_whole_prompt_and_changes_nothing():
    m = mgr()
    p = prompt(3, 8)  # exactly two blocks
    admit(m, "a", p)
    before = snapshot(m)
    assert m.get_computed_blocks(p) == ([0], 4)  # the last token is recomputed for its logits
    assert m.get_computed_blocks(p[:1]) == ([], 0)
    assert m.get_computed_blocks([]) == ([], 0)
    assert snapshot(m) == before
    # Recomputing block 1 finds its hash taken by block 1: the old mapping stays.
    assert admit(m, "b", p) == [0, 2]
    assert m.pool.hash_to_block[m.pool.block_hash[1]] == 1 and m.pool.block_hash[2] is None


def test_free_is_tail_first_and_keeps_blocks_cached():
    m = mgr(6)
    p = prompt(4, 10)
    admit(m, "a", p)  # [0, 1, 2]
    m.free("a")
    assert m.pool.free_queue() == [3, 4, 5, 2, 1, 0]
    s = m.stats
    assert (s.num_free_blocks, s.num_cached_free_blocks, s.num_used_blocks, s.num_cached_blocks) == (6, 2, 0, 2)
    assert m.free("a") is False  # freeing twice is harmless


def test_hits_on_freed_blocks_come_out_of_the_middle_of_the_queue():
    m = mgr(6)
    p = prompt(5, 10)
    admit(m, "a", p)
    m.free("a")
    assert admit(m, "b", p[:9] + [77]) == [0, 1, 3]
    assert m.pool.free_queue() == [4, 5, 2]
    assert m.stats.num_cached_free_blocks == 0 and m.stats.num_evictions == 0


def test_lru_eviction_order_tail_of_the_chain_first():
    m = mgr(6)
    a = prompt(6, 12)  # three full blocks, all cached
    assert admit(m, "a", a) == [0, 1, 2]
    m.free("a")  # queue: 3 4 5 | 2 1 0
    b = prompt(7, 20)  # needs five blocks: takes 3 4 5 then evicts a's tail 2, then 1
    assert admit(m, "b", b) == [3, 4, 5, 2, 1]
    assert m.stats.num_evictions == 2
    assert m.get_computed_blocks(a + [1]) == ([0], 4)  # a's head is still hit-able
    m.free("b")
    assert m.pool.free_queue() == [0, 1, 2, 5, 4, 3]
    m.check_invariants()


def test_salt_isolates_tenants():
    m = mgr()
    p = prompt(8, 9)
    admit(m, "a", p, salt="tenant-1")
    assert m.get_computed_blocks(p, "tenant-1") == ([0, 1], 8)
    assert m.get_computed_blocks(p, "tenant-2") == ([], 0)
    assert m.get_computed_blocks(p) == ([], 0)
    assert admit(m, "b", p, salt="tenant-2") == [3, 4, 5]


def test_no_room_returns_none_and_changes_nothing():
    m = mgr(5)
    p = prompt(9, 10)
    admit(m, "a", p)  # [0, 1, 2]
    m.free("a")
    admit(m, "x", prompt(10, 8))  # [3, 4]: the cached blocks 2 1 0 are all that is free
    before = snapshot(m)
    # b hits blocks 0 and 1 (both free, so reviving them costs two) and needs two more.
    blocks, n = m.get_computed_blocks(p[:8] + [1, 2, 3, 4, 5])
    assert (blocks, n) == ([0, 1], 8)
    assert m.num_blocks_needed("b", 5, blocks) == 4
    assert not m.can_allocate("b", 5, blocks)
    assert m.allocate_slots("b", p[:8] + [1, 2, 3, 4, 5], 5, blocks) is None
    assert snapshot(m) == before
    # A running request that cannot grow is left as it was too.
    assert m.allocate_slots("x", prompt(10, 8) + [1] * 13, 13) is None
    assert snapshot(m) == before
    m.check_invariants()
    # With the room there (three free blocks), the same call succeeds.
    assert m.allocate_slots("b", p[:8] + [1], 1, blocks) == [0, 1, 2]


def test_hits_held_by_a_running_request_take_no_free_block():
    m = mgr(5)
    p = prompt(26, 10)
    admit(m, "a", p)  # [0, 1, 2], still running: its first two blocks can be hit
    admit(m, "x", prompt(27, 4))  # [3]: one block is left free
    q = p[:8] + [7]
    blocks, n = m.get_computed_blocks(q)
    assert (blocks, n) == ([0, 1], 8)
    assert m.num_blocks_needed("b", 1, blocks) == 1  # the hits are in use: only the new block
    assert admit(m, "b", q) == [0, 1, 4]
    assert m.pool.ref_cnt[:2] == [2, 2] and m.num_free_blocks == 0


def test_blocks_registered_at_allocation_are_shared_in_the_same_step():
    m = mgr()
    p = prompt(11, 13)
    m.allocate_slots("a", p, 13)  # scheduled, not computed yet
    assert m.get_computed_blocks(p) == ([0, 1, 2], 12)


def test_chunked_prefill_registers_each_chunk_and_hashes_incrementally():
    m = mgr(10)
    p = prompt(12, 30)
    assert m.allocate_slots("a", p[:10], 10) == [0, 1, 2]  # only the known tokens so far
    assert m.stats.num_cached_blocks == 2
    assert m.allocate_slots("a", p[:20], 10) == [0, 1, 2, 3, 4]
    assert m.allocate_slots("a", p, 10) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert m.stats.num_cached_blocks == 7
    assert m.get_computed_blocks(p + [1]) == ([0, 1, 2, 3, 4, 5, 6], 28)
    m.check_invariants()


def test_slots_ahead_of_known_tokens_are_registered_once_known():
    m = mgr()
    p = prompt(13, 6)
    assert m.allocate_slots("a", p, 6) == [0, 1]
    assert m.allocate_slots("a", p, 2) == [0, 1]  # two slots for tokens not sampled yet
    assert m.stats.num_cached_blocks == 1
    assert m.allocate_slots("a", p + [1, 2], 0) == [0, 1]
    assert m.stats.num_cached_blocks == 2
    assert m.get_computed_blocks(p + [1, 2, 3]) == ([0, 1], 8)


def test_decoded_blocks_serve_the_next_turn():
    m = mgr()
    p = prompt(14, 5)
    m.allocate_slots("a", p, 5)
    for t in range(7):  # decode: one slot per step for the token just sampled
        p.append(100 + t)
        m.allocate_slots("a", p, 1)
    assert m.num_tokens("a") == 12 and m.block_table("a") == [0, 1, 2]
    m.free("a")
    assert m.get_computed_blocks(p + [9, 9]) == ([0, 1, 2], 12)


def test_fork_shares_and_copy_on_write_copies_the_partial_block():
    m = mgr()
    p = prompt(15, 6)
    assert m.allocate_slots("a", p, 6) == [0, 1]
    assert m.fork("a", "b") == [0, 1]
    assert m.pool.ref_cnt[:2] == [2, 2]
    m.check_invariants()
    # b writes into the shared partial block 1: it gets a copy first.
    assert m.allocate_slots("b", p + [7], 1) == [0, 2]
    assert m.take_copy_ops() == [(1, 2)]
    assert m.take_copy_ops() == []
    assert m.pool.ref_cnt[:3] == [2, 1, 1]
    # a is now block 1's only holder: it writes in place.
    assert m.allocate_slots("a", p + [8], 1) == [0, 1]
    assert m.take_copy_ops() == []
    assert m.stats.num_cow_copies == 1
    m.check_invariants()
    # Both fill their blocks with different tokens: two different cached blocks.
    m.allocate_slots("a", p + [8, 8], 1)
    m.allocate_slots("b", p + [7, 7], 1)
    assert m.get_computed_blocks(p + [8, 8, 0]) == ([0, 1], 8)
    assert m.get_computed_blocks(p + [7, 7, 0]) == ([0, 2], 8)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    m = mgr()
    p = prompt(16, 8)
    m.allocate_slots("a", p, 8)
    m.fork("a", "b")
    assert m.num_blocks_needed("b", 1) == 1
    assert m.allocate_slots("b", p + [1], 1) == [0, 1, 2]
    assert m.take_copy_ops() == []
    with pytest.raises(ValueError, match="already has a block table"):
        m.fork("a", "b")
    with pytest.raises(KeyError):
        m.fork("nobody", "c")


def test_copy_on_write_counts_against_free_blocks():
    m = mgr(3)
    p = prompt(17, 6)
    m.allocate_slots("a", p, 6)
    m.fork("a", "b")
    m.allocate_slots("c", [1], 1)  # the last free block
    before = snapshot(m)
    assert m.num_blocks_needed("b", 1) == 1
    assert m.allocate_slots("b", p + [1], 1) is None
    assert snapshot(m) == before


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    m = mgr()
    p = prompt(18, 9)
    admit(m, "a", p)
    assert m.reset_prefix_cache() is False
    assert m.get_computed_blocks(p) == ([0, 1], 8)
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(p) == ([], 0)
    assert m.stats.num_cached_blocks == 0 and m.stats.num_cached_free_blocks == 0
    m.check_invariants()


def test_prefix_counters_count_admissions_not_lookups():
    m = mgr(3)
    p = prompt(19, 9)
    admit(m, "a", p)  # 9 queried, 0 hit
    blocks, n = m.get_computed_blocks(p)
    for _ in range(3):  # no room yet: looked up and refused again and again
        assert m.get_computed_blocks(p) == (blocks, n)
        assert m.allocate_slots("b", p, 9 - n, blocks) is None
    assert (m.stats.prefix_query_tokens, m.stats.prefix_hit_tokens) == (9, 0)
    m.free("a")
    assert admit(m, "b", p) is not None
    assert (m.stats.prefix_query_tokens, m.stats.prefix_hit_tokens) == (18, 8)


def test_concurrent_identical_content_keeps_the_first_mapping():
    m = mgr()
    p = prompt(20, 9)
    m.allocate_slots("a", p, 9)  # neither looked up: both compute the same blocks
    m.allocate_slots("b", p, 9)
    assert m.block_table("b") == [3, 4, 5]
    assert m.pool.block_hash[3] is None and m.get_computed_blocks(p) == ([0, 1], 8)
    m.free("b")
    assert m.stats.num_cached_free_blocks == 0
    m.check_invariants()


def test_stale_computed_blocks_are_rejected():
    m = mgr(4)
    p = prompt(21, 9)
    admit(m, "a", p)
    m.free("a")
    blocks, _ = m.get_computed_blocks(p)
    m.allocate_slots("x", [1] * 16, 16)  # evicts every cached block
    with pytest.raises(ValueError, match="get_computed_blocks right before"):
        m.allocate_slots("b", p, 1, blocks)


def test_computed_blocks_other_than_the_lookup_returned_are_checked_again():
    """allocate_slots trusts the last lookup's hit only as it was returned, and only while no
    block lost its hash since: a reset, or a list the caller changed, is checked block by block."""
    for policy in ("lru", "slru"):
        m = mgr(8, eviction_policy=policy)
        p = prompt(25, 9)
        admit(m, "a", p)
        m.free("a")
        blocks, _ = m.get_computed_blocks(p)
        assert m.reset_prefix_cache()  # every block free: forgets the hashes, evicts nothing
        with pytest.raises(ValueError, match="get_computed_blocks right before"):
            m.allocate_slots("b", p, 1, blocks)
        admit(m, "a", p)
        m.free("a")
        blocks, _ = m.get_computed_blocks(p)
        blocks[1] = next(b for b in range(8) if m.pool.block_hash[b] is None)  # the caller's own list
        with pytest.raises(ValueError, match="block 1 of this prompt"):
            m.allocate_slots("b", p, 1, blocks)
        m.check_invariants()


def test_the_lookup_memo_never_serves_hashes_of_other_tokens():
    """The hashes a lookup memoizes are reused only for the tokens they were computed from:
    not after the caller changed its list in place, whatever the type or length passed."""
    fresh = BlockHasher()
    p = prompt(24, 12)  # three whole blocks: compared without a copy
    m = mgr()
    m.get_computed_blocks(p)
    p[5] += 1  # the same list object, the same length, other content
    m.allocate_slots("a", p, 12)
    assert [m.pool.block_hash[b] for b in m.block_table("a")] == fresh.hash_blocks(p, BS)
    for tokens in (tuple(p), p + [7, 7]):  # a tuple; a longer list
        m = mgr()
        m.get_computed_blocks(p)
        m.allocate_slots("b", tokens, len(tokens))
        assert [m.pool.block_hash[b] for b in m.block_table("b")[:3]] == fresh.hash_blocks(p, BS)
        m.check_invariants()


def test_prefix_caching_off_shares_nothing():
    m = mgr(enable_prefix_caching=False)
    p = prompt(22, 9)
    assert admit(m, "a", p) == [0, 1, 2]
    assert m.get_computed_blocks(p) == ([], 0)
    assert admit(m, "b", p) == [3, 4, 5]
    assert m.stats.num_cached_blocks == 0 and m.stats.prefix_query_tokens == 0
    with pytest.raises(ValueError, match="prefix caching is off"):
        m.allocate_slots("c", p, 1, [0])


def test_sha256_manager_shares_like_xxh3():
    for algo in ("xxh3_128", "sha256"):
        m = mgr(hash_algo=algo)
        p = prompt(23, 9)
        admit(m, "a", p)
        assert admit(m, "b", p) == [0, 1, 3]
        assert len(m.pool.block_hash[0]) == (16 if algo == "xxh3_128" else 32)


def test_bad_configuration_and_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, block_size=0)
    with pytest.raises(ValueError, match="sha256"):
        KVCacheManager(4, hash_algo="md5")
    m = mgr()
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots("a", [1], -1)
    m.allocate_slots("a", [1] * 9, 9)
    with pytest.raises(ValueError, match="first allocate_slots"):
        m.allocate_slots("a", [1] * 9, 1, [0])
    with pytest.raises(KeyError):
        m.block_table("zz")
