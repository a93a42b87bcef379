"""Swap preemption (preemption_mode="swap"): the KV manager's swap bookkeeping, the
scheduler on a fake device that carries real block contents through every swap and
copy, and the engine: outputs identical to an unconstrained run, nothing recomputed."""

from __future__ import annotations

import random

import pytest
from model_helpers import two_tenant_prompts
from scheduler_helpers import FakeDevice, fake_step, random_sequences, random_steps

from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.sampling_params import SamplingParams

# --- the KV manager ---------------------------------------------------------------------


def _admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    blocks, _ = kv.get_computed_blocks(tokens)
    table = kv.allocate_slots(rid, tokens, len(tokens) - len(blocks) * kv.block_size, blocks)
    assert table is not None
    return table


def test_swap_out_keeps_shared_blocks_and_copies_the_rest_once():
    kv = KVCacheManager(16, block_size=4, num_host_blocks=4)
    shared = list(range(8))
    a = _admit(kv, "a", shared + [50, 51])  # 2 full blocks + a partial one
    b = _admit(kv, "b", shared + [60])  # shares a's two full blocks (ref 2)
    c = _admit(kv, "c", list(range(100, 110)))  # private: 2 full cached blocks + a partial one
    assert a[:2] == b[:2]
    free = kv.num_free_blocks
    assert kv.swap_out("a")
    # a's shared blocks stay held by it; only its private partial block is copied and freed.
    assert kv.take_swap_ops() == ([(a[2], 0)], [])
    assert kv.num_free_blocks == free + 1 and kv.pool.ref_cnt[a[0]] == 2
    assert kv.swap_out("c")
    out, _ = kv.take_swap_ops()
    assert out == [(c[0], 1), (c[1], 2), (c[2], 3)]
    assert kv.num_free_blocks == free + 4  # c's cached blocks are free (evictable) and still hit-able
    assert kv.stats.num_swapped_requests == 2 and kv.stats.num_used_host_blocks == 4
    kv.check_invariants()
    # c's cached blocks are still on the device: swap-in takes them from there, copies the tail.
    table = kv.swap_in("c", list(range(100, 110)) + [7], 1)
    _, into = kv.take_swap_ops()
    assert table[:2] == c[:2] and into == [(3, table[2])]  # same order; the copy lands in a fresh block
    table_a = kv.swap_in("a", shared + [50, 51, 9], 1)
    assert table_a[:2] == a[:2]
    kv.take_swap_ops()
    kv.check_invariants()
    assert kv.stats.num_swapped_out_blocks == 4 and kv.stats.num_swapped_in_blocks == 2
    for rid in "abc":
        kv.free(rid)
    assert kv.usage == 0.0 and kv.stats.num_used_host_blocks == 0


def test_a_cached_block_swapped_twice_has_one_host_copy():
    kv = KVCacheManager(16, block_size=4, num_host_blocks=8)
    shared = list(range(8))
    _admit(kv, "a", shared + [1])
    _admit(kv, "b", shared + [2])
    assert kv.swap_out("b")  # shared blocks held (a runs)
    assert kv.swap_out("a")  # now a's shared blocks have ref 2 (b holds them): held too
    out, _ = kv.take_swap_ops()
    assert len(out) == 2  # the two partial tails only
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.take_swap_ops()
    # Sequential: c swapped out, evicted, re-admitted by hits from d... the same hash is never copied twice.
    _admit(kv, "c", shared + [3])
    assert kv.swap_out("c")
    _admit(kv, "d", shared + [4])  # hits c's released cached blocks
    assert kv.swap_out("d")
    out, _ = kv.take_swap_ops()
    assert len(out) == 4  # c: 2 full + tail; d: its tail only (its full blocks' hashes have host copies)
    assert kv.stats.num_used_host_blocks == 4
    kv.check_invariants()


def test_swap_out_refuses_when_the_host_pool_is_full_and_changes_nothing():
    kv = KVCacheManager(8, block_size=4, enable_prefix_caching=False, num_host_blocks=1)
    table = _admit(kv, "a", list(range(7)))  # two private blocks, one host slot
    assert not kv.swap_out("a")
    assert kv.block_table("a") == table and kv.take_swap_ops() == ([], [])
    kv.check_invariants()


def test_evicted_cached_blocks_come_back_from_the_host_copy():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=3)
    tokens = list(range(9))
    before = _admit(kv, "a", tokens)  # 2 cached full blocks + 1 partial
    assert kv.swap_out("a")
    kv.take_swap_ops()
    _admit(kv, "b", list(range(200, 216)))  # takes all 4 blocks: a's cached ones are evicted
    assert kv.swap_in("a", tokens + [5], 1) is None  # no room while b runs
    kv.free("b")
    table = kv.swap_in("a", tokens + [5], 1)
    _, into = kv.take_swap_ops()
    assert [slot for slot, _ in into] == [0, 1, 2] and [d for _, d in into] == table[:3]
    assert len(table) == len(before)
    # The restored full blocks are cached again: a new request hits them.
    assert kv.get_computed_blocks(tokens[:8] + [99])[0] == table[:2]
    kv.check_invariants()


