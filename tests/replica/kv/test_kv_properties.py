"""Property tests: random interleavings of admit / append / fork / free / reset.

Beside the manager's own invariants, the machine keeps a shadow KV cache (the
token id each physical slot holds) and plays the model runner: it applies the
copy-on-write copies, then writes every newly slotted token. After each step
every live request must read back exactly its own tokens through its block
table, and every prefix hit must hand out blocks holding the prompt's tokens:
a block shared where it should have been copied, or a stale hit, shows up as
a wrong token.

Requests are freed with and without ``generated_cold``; under ``lru`` and
``slru`` a cold free must leave the request's generated blocks next in the
eviction order.

The machine runs once per eviction policy (``EVICTION_POLICIES``). Between
steps it also checks the eviction contract: a (hash, block) pair leaves the
hash map only when that block was free before the step and has been popped for
reuse in it (so cached blocks are found by hash until evicted, and eviction
never touches a referenced block), and ``num_evictions`` counts exactly those.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kv_helpers import snapshot

from prefixserve.replica.kv.block_pool import EVICTION_POLICIES
from prefixserve.replica.kv.manager import KVCacheManager

# A few shared system prompts, and a tiny vocabulary so that identical blocks
# (and so duplicate hashes) happen often.
PREFIXES = [[], [1, 2, 3, 1, 2, 3, 1], [3, 3, 0, 1, 2, 0, 0, 1, 2, 3, 1]]
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=9)


class KVMachine(RuleBasedStateMachine):
    policy = "lru"  # set per test (see test_kv_manager_random_interleavings)

    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
        algo=st.sampled_from(["xxh3_128", "sha256"]),
    )
    def setup(self, num_blocks, block_size, caching, algo):
        self.m = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=caching, hash_algo=algo, eviction_policy=self.policy
        )
        assert self.m.pool.eviction_policy == self.policy
        # The cache as the last invariant check saw it (the eviction contract compares against it).
        self.prev_map: dict[bytes, int] = {}
        self.prev_ref = [0] * num_blocks
        self.prev_evictions = 0
        self.bs = block_size
        self.shadow: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}  # tokens at admission: blocks past them are generated
        self.next_id = 0

    # --- the model runner ----------------------------------------------------

    def _run_step(self, rid: str, start: int, table: list[int]) -> None:
        for src, dst in self.m.take_copy_ops():
            self.shadow[dst] = list(self.shadow[src])
        toks = self.tokens[rid]
        for p in range(start, self.m.num_tokens(rid)):
            self.shadow[table[p // self.bs]][p % self.bs] = toks[p]

    def _pick(self, idx: int) -> str:
        ids = sorted(self.tokens)
        return ids[idx % len(ids)]

    # --- rules ---------------------------------------------------------------

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), suffix=tokens_st, salt=st.sampled_from([None, "t1"]))
    def admit(self, prefix, suffix, salt):
        toks = PREFIXES[prefix] + suffix
        if not toks:
            return
        before = snapshot(self.m)
        blocks, n = self.m.get_computed_blocks(toks, salt)
        assert snapshot(self.m) == before, "lookup changed state"
        assert n == len(blocks) * self.bs and n < len(toks)
        for i, b in enumerate(blocks):
            assert self.shadow[b] == toks[i * self.bs : (i + 1) * self.bs], "a hit holds other tokens"
        rid = f"r{self.next_id}"
        self.next_id += 1
        table = self.m.allocate_slots(rid, toks, len(toks) - n, blocks, salt)
        if table is None:
            assert self.m.num_blocks_needed(rid, len(toks) - n, blocks) > self.m.num_free_blocks
            assert snapshot(self.m) == before, "a refused allocation changed state"
            return
        self.tokens[rid] = list(toks)
        self.prompt_len[rid] = len(toks)
        self._run_step(rid, n, table)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 1000), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, idx, new):
        rid = self._pick(idx)
        start = self.m.num_tokens(rid)
        before = snapshot(self.m)
        toks = self.tokens[rid] + new
        table = self.m.allocate_slots(rid, toks, len(new))
        if table is None:
            assert snapshot(self.m) == before, "a refused allocation changed state"
            return
        self.tokens[rid] = toks
        self._run_step(rid, start, table)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 1000))
    def fork(self, idx):
        parent = self._pick(idx)
        child = f"r{self.next_id}"
        self.next_id += 1
        assert self.m.fork(parent, child) == self.m.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.prompt_len[child] = self.prompt_len[parent]
        assert self.m.take_copy_ops() == []

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 1000), cold=st.booleans(), static=st.integers(0, 12))
    def free(self, idx, cold, static):
        rid = self._pick(idx)
        table = self.m.block_table(rid)
        assert self.m.free(rid, generated_cold=cold, static_prefix_tokens=static)
        cut = self.prompt_len.pop(rid) // self.bs
        del self.tokens[rid]
        pool = self.m.pool
        if not cold or self.policy not in ("lru", "slru"):
            return
        # The generated blocks that reached 0 now lead the eviction order, tail first: under lru
        # every one, behind the never-cached blocks leading a new pool; under slru the unhit
        # (probation) ones, ahead of every other cached block.
        gen = [b for b in reversed(table[cut:]) if pool.ref_cnt[b] == 0]
        queue = pool.free_queue()
        if self.policy == "lru":
            fresh = pool._num_fresh
            assert queue[fresh : fresh + len(gen)] == gen, "cold blocks are not next after the fresh run"
        else:
            gen = [b for b in gen if pool._where[b] == pool._PROBATION]
            cached = [b for b in queue if pool.block_hash[b] is not None]
            assert cached[: len(gen)] == gen, "cold blocks are not the next cached ones evicted"

    @rule()
    def reset(self):
        in_use = self.m.stats.num_used_blocks > 0
        assert self.m.reset_prefix_cache() is (not in_use)
        if not in_use:
            assert not self.m.pool.hash_to_block and self.m.stats.num_cached_free_blocks == 0
            self.prev_map = {}  # forgotten on purpose, not evicted

    # --- invariants ----------------------------------------------------------

    @invariant()
    def eviction_takes_only_free_blocks(self):
        if not hasattr(self, "m"):
            return
        pool = self.m.pool
        gone = [(h, b) for h, b in self.prev_map.items() if pool.hash_to_block.get(h) != b]
        for h, b in gone:
            assert self.prev_ref[b] == 0, f"block {b} lost its hash while referenced"
            assert pool.ref_cnt[b] > 0 and pool.block_hash[b] != h, f"block {b} lost its hash but was not reused"
        # A free cached block now in use either was hit, or was evicted and refilled with the
        # same content (a fully cached prompt recomputes its last block, and the pool may hand
        # it exactly that block): its hash is back on it, so only a bound is observable.
        refilled = [
            b
            for h, b in self.prev_map.items()
            if pool.hash_to_block.get(h) == b and self.prev_ref[b] == 0 and pool.ref_cnt[b] > 0
        ]
        delta = pool.num_evictions - self.prev_evictions
        assert len(gone) <= delta <= len(gone) + len(refilled), "num_evictions miscounts"
        self.prev_map = dict(pool.hash_to_block)
        self.prev_ref = list(pool.ref_cnt)
        self.prev_evictions = pool.num_evictions

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        m, pool = self.m, self.m.pool
        m.check_invariants()
        holders = [0] * pool.num_blocks
        for rid, toks in self.tokens.items():
            table = m.block_table(rid)
            for b in table:
                holders[b] += 1
            n = m.num_tokens(rid)
            assert n == len(toks)
            got = [self.shadow[table[p // self.bs]][p % self.bs] for p in range(n)]
            assert got == toks, f"{rid} reads back other tokens"
        assert pool.ref_cnt == holders
        queue = pool.free_queue()
        assert all(pool.ref_cnt[b] == 0 for b in queue)
        assert len(queue) == m.num_free_blocks == holders.count(0)
        for h, b in pool.hash_to_block.items():
            assert pool.block_hash[b] == h
        s = m.stats
        assert s.num_used_blocks + s.num_free_blocks == s.num_blocks
        assert s.num_cached_free_blocks == sum(1 for b in queue if pool.block_hash[b] is not None)

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for i, rid in enumerate(list(self.tokens)):
            self.m.free(rid, generated_cold=i % 2 == 1)
        self.m.check_invariants()
        assert self.m.num_free_blocks == self.m.num_blocks
        assert self.m.usage == 0.0 and self.m.stats.num_used_blocks == 0
        assert self.m.reset_prefix_cache()


SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_kv_manager_random_interleavings(policy):
    machine = type(f"KVMachine_{policy}", (KVMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=SETTINGS)
