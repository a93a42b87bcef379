"""Eviction policies of the block pool: the order each one intends, on tiny pools.

The hypothesis machine (test_kv_properties.py) checks every policy's contract
(nothing referenced is evicted, cached blocks stay found until evicted); these
tests pin what distinguishes the policies: which free block goes first.
"""

from __future__ import annotations

import random

import pytest

from prefixserve.replica.kv.block_pool import EVICTION_POLICIES, BlockPool, LFUBlockPool, SLRUBlockPool, _MultiListPool
from prefixserve.replica.kv.manager import KVCacheManager

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


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_cache_blocks_counts_the_pairs_registered(policy):
    pool = BlockPool(4, policy)
    b = pool.get_new_blocks(4)
    assert pool.cache_blocks(b[:2], [h(0), h(1)]) == 2
    # b[0] again with its own hash counts; b[2] duplicates h(1) (it stays uncached); b[3] is new.
    assert pool.cache_blocks(b, [h(0), h(1), h(1), h(3)]) == 3
    assert pool.block_hash == [h(0), h(1), None, h(3)]
    assert pool.cache_blocks(b[:1], []) == 0
    pool.check_invariants()


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


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_only_slru_keeps_a_block_marked_reused_over_unmarked_ones(policy):
    """Blocks 0 1 are marked reused, 2 3 not; all are freed together, 0 first. slru then evicts
    the unmarked ones first; the other policies ignore the hint and keep their order."""
    pool = BlockPool(4, policy)
    blocks = pool.get_new_blocks(4)
    pool.cache_blocks(blocks, [h(i) for i in range(4)])
    pool.mark_reused([0, 1])
    pool.free_blocks(blocks)
    pool.check_invariants()
    assert pool.get_new_blocks(2) == ([2, 3] if policy == "slru" else [0, 1])
    assert (pool.get_cached_block(h(0)) is None) is (policy != "slru")


def test_mark_reused_skips_free_and_uncached_blocks():
    pool = BlockPool(4, "slru")
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks[:1], [h(0)])
    pool.free_blocks(blocks[:1])
    pool.mark_reused(blocks)  # 0 is free; 1 and 2 carry no hash: none is marked
    assert pool._hits[:3] == [0, 0, 0]
    pool.free_blocks(blocks[1:])
    pool.check_invariants()
    assert pool._count[pool._PROTECTED] == 0


def test_free_with_a_static_prefix_protects_its_full_blocks_on_first_sight():
    """A 2-block system prompt seen once, then younger one-shot blocks: a scan evicts the
    one-shot blocks and keeps the prompt when free() named it, not when it did not."""
    for static, kept in ((2 * BS + 1, True), (0, False)):
        m = KVCacheManager(8, BS, eviction_policy="slru")
        system = toks(0, 2 * BS)
        prompt = system + toks(1, BS)
        blocks, n = m.get_computed_blocks(prompt)
        assert m.allocate_slots("a", prompt, len(prompt) - n, blocks) is not None
        assert m.free("a", static_prefix_tokens=static)  # 2 full blocks (the third token past them is not)
        m.check_invariants()
        assert admit_free(m, "b", toks(2, 3 * BS)) == 0  # younger one-shot blocks
        assert admit_free(m, "scan", toks(3, 4 * BS)) == 0  # needs 4 of the 6 cached blocks
        assert (m.get_computed_blocks(system + toks(4, BS))[1] == 2 * BS) is kept


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


def zipf_hit_rate(policy: str, seed: int = 0, generated_cold: bool = False) -> float:
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
        m.free(str(i), generated_cold=generated_cold)
    m.check_invariants()
    return m.stats.hit_rate


def test_reuse_aware_policies_beat_lru_on_a_memory_bound_zipf_workload():
    rates = {p: zipf_hit_rate(p) for p in EVICTION_POLICIES}
    assert rates["slru"] > 1.1 * rates["lru"], rates
    assert rates["s3fifo"] > 1.1 * rates["lru"], rates
    assert rates["lfu"] > rates["lru"], rates


