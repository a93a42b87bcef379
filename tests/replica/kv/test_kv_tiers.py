"""The host-memory KV tier: the KV manager's bookkeeping (evicted blocks offloaded, lookups
continued into the host tier, the per-step load bound, one pool with swap), a scheduler
run on a fake device that carries real block contents through every copy, and the
engine: greedy tokens identical with the tier on and off, the tier serving hits."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scheduler_helpers import FakeDevice, fake_step, random_sequences, random_steps

from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.kv.tiers import TIER_BLOCK
from prefixserve.replica.sampling_params import SamplingParams

# --- the KV manager ---------------------------------------------------------------------


def _admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    blocks, hit = kv.get_computed_blocks(tokens)
    table = kv.allocate_slots(rid, tokens, len(tokens) - hit, blocks)
    assert table is not None
    return table, hit


def _churn(kv: KVCacheManager, first: list[int], other: list[int]) -> None:
    """Compute ``first``, free it, then ``other`` (which evicts ``first``'s blocks), free it."""
    _admit(kv, "a", first)
    kv.take_swap_ops()
    kv.free("a")
    _admit(kv, "b", other)
    kv.free("b")


A = list(range(100, 113))  # 3 full blocks of 4 + 1 token
B = list(range(200, 213))


def test_evicted_blocks_are_offloaded_and_come_back_from_the_host_tier():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8, host_tier=True)
    _churn(kv, A, B)
    out, into = kv.take_swap_ops()
    assert len(out) == 3 and not into  # A's three hashed blocks, copied before B overwrites them
    blocks, hit = kv.get_computed_blocks(A)
    assert blocks.count(TIER_BLOCK) == 3 and hit == 12
    table, _ = _admit(kv, "a2", A)
    out, into = kv.take_swap_ops()
    # The copy-back fills fresh device blocks from the slots A's blocks went to; B's blocks,
    # evicted for them, go to the host tier in the same step (copied out first).
    assert sorted(dst for _, dst in into) == sorted(table[:3])
    assert len(out) == 3
    st = kv.stats.tiers
    assert st.host_hit_tokens == 12 and st.host_loaded_blocks == 3 and st.host_offloaded_blocks == 6
    assert kv.stats.prefix_hit_tokens == 0  # the device pool's own counter (vLLM's local hits)
    kv.check_invariants()


def test_without_the_host_tier_evicted_blocks_are_gone():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8)
    _churn(kv, A, B)
    assert kv.take_swap_ops() == ([], [])
    assert kv.get_computed_blocks(A) == ([], 0)


def test_copy_back_is_bounded_per_step():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8, host_tier=True, max_load_blocks_per_step=2)
    _churn(kv, A, B)
    kv.take_swap_ops()
    blocks, hit = kv.get_computed_blocks(A)
    assert blocks == [TIER_BLOCK, TIER_BLOCK] and hit == 8  # the third block is computed
    _admit(kv, "a2", A)
    assert kv.get_computed_blocks(B)[0].count(TIER_BLOCK) == 0  # this step's budget is spent
    kv.take_swap_ops()
    assert kv.get_computed_blocks(B)[0].count(TIER_BLOCK) > 0  # the next step's is not
    kv.check_invariants()


def test_a_hash_has_one_host_copy():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8, host_tier=True)
    _churn(kv, A, B)
    kv.take_swap_ops()
    _admit(kv, "a2", A)  # A comes back from the host tier; its host copies stay
    kv.take_swap_ops()
    kv.free("a2")
    _admit(kv, "b2", B)  # evicts A again: its hashes have host copies, so nothing is copied for them
    out, _ = kv.take_swap_ops()
    assert kv.stats.tiers.num_host_cached_blocks == 6
    assert all(kv.pool.block_hash[b] is None for b, _ in out)
    kv.check_invariants()