def test_freeing_a_swapped_request_returns_its_blocks_and_slots():
    kv = KVCacheManager(8, block_size=4, num_host_blocks=3)
    shared = list(range(8))
    _admit(kv, "a", shared + [1])
    _admit(kv, "b", shared + [2])
    assert kv.swap_out("b")
    assert kv.free("b")  # an abort while swapped
    kv.take_swap_ops()
    kv.check_invariants()
    kv.free("a")
    assert kv.usage == 0.0


# --- the scheduler on a fake device with real contents ------------------------------------


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("host_blocks", [64, 1])  # room for everything; so little that swaps fall back
def test_randomized_swap_run_keeps_every_sequences_kv(caching, host_blocks):
    rng = random.Random(7 + caching + host_blocks)
    kv = KVCacheManager(24, block_size=4, enable_prefix_caching=caching, num_host_blocks=host_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, preemption_mode="swap"), kv)
    dev = FakeDevice(kv)
    pending = random_sequences(rng, 40, num_prefixes=3, prefix_len=(4, 13), suffix_len=(1, 16), max_tokens=(4, 24))
    done = 0
    for out in random_steps(rng, sched, pending, max_steps=3000, max_new=3):
        assert not (out.swap_out and out.swap_in), "a step both swapped out and in"
        dev.step(out)
        done += len(fake_step(sched, out, first_token=2000))
        for seq in sched.running:
            assert kv.num_tokens(seq.seq_id) == seq.num_computed_tokens
        kv.check_invariants()
    assert done == 40 and kv.usage == 0.0 and kv.stats.num_used_host_blocks == 0
    assert sched.num_swap_preemptions > 0
    if host_blocks == 1 and not caching:
        assert sched.num_recompute_preemptions > 0  # the pool refused some swaps
    if host_blocks > 1:
        assert sched.num_recompute_preemptions == 0


# --- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    return two_tenant_prompts(seed=5, n=8, hi=30)


def _prompt_tokens(llm) -> float:
    return llm.engine.metrics.registry.get_sample_value(
        "vllm:prompt_tokens_total", {"model_name": llm.engine.model_name, "engine": "0"}
    )


def _metric(llm, name: str, **labels: str) -> float:
    value = llm.engine.metrics.registry.get_sample_value(
        name, {"model_name": llm.engine.model_name, "engine": "0", **labels}
    )
    assert value is not None, name
    return value


@pytest.mark.parametrize("caching", [False, True])
def test_swap_preemption_gives_unconstrained_outputs_without_recompute(ckpt, prompts, caching):
    from prefixserve.replica.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(max_num_batched_tokens=64, enable_prefix_caching=caching)
    free = LLM(ckpt, num_kv_blocks=128, **common)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    assert free.engine.scheduler.num_preemptions == 0

    recompute = LLM(ckpt, num_kv_blocks=10, **common)
    assert [o.outputs[0].token_ids for o in recompute.generate(prompts, params)] == expected
    assert recompute.engine.scheduler.num_preemptions > 0

    swap = LLM(ckpt, num_kv_blocks=10, preemption_mode="swap", swap_space_gb=2**20 / 2**30, **common)
    outs = swap.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    sched, stats = swap.engine.scheduler, swap.engine.kv_manager.stats
    assert sched.num_swap_preemptions > 0 and sched.num_recompute_preemptions == 0
    # Every block copied out comes back, by a copy or (caching on) from the device's prefix cache.
    assert 0 < stats.num_swapped_in_blocks <= stats.num_swapped_out_blocks
    if not caching:
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks
    # Nothing recomputed: every prompt token not served from the prefix cache was computed once.
    computed_once = sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outs, strict=True))
    assert _prompt_tokens(swap) == computed_once
    assert _prompt_tokens(recompute) > _prompt_tokens(swap)
    if not caching:
        assert _prompt_tokens(swap) == _prompt_tokens(free) == sum(map(len, prompts))
    assert _metric(swap, "prefixserve:preemptions_total", mode="swap") == sched.num_swap_preemptions
    assert _metric(swap, "prefixserve:preemptions_total", mode="recompute") == 0
    assert _metric(swap, "vllm:num_preemptions_total") == sched.num_preemptions
    assert _metric(swap, "prefixserve:swapped_out_blocks_total") == stats.num_swapped_out_blocks
    assert _metric(swap, "prefixserve:swapped_in_blocks_total") == stats.num_swapped_in_blocks
    assert _metric(swap, "vllm:num_requests_swapped") == 0 and _metric(swap, "vllm:cpu_cache_usage_perc") == 0
    swap.engine.kv_manager.check_invariants()


def test_full_swap_pool_falls_back_to_recompute(ckpt, prompts):
    from prefixserve.replica.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(ckpt, num_kv_blocks=128).generate(prompts, params)]
    block_bytes = LLM(ckpt, num_kv_blocks=4).engine.runner.kv_bytes_per_block
    swap = LLM(
        ckpt, num_kv_blocks=10, max_num_batched_tokens=64, preemption_mode="swap", swap_space_gb=block_bytes / 2**30
    )  # one host block
    assert swap.engine.runner.num_host_blocks == 1
    assert [o.outputs[0].token_ids for o in swap.generate(prompts, params)] == expected
    sched = swap.engine.scheduler
    assert sched.num_recompute_preemptions > 0
    assert _metric(swap, "prefixserve:preemptions_total", mode="recompute") == sched.num_recompute_preemptions