# --- generated blocks at the cold end (KVCacheManager.free(generated_cold=True)) ------------


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_free_blocks_cold_puts_unhit_blocks_at_the_evicted_end_first_given_first(policy):
    pool = BlockPool(8, policy)
    blocks = pool.get_new_blocks(8)
    pool.cache_blocks(blocks, [h(i) for i in range(8)])
    pool.free_blocks(blocks[:4])  # warm: evicted after the cold ones below, though freed earlier
    pool.free_blocks_cold([7, 6])  # a request's generated blocks, tail first
    pool.free_blocks(blocks[4:6])
    pool.check_invariants()
    assert pool.num_free == 8 and pool.num_cached_free == 8
    assert pool.get_new_blocks(2) == [7, 6]
    assert pool.get_cached_block(h(0)) == 0 and pool.get_cached_block(h(4)) == 4


@pytest.mark.parametrize("policy", ["slru", "lfu", "s3fifo"])
def test_free_blocks_cold_leaves_a_block_hit_during_its_use_where_free_blocks_puts_it(policy):
    pool = BlockPool(6, policy)
    blocks = pool.get_new_blocks(6)
    pool.cache_blocks(blocks, [h(i) for i in range(6)])
    pool.touch([5])  # another request shares block 5: hit again
    pool.free_blocks([5])
    pool.free_blocks(blocks[:4])
    pool.free_blocks_cold([5, 4])  # 5 was hit: not moved; 4 was not: evicted first
    pool.check_invariants()
    assert pool.get_new_blocks(1) == [4]
    assert pool.get_new_blocks(4) == [0, 1, 2, 3]  # 5 outlives the unhit blocks
    assert pool.get_cached_block(h(5)) == 5


def test_free_blocks_cold_with_a_block_still_shared_moves_only_what_reached_zero():
    for policy in EVICTION_POLICIES:
        pool = BlockPool(4, policy)
        blocks = pool.get_new_blocks(4)
        pool.cache_blocks(blocks, [h(i) for i in range(4)])
        pool.touch([3])  # a fork still holds block 3
        pool.free_blocks_cold([3, 2])
        assert pool.ref_cnt[3] == 1 and pool.num_free == 1
        pool.free_blocks([1, 0])
        pool.check_invariants()
        assert pool.get_new_blocks(1) == [2], policy


@pytest.mark.parametrize(("policy", "swap"), [(p, False) for p in EVICTION_POLICIES] + [("lru", True)])
def test_generated_cold_evicts_a_one_shot_answer_before_an_older_prompt(policy, swap):
    """Request "old" (3 prompt blocks) finishes; then "new" (2 prompt blocks, 2 generated).
    A 3-block allocation evicts old's prompt when new's answer enters warm, and new's
    answer (plus the never-used block) when it enters cold; new's prompt survives both.
    (With swap only under lru: the other policies count swap-in's re-use of the still
    cached blocks as a hit, and a hit block is never sent cold.)"""

    def old_prompt_hit(generated_cold: bool) -> tuple[int, int]:
        m = KVCacheManager(8, BS, eviction_policy=policy, num_host_blocks=8 if swap else 0)
        old = toks(1, 3 * BS)
        assert admit_free(m, "old", old) == 0
        new_prompt, answer = toks(2, 2 * BS), toks(3, 2 * BS)
        assert m.allocate_slots("new", new_prompt, 2 * BS) is not None
        assert m.allocate_slots("new", new_prompt + answer, 2 * BS) is not None  # the answer's blocks get cached
        if swap:  # a swap round trip keeps the prompt length
            assert m.swap_out("new")
            m.take_swap_ops()
            assert m.swap_in("new", new_prompt + answer, 0) is not None
        assert m.free("new", generated_cold=generated_cold)
        m.check_invariants()
        assert admit_free(m, "x", toks(4, 3 * BS)) == 0
        return m.get_computed_blocks(old + [0])[1], m.get_computed_blocks(new_prompt + [0])[1]

    assert old_prompt_hit(generated_cold=False) == (BS, 2 * BS)  # old lost its last 2 blocks
    assert old_prompt_hit(generated_cold=True) == (3 * BS, 2 * BS)