def test_swap_and_the_tier_share_one_host_pool():
    kv = KVCacheManager(8, block_size=4, num_host_blocks=3, host_tier=True)
    _churn(kv, A, list(range(300, 332)))  # 8 blocks: A's three hashed blocks go to the tier
    kv.take_swap_ops()
    assert kv.stats.tiers.num_host_cached_blocks == 3
    _admit(kv, "c", list(range(400, 409)))  # evicts three of b's blocks: they replace A's copies
    kv.take_swap_ops()
    assert kv.stats.tiers.host_evicted_blocks == 3 and kv.stats.tiers.num_host_cached_blocks == 3
    # Swapping c out needs 3 slots: every slot holds a tier copy, and the swap takes them.
    assert kv.swap_out("c")
    st = kv.stats
    assert st.num_used_host_blocks == 3 and st.tiers.num_host_cached_blocks == 0
    assert st.tiers.host_evicted_blocks == 6
    kv.take_swap_ops()
    kv.check_invariants()
    # With every slot swapped, an evicted block is dropped (the tier never evicts a swapped block).
    _admit(kv, "d", list(range(500, 532)))
    assert kv.stats.tiers.host_dropped_blocks > 0
    kv.take_swap_ops()
    kv.check_invariants()


def test_reset_prefix_cache_forgets_the_host_tier_too():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8, host_tier=True)
    _churn(kv, A, B)
    kv.take_swap_ops()
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(A) == ([], 0) and kv.stats.tiers.num_host_cached_blocks == 0
    kv.check_invariants()


def test_sliding_window_hits_come_back_from_the_host_tier():
    kv = KVCacheManager(4, block_size=4, num_host_blocks=8, host_tier=True, sliding_window=6)
    _churn(kv, A, B)
    kv.take_swap_ops()
    blocks, hit = kv.get_computed_blocks(A)
    # The window of the first uncomputed token needs the last two blocks of the hit only.
    assert hit == 12 and blocks[0] == -1 and blocks[1:] == [TIER_BLOCK, TIER_BLOCK]
    _admit(kv, "a2", A)
    kv.take_swap_ops()
    kv.check_invariants()


# --- the scheduler on a fake device with real contents ------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("host_blocks", [48, 2])  # room for much; so little that slots churn
@pytest.mark.parametrize("budget", [512, 1])
def test_randomized_tier_run_keeps_every_sequences_kv(mode, host_blocks, budget):
    rng = random.Random(host_blocks * 7 + budget + len(mode))
    kv = KVCacheManager(16, block_size=4, num_host_blocks=host_blocks, host_tier=True, max_load_blocks_per_step=budget)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=20, preemption_mode=mode), kv)
    dev = FakeDevice(kv)
    pending = random_sequences(rng, 60, num_prefixes=6, prefix_len=(8, 25), suffix_len=(1, 8), max_tokens=(2, 10))
    done = 0
    for out in random_steps(rng, sched, pending, max_steps=4000, max_new=2):
        kv.take_tier_ops()
        dev.step(out)
        done += len(fake_step(sched, out, first_token=2000))
        kv.check_invariants()
    assert done == 60 and kv.usage == 0.0
    assert kv.stats.tiers.host_hit_tokens > 0


# --- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def turns():
    """Two rounds over six 70-token prompts: together they need 4x the 16-block device pool,
    so the second round's prefixes were evicted from the device."""
    rng = np.random.default_rng(9)
    first = [[int(t) for t in rng.integers(17, 40000, 70)] for _ in range(6)]
    return [first, [p + [int(t) for t in rng.integers(17, 40000, 9)] for p in first]]


def _generate(llm, turns, params):
    out = []
    for batch in turns:
        out += llm.generate(batch, params)
    return out


PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HOST_GB = 2**22 / 2**30  # 4 MiB: a few hundred of the tiny model's blocks


