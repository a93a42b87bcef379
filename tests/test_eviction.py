"""Eviction policies of the block pool: the order each one intends, on tiny pools.

The hypothesis machine (test_kv_properties.py) checks every policy's contract
(nothing referenced is evicted, cached blocks stay found until evicted); these
tests pin what distinguishes the policies: which free block goes first.
"""

from __future__ import annotations

import random

import pytest

from prefixserve.replica.kv import BlockPool, KVCacheManager
from prefixserve.replica.kv.block_pool import EVICTION_POLICIES, LFUBlockPool, SLRUBlockPool

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def admit_free(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit and finish one request; returns its hit tokens."""
    blocks, n = m.get_computed_blocks(tokens)
    assert m.allocate_slots(rid, tokens, len(tokens) - n, blocks) is not None
    m.check_invariants()
    m.free(rid)
    m.check_invariants()
    return n


def test_every_policy_is_built_and_unknown_ones_are_refused():
    for p in EVICTION_POLICIES:
        pool = BlockPool(4, p)
        assert pool.eviction_policy == p and isinstance(pool, BlockPool)
        assert KVCacheManager(4, eviction_policy=p).pool.eviction_policy == p
        assert pool.get_new_blocks(4) == [0, 1, 2, 3]  # a fresh pool hands out ids in order
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        BlockPool(4, "fifo")
    with pytest.raises(ValueError, match="implements 'slru'"):
        SLRUBlockPool(4, "lru")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, "slru")


def test_engine_config_takes_every_policy():
    from prefixserve.replica.config import EngineConfig

    for p in EVICTION_POLICIES:
        assert EngineConfig(eviction_policy=p).eviction_policy == p
    with pytest.raises(ValueError):
        EngineConfig(eviction_policy="fifo")


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_shared_prefix_hit_twice_survives_a_scan_of_one_shot_requests(policy):
    """Two requests share a 2-block system prompt; then 3 one-shot requests of 3 blocks
    each pass through an 8-block pool. LRU evicts the prompt (it is the least recently
    freed); the reuse-aware policies evict the one-shot blocks instead."""
    m = KVCacheManager(8, BS, eviction_policy=policy)
    system = toks(0, 2 * BS)
    assert admit_free(m, "a", system + toks(1, BS)) == 0
    assert admit_free(m, "b", system + toks(2, BS)) == 2 * BS  # the second use: a hit
    for i in range(3):
        assert admit_free(m, f"scan{i}", toks(10 + i, 3 * BS)) == 0
    hit = m.get_computed_blocks(system + toks(3, BS))[1]
    assert hit == (0 if policy == "lru" else 2 * BS)


def test_slru_cold_blocks_go_first_then_probation_then_protected():
    pool = BlockPool(6, "slru")
    blocks = pool.get_new_blocks(6)
    pool.cache_blocks(blocks[:5], [h(i) for i in range(5)])  # block 5 stays uncached
    pool.touch([0, 1])  # a second request shares 0 and 1: hit again
    pool.free_blocks([0, 1])
    pool.free_blocks(blocks[::-1])  # 5 4 3 2 1 0
    # cold (no hash) | probation, least recent first | protected, least recent first
    assert pool.free_queue() == [5, 4, 3, 2, 1, 0]
    pool.check_invariants()
    assert pool.get_new_blocks(2) == [5, 4]
    assert pool.num_evictions == 1  # block 5 had nothing to lose
    assert pool.get_new_blocks(3) == [3, 2, 1]  # probation empty: protected's least recent
    assert pool.get_cached_block(h(0)) == 0


def test_slru_protected_segment_is_bounded_and_demotes_to_probation():
    pool = BlockPool(10, "slru")
    cap = pool.protected_cap
    assert cap == int(SLRUBlockPool.PROTECTED_FRACTION * 10)
    blocks = pool.get_new_blocks(10)
    pool.cache_blocks(blocks, [h(i) for i in range(10)])
    pool.touch(blocks)  # everyone is hit again
    pool.free_blocks(blocks)
    pool.free_blocks(blocks)  # 0 first ... 9 last
    pool.check_invariants()
    # The first 10 - cap freed were demoted: probation's young end, to be evicted first.
    assert pool.free_queue() == list(range(10))
    assert pool._count[pool._PROTECTED] == cap
    assert pool.get_new_blocks(1) == [0] and pool.get_cached_block(h(0)) is None


def test_slru_ghost_promotes_a_prefix_recomputed_soon_after_its_eviction():
    pool = BlockPool(4, "slru")
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)])
    pool.free_blocks(a)
    b = pool.get_new_blocks(4)  # evicts h(0), h(1): the ghost remembers them
    assert pool.num_evictions == 2 and pool.get_cached_block(h(0)) is None
    pool.cache_blocks(b, [h(1), h(7), h(8), h(9)])  # block b[0] recomputes h(1): a ghost hit
    pool.free_blocks(b)  # b[0] freed first, yet it is protected
    pool.check_invariants()
    assert pool.free_queue()[-1] == b[0]
    assert pool.free_queue()[:3] == b[1:]


def test_lfu_keeps_frequently_hit_blocks_longer_but_ages_them_out():
    """A block hit 3 times outlives one-shot blocks, for a bounded number of floor steps."""

    def pops_until_evicted(policy: str) -> int:
        pool = BlockPool(4, policy)
        blocks = pool.get_new_blocks(4)
        pool.cache_blocks(blocks, [h(i) for i in range(4)])
        pool.touch([0, 0, 0])  # three more uses of block 0
        pool.free_blocks([0, 0, 0, 0])
        pool.free_blocks([1, 2, 3])
        for n in range(1, 200):
            (b,) = pool.get_new_blocks(1)
            pool.check_invariants()
            if pool.get_cached_block(h(0)) is None:
                return n
            pool.cache_block(b, h(100 + n))  # a one-shot block, freed straight away
            pool.free_blocks([b])
        raise AssertionError("block 0 was never evicted")

    lru, lfu = pops_until_evicted("lru"), pops_until_evicted("lfu")
    assert lru == 1  # least recently freed
    assert lfu > 3 * lru  # it survived several one-shot generations
    assert lfu <= 3 * (LFUBlockPool.LFU_MAX_FREQ + 1)  # aging: at most LFU_MAX_FREQ floor steps of 3 blocks


def test_s3fifo_moves_a_hit_small_block_to_main_and_evicts_unhit_ones():
    pool = BlockPool(4, "s3fifo")
    blocks = pool.get_new_blocks(4)
    pool.cache_blocks(blocks, [h(i) for i in range(4)])
    pool.touch([0])  # a second request uses block 0
    pool.free_blocks([0, 0])
    pool.free_blocks([1, 2, 3])  # small: 0 1 2 3, block 0 hit
    assert pool.get_new_blocks(1) == [1]  # 0 earned main on the way; 1 is small's oldest unhit block
    assert pool._main[0] and pool.get_cached_block(h(0)) == 0
    pool.check_invariants()
    assert pool.get_new_blocks(2) == [2, 3]  # small first while it holds >= its share
    assert pool.get_new_blocks(1) == [0]  # then main (its hit was spent on the move)
    pool.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_reset_forgets_hashes_and_hits(policy):
    pool = BlockPool(4, policy)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks, [h(i) for i in range(3)])
    pool.touch(blocks)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    pool.free_blocks(blocks)
    pool.free_blocks(pool.get_new_blocks(2))  # evicts a cached block (remembered by a ghost list)
    assert pool.num_evictions == 1 and pool.num_free == 4 and pool.reset_prefix_cache()
    pool.check_invariants()
    assert not pool.hash_to_block and pool.num_cached_free == 0
    assert sorted(pool.get_new_blocks(4)) == [0, 1, 2, 3] and pool.num_evictions == 1


def zipf_hit_rate(policy: str, seed: int = 0) -> float:
    """Hit rate of one memory-bound cache on Zipf tenants with one-shot questions and answers."""
    rng = random.Random(seed)
    tenants = 60
    weights = [1 / (t + 1) ** 0.8 for t in range(tenants)]
    systems = [toks(1000 + t, 8 * BS) for t in range(tenants)]
    m = KVCacheManager(120, BS, eviction_policy=policy)  # ~1/4 of the system prompts fit
    for i in range(1500):
        t = rng.choices(range(tenants), weights)[0]
        p = systems[t] + toks(rng.random(), 2 * BS)
        blocks, n = m.get_computed_blocks(p)
        assert m.allocate_slots(str(i), p, len(p) - n, blocks) is not None
        out = p + toks(rng.random(), 3 * BS)  # the answer's blocks get cached too
        assert m.allocate_slots(str(i), out, 3 * BS) is not None
        m.free(str(i))
    m.check_invariants()
    return m.stats.hit_rate


def test_reuse_aware_policies_beat_lru_on_a_memory_bound_zipf_workload():
    rates = {p: zipf_hit_rate(p) for p in EVICTION_POLICIES}
    assert rates["slru"] > 1.1 * rates["lru"], rates
    assert rates["s3fifo"] > 1.1 * rates["lru"], rates
    assert rates["lfu"] > rates["lru"], rates