def test_generated_cold_on_a_partial_prompt_block_takes_the_block_holding_the_prompt_end():
    m = KVCacheManager(6, BS, eviction_policy="lru")
    prompt = toks(5, 2 * BS + 2)  # blocks 0, 1 full; block 2 holds 2 prompt tokens + 2 generated
    assert m.allocate_slots("r", prompt, len(prompt)) is not None
    assert m.allocate_slots("r", prompt + toks(6, 2 + BS), 2 + BS) is not None  # 4 blocks
    table = m.block_table("r")
    assert table == [0, 1, 2, 3]
    m.free("r", generated_cold=True)
    m.check_invariants()
    # The never-used blocks 4 and 5 still go first (popping them loses nothing), then the
    # generated tail, tail first; the prompt joins the tail as free() always leaves it.
    assert m.pool.free_queue() == [4, 5, 3, 2, 1, 0]
    assert m.pool.get_new_blocks(3) == [4, 5, 3] and m.pool.num_evictions == 1


def test_lru_cold_blocks_go_behind_the_never_used_blocks_of_a_new_or_reset_pool():
    pool = BlockPool(6, "lru")
    a = pool.get_new_blocks(2)  # 0, 1; the fresh run is 2..5
    pool.cache_blocks(a, [h(0), h(1)])
    pool.free_blocks_cold(a[::-1])
    pool.check_invariants()
    assert pool.free_queue() == [2, 3, 4, 5, 1, 0]
    b = pool.get_new_blocks(5)  # the fresh run is used up: cold blocks now go to the very head
    assert b == [2, 3, 4, 5, 1] and pool.num_evictions == 1
    pool.cache_blocks(b[:2], [h(2), h(3)])
    pool.free_blocks(b[2:])
    pool.free_blocks_cold(b[:2])
    pool.check_invariants()
    assert pool.free_queue() == [2, 3, 0, 4, 5, 1]
    pool.free_blocks(pool.get_new_blocks(6))
    assert pool.reset_prefix_cache()  # every block uncached: the whole queue is the fresh run again
    c = pool.get_new_blocks(1)
    pool.cache_blocks(c, [h(9)])
    pool.free_blocks_cold(c)
    pool.check_invariants()
    assert pool.free_queue()[-1] == c[0]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_generated_cold_raises_the_zipf_hit_rate(policy):
    """The one-shot answers of the zipf workload above hold no future hits: sent to the
    cold end they leave room for system prompts (the simulator shows the same)."""
    warm = sum(zipf_hit_rate(policy, seed) for seed in range(3))
    cold = sum(zipf_hit_rate(policy, seed, generated_cold=True) for seed in range(3))
    assert cold > warm, (warm, cold)


# --- slru pops runs -------------------------------------------------------------------------


class _OneBlockAtATimeSLRU(SLRUBlockPool):
    """slru with the generic pop loop (one ``_victim`` per block) and a free that links each block
    with the list primitives: the reference for the run pops and the batched free."""

    get_new_blocks = _MultiListPool.get_new_blocks

    def free_blocks(self, blocks):
        for b in blocks:
            if self.ref_cnt[b] == 0:
                raise ValueError(f"block {b} freed more often than it was allocated")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b]:
                continue
            self.num_free += 1
            if self.block_hash[b] is None:
                self._push_tail(self._COLD, b)
                continue
            self.num_cached_free += 1
            self._push_tail(self._PROTECTED if self._hits[b] else self._PROBATION, b)
            if self._count[self._PROTECTED] > self.protected_cap:
                d = self._head(self._PROTECTED)
                self._unlink(d)
                self._hits[d] = 0
                self._push_tail(self._PROBATION, d)


def _pool_state(pool: SLRUBlockPool) -> tuple:
    return (
        pool.free_queue(),
        dict(pool.hash_to_block),
        list(pool.block_hash),
        list(pool.ref_cnt),
        list(pool._hits),
        dict(pool._ghost),
        list(pool._ghost_ring),
        pool._ghost_pos,
        pool.num_evictions,
        pool.num_free,
        pool.num_cached_free,
        list(pool._count),
    )