def _reference(ckpt, turns, **knobs):
    from prefixserve.replica.entrypoints.llm import LLM

    return [o.outputs[0].token_ids for o in _generate(LLM(ckpt, num_kv_blocks=400, **knobs), turns, PARAMS)]


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"max_num_batched_tokens": 32},  # chunked prefill
        {"preemption_mode": "swap", "swap_space_gb": 2**20 / 2**30, "max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 64},  # recompute preemption
        {"kv_cache_dtype": "fp8"},
    ],
    ids=["plain", "chunked", "swap", "recompute", "fp8"],
)
def test_greedy_tokens_are_identical_with_the_host_tier(ckpt, turns, knobs):
    from prefixserve.replica.entrypoints.llm import LLM

    expected = _reference(ckpt, turns, **{k: v for k, v in knobs.items() if k == "kv_cache_dtype"})
    off = LLM(ckpt, num_kv_blocks=16, **knobs)
    assert [o.outputs[0].token_ids for o in _generate(off, turns, PARAMS)] == expected
    on = LLM(ckpt, num_kv_blocks=16, kv_offloading_size=HOST_GB, **knobs)
    outs = _generate(on, turns, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = on.engine.kv_manager.stats.tiers
    assert st.host_hit_tokens > 0 and st.host_offloaded_blocks > 0
    assert sum(o.num_cached_tokens for o in outs[6:]) >= st.host_hit_tokens // 2  # cached_tokens counts them
    if "swap" in knobs.get("preemption_mode", ""):
        assert on.engine.scheduler.num_swap_preemptions > 0
    if knobs.get("max_num_batched_tokens") == 64 and "preemption_mode" not in knobs:
        assert on.engine.scheduler.num_preemptions > 0
    on.engine.kv_manager.check_invariants()
    reg = on.engine.metrics.registry
    labels = {"model_name": on.engine.model_name, "engine": "0"}
    assert reg.get_sample_value("vllm:external_prefix_cache_hits_total", labels) == st.host_hit_tokens
    assert reg.get_sample_value("prefixserve:kv_tier_hit_tokens_total", {**labels, "tier": "host"}) > 0
    assert reg.get_sample_value("prefixserve:kv_tier_copy_bytes_total", {**labels, "op": "copy_back"}) > 0


def test_sliding_window_model_with_the_host_tier(ckpt, turns):
    from prefixserve.replica.entrypoints.llm import LLM

    expected = _reference(ckpt, turns, sliding_window=24)
    on = LLM(ckpt, num_kv_blocks=16, sliding_window=24, kv_offloading_size=HOST_GB)
    assert [o.outputs[0].token_ids for o in _generate(on, turns, PARAMS)] == expected
    assert on.engine.kv_manager.stats.tiers.host_hit_tokens > 0


def test_a_host_tier_smaller_than_one_block_is_refused(ckpt):
    from prefixserve.replica.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="kv_offloading_size=.* holds no KV block"):
        LLM(ckpt, num_kv_blocks=16, kv_offloading_size=100 / 2**30)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"kv_offloading_backend": "native"}, "kv_offloading_size is not"),
        ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "kv_offloading_backend must be one of"),
        ({"kv_offloading_size": 0.0}, "kv_offloading_size must be > 0"),
        ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
        ({"kv_disk_path": "/tmp/x"}, "kv_disk_path needs the host tier"),
        ({"kv_disk_path": "/tmp/x", "kv_offloading_size": 1.0, "kv_disk_size_gb": 0}, "kv_disk_size_gb must be > 0"),
        ({"kv_load_max_blocks_per_step": 0}, "kv_load_max_blocks_per_step must be >= 1"),
    ],
)
def test_tier_knobs_are_validated(knobs, message):
    from prefixserve.replica.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**knobs)


def test_tier_knobs_have_cli_flags():
    import argparse

    from prefixserve.replica.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        ["--kv-offloading-size", "2", "--kv-offloading-backend", "native", "--kv-disk-path", "/tmp/kv"]
    )
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.kv_offloading_size, cfg.kv_offloading_backend, cfg.kv_disk_path) == (2.0, "native", "/tmp/kv")
    assert EngineConfig(kv_offloading_size=1.0).kv_offloading_backend == "native"


def test_tensor_parallel_ranks_each_keep_their_shard_in_the_host_tier(ckpt, turns):
    from prefixserve.replica.entrypoints.llm import LLM

    expected = _reference(ckpt, turns)
    with LLM(ckpt, num_kv_blocks=16, kv_offloading_size=2 * HOST_GB, tensor_parallel_size=2) as two:
        assert [o.outputs[0].token_ids for o in _generate(two, turns, PARAMS)] == expected
        st = two.engine.kv_manager.stats.tiers
        # Each rank's pool holds kv_offloading_size / 2 of its own (half-size) blocks.
        assert two.engine.runner.num_host_blocks == int(HOST_GB * 1024**3 // two.engine.runner.kv_bytes_per_block)
    assert st.host_hit_tokens > 0 and st.host_offloaded_blocks > 0
