"""A drain writes the replica's hot cached blocks to the shared disk tier before the engine stops.

Engine A (an AsyncEngine with a disk directory) serves prompts; the files its write-behind
wrote are then deleted, as a sibling replica's size bound would; A is drained (the shutdown
the Serve deployment's drain and the standalone server's SIGTERM make). Engine B on the same
directory then serves the prompts from A's saved blocks. A save bound of zero writes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from model_helpers import four_block_prompts

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.kv.disk_tier import SUFFIX
from prefixserve.replica.sampling_params import SamplingParams

HOST_GB = 2**22 / 2**30
KNOBS = dict(num_kv_blocks=16, kv_offloading_size=HOST_GB, kv_disk_size_gb=0.05)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return four_block_prompts(23)


async def _serve_then_drain(ckpt: str, disk: str, prompts: list[list[int]], bound_s: float) -> float:
    """A serves ``prompts``, loses its files, is drained; the blocks its drain saved (the metric)."""
    engine = AsyncEngine(EngineConfig(model=ckpt, kv_disk_path=disk, kv_drain_save_timeout_s=bound_s, **KNOBS))
    try:
        for i, p in enumerate(prompts):
            async for _ in engine.generate(p, PARAMS, request_id=f"a{i}"):
                pass
        tiers = engine.engine.tiers
        assert tiers is not None and tiers.disk is not None and tiers.disk.flush()
        files = list(Path(tiers.disk.path).glob("*" + SUFFIX))
        assert len(files) >= 12  # write-behind stored every full prompt block
        for f in files:  # a sibling replica's size bound deleted them
            f.unlink()
    finally:
        await engine.shutdown(save_hot_blocks=True)
    saved = engine.engine.metrics.registry.get_sample_value(
        "prefixserve:kv_drain_saved_blocks_total", {"model_name": engine.engine.model_name, "engine": "0"}
    )
    assert saved is not None
    return saved


async def test_a_drained_engine_saves_its_hot_blocks_and_a_second_engine_serves_them(ckpt, prompts, tmp_path, caplog):
    expected = [o.outputs[0].token_ids for o in LLM(ckpt, num_kv_blocks=64).generate(prompts, PARAMS)]
    disk = str(tmp_path / "kv")
    with caplog.at_level(logging.INFO, logger="prefixserve.replica.engine.tiers"):
        saved = await _serve_then_drain(ckpt, disk, prompts, bound_s=60.0)
    assert saved == 12  # 4 full blocks of each 70-token prompt (16 tokens a block)
    assert any("drain: saved 12 KV blocks" in r.getMessage() for r in caplog.records)
    second = LLM(ckpt, kv_disk_path=disk, **KNOBS)
    outs = second.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [64, 64, 64]


async def test_a_save_bound_of_zero_writes_nothing(ckpt, prompts, tmp_path):
    disk = tmp_path / "kv"
    assert await _serve_then_drain(ckpt, str(disk), prompts, bound_s=0.0) == 0
    assert not list(disk.glob("*" + SUFFIX))
    outs = LLM(ckpt, kv_disk_path=str(disk), **KNOBS).generate(prompts, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]


def test_hot_blocks_come_in_use_first_then_the_last_evicted_then_the_host_tier():
    from prefixserve.replica.kv.manager import KVCacheManager
    from prefixserve.replica.kv.tiers import MEDIUM_DEVICE, MEDIUM_HOST

    kv = KVCacheManager(6, 4, True, eviction_policy="lru", num_host_blocks=8, host_tier=True)

    def run(rid: str, tokens: list[int], keep: bool = False) -> None:
        blocks, n = kv.get_computed_blocks(tokens)
        assert kv.allocate_slots(rid, tokens, len(tokens) - n, blocks) is not None
        kv.take_swap_ops()
        if not keep:
            kv.free(rid)

    run("a", list(range(100, 108)))  # 2 blocks, freed
    run("b", list(range(200, 208)))  # 2 blocks, freed later: hotter than a's
    run("c", list(range(300, 308)), keep=True)  # in use
    hot = kv.hot_blocks()
    hashes = {rid: kv.hasher.hash_blocks(t, 4, None) for rid, t in (("a", range(100, 108)), ("b", range(200, 208)))}
    c_hashes = kv.hasher.hash_blocks(list(range(300, 308)), 4, None)
    assert [h for _, _, h in hot[:2]] == c_hashes and all(m == MEDIUM_DEVICE for m, _, _ in hot[:2])
    # Freed tail-first: the free queue ends with each chain's head; reversed, heads lead.
    assert [h for _, _, h in hot[2:6]] == [hashes["b"][0], hashes["b"][1], hashes["a"][0], hashes["a"][1]]
    run("d", list(range(400, 416)), keep=True)  # 4 blocks: evicts a's and b's into the host tier
    hot = kv.hot_blocks()
    host = [h for m, _, h in hot if m == MEDIUM_HOST]
    assert set(host) == set(hashes["a"] + hashes["b"])
    assert [m for m, _, _ in hot] == [MEDIUM_DEVICE] * (len(hot) - len(host)) + [MEDIUM_HOST] * len(host)