@pytest.mark.parametrize("seed", range(40))
def test_slru_run_pops_and_batched_frees_equal_one_block_at_a_time(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    fast, ref = SLRUBlockPool(n), _OneBlockAtATimeSLRU(n)
    held: list[int] = []  # one entry per reference a test "request" holds
    # The ghost list as specified: the hashes of the last n evictions, less those registered since.
    evictions: list[list] = []  # [hash, still a ghost]
    for _ in range(80):
        op = rng.choice(["alloc", "alloc", "cache", "touch", "free", "free_cold"])
        if op == "alloc" and fast.num_free:
            k = rng.randint(1, fast.num_free)
            old_hash = list(fast.block_hash)
            got = fast.get_new_blocks(k)
            assert got == ref.get_new_blocks(k)
            held += got
            evictions += [[old_hash[b], True] for b in got if old_hash[b] is not None]
        elif op == "cache" and any(fast.block_hash[b] is None for b in held):
            fresh = sorted({b for b in held if fast.block_hash[b] is None})
            bs = rng.sample(fresh, rng.randint(1, len(fresh)))
            hs = [h(rng.randrange(3 * n)) for _ in bs]
            assert fast.cache_blocks(bs, hs) == ref.cache_blocks(bs, hs)
            for e in evictions:
                e[1] = e[1] and not any(fast.block_hash[b] == e[0] for b in bs)
        elif op == "touch" and fast.hash_to_block:
            bs = rng.sample(sorted(fast.hash_to_block.values()), 1)
            fast.touch(bs)
            ref.touch(bs)
            held += bs
        elif op in ("free", "free_cold") and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            # a request holds a block at most once
            batch = list(dict.fromkeys(held[:k]))
            for b in batch:
                held.remove(b)
            getattr(fast, op + "_blocks" if op == "free" else "free_blocks_cold")(batch)
            getattr(ref, op + "_blocks" if op == "free" else "free_blocks_cold")(batch)
        fast.check_invariants()
        assert _pool_state(fast) == _pool_state(ref)
        assert set(fast._ghost) == {e[0] for e in evictions[-n:] if e[1]}


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_simulator_generated_blocks_cold_raises_the_hit_rate(policy):
    """simulate.py --generated-blocks cold: every simulated request is a one-shot, so every
    answer goes cold; the replicas' caches keep more system prompts (docs/benchmarks/eviction.md)."""
    from prefixserve.loadtest import simulate as sim

    def hit_rate(generated: str) -> float:
        # The static prefix plain: protecting it hides this effect on so small a run.
        cfg = sim.SimConfig(
            num_replicas=4,
            num_tenants=60,
            num_requests=1500,
            blocks_per_replica=128,
            eviction_policy=policy,
            generated_blocks=generated,
            protect_static_prefix=False,
            profile="seed-article",
        )
        r = sim.simulate(cfg, "consistent_hash", check_invariants=True)
        assert r.oracle_violations == 0 and r.finished == cfg.num_requests
        return r.hit_rate

    assert hit_rate("cold") > hit_rate("warm")
    with pytest.raises(ValueError, match="generated_blocks"):
        sim.SimConfig(generated_blocks="tepid")


def test_simulator_protected_static_prefix_raises_the_affinity_hit_rate():
    """simulate.py --static-prefix protected (the engine's default, slru): a tenant's system
    prompt outlives other tenants' one-shot questions on its replica between its requests."""
    from prefixserve.loadtest import simulate as sim

    def run(protect: bool) -> sim.PolicyResult:
        cfg = sim.SimConfig(
            num_replicas=4,
            num_tenants=60,
            num_requests=1500,
            blocks_per_replica=256,
            eviction_policy="slru",
            protect_static_prefix=protect,
            profile="seed-article",
        )
        r = sim.simulate(cfg, "consistent_hash", check_invariants=True)
        assert r.oracle_violations == 0 and r.finished == cfg.num_requests
        return r

    plain, protected = run(False), run(True)
    assert protected.hit_rate > plain.hit_rate
    assert protected.evicted_miss_tokens < plain.evicted_miss_tokens
