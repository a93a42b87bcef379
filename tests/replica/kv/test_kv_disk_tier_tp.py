"""The shared disk tier at tensor_parallel_size 2 (replica/executor/tp_disk.py): every rank
writes and reads its own file of each block, rank 0 decides, and a block is a hit only when
every rank's file verifies.

A random Llama checkpoint with 4 query heads and 2 KV heads: each rank holds one KV head, so
rank 0's and rank 1's files of a block hold different bytes. The reference is one process
without any tier; a TP 2 engine must give its greedy tokens whatever the disk holds.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import pytest
from model_helpers import engine_metric, four_block_prompts, output_token_ids

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.executor import tp_disk
from prefixserve.replica.executor.tp_protocol import OP_TIER_BEFORE, hashed_message, parse_hashed_message
from prefixserve.replica.kv.disk_tier import SUFFIX, TMP_SUFFIX, DiskKey, DiskTier
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.worker.tier_io import LOAD_OK, combine_fingerprints

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Per rank: a block is 2 layers x (K, V) x 16 tokens x 1 KV head x 16 dims x 4 bytes = 4 KiB.
BLOCK_BYTES = 4096
# kv_offloading_size is summed over the ranks: 8 host slots on each of the 2 ranks.
HOST_GB = 2 * 8 * BLOCK_BYTES / 2**30
KNOBS = dict(num_kv_blocks=16, kv_offloading_size=HOST_GB, kv_disk_size_gb=0.05, tensor_parallel_size=2)
# 64 host slots a rank: a fresh engine reads all 12 blocks of A from disk in its first step.
ROOMY = dict(KNOBS, kv_offloading_size=8 * HOST_GB)


A, B = four_block_prompts(21), four_block_prompts(22)  # 4 full blocks of 16 tokens each


@pytest.fixture(scope="module")
def expected(ckpt) -> dict[str, list[list[int]]]:
    with LLM(ckpt, num_kv_blocks=64) as one:
        return {"A": output_token_ids(one.generate(A, PARAMS)), "B": output_token_ids(one.generate(B, PARAMS))}


def _no_leak(llm) -> None:
    """Every block back in the pool, the manager's invariants (the tier tests' leak check)."""
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv._swapped and not kv._tier_ops


def _files(disk: Path, rank: int) -> list[Path]:
    return sorted(disk.glob(f"*-tp{rank}of2-*{SUFFIX}"))


def _block_file(llm, prompt: list[int], index: int, rank: int) -> Path:
    kv = llm.engine.kv_manager
    h = kv.hasher.hash_blocks(prompt, kv.block_size, None)[index]
    return Path(llm.engine.tiers.disk.rank_files(h)[rank])


# --- the engine at TP 2 -------------------------------------------------------------------


def test_blocks_come_back_from_every_ranks_files_with_tp1s_tokens(ckpt, expected, tmp_path):
    disk = tmp_path / "kv"
    with LLM(ckpt, kv_disk_path=str(disk), **KNOBS) as llm:
        assert output_token_ids(llm.generate(A, PARAMS)) == expected["A"]
        # B's blocks push A's out of the 16 device blocks and the 8 host slots of each rank.
        assert output_token_ids(llm.generate(B, PARAMS)) == expected["B"]
        assert llm.engine.tiers.flush()
        outs = llm.generate(A, PARAMS)
        assert output_token_ids(outs) == expected["A"]
        hit = engine_metric(llm, "prefixserve:kv_tier_hit_tokens_total", tier="disk")
        assert hit > 0 and sum(o.num_cached_tokens for o in outs) >= hit
        assert llm.engine.tiers.disk.stats.invalid_files == 0
        # Each rank wrote its own file of every full prompt block, under one fingerprint.
        names = {r: {p.name.replace(f"-tp{r}of2-", "-") for p in _files(disk, r)} for r in (0, 1)}
        assert len(names[0]) >= 24 and names[0] == names[1]
        assert _block_file(llm, A[0], 0, 1).read_bytes() != _block_file(llm, A[0], 0, 0).read_bytes()
        _no_leak(llm)
    assert not list(disk.glob("*" + TMP_SUFFIX))


@pytest.mark.slow
def test_a_second_tp2_engine_serves_what_the_first_computed_and_tp1_reads_none_of_it(ckpt, expected, tmp_path):
    disk = tmp_path / "kv"
    with LLM(ckpt, kv_disk_path=str(disk), **KNOBS) as first:
        assert output_token_ids(first.generate(A, PARAMS)) == expected["A"]
    with LLM(ckpt, kv_disk_path=str(disk), **ROOMY) as second:
        outs = second.generate(A, PARAMS)
        assert output_token_ids(outs) == expected["A"]
        # Every full block of each prompt came from both ranks' files: only the last 6 tokens computed.
        assert [o.num_cached_tokens for o in outs] == [64, 64, 64]
        assert engine_metric(second, "prefixserve:kv_tier_hit_tokens_total", tier="disk") == 3 * 64
        assert engine_metric(second, "prefixserve:kv_tier_loaded_blocks_total", tier="disk") == 12
        _no_leak(second)
    one_knobs = dict(ROOMY, tensor_parallel_size=1, kv_offloading_size=4 * HOST_GB)
    with LLM(ckpt, kv_disk_path=str(disk), **one_knobs) as one:
        outs = one.generate(A, PARAMS)
        assert output_token_ids(outs) == expected["A"]
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
        assert one.engine.kv_manager.stats.tiers.disk_read_blocks == 0


@pytest.mark.slow
def test_one_ranks_missing_or_corrupt_file_makes_the_block_a_miss_on_every_rank(ckpt, expected, tmp_path):
    disk = tmp_path / "kv"
    with LLM(ckpt, kv_disk_path=str(disk), **KNOBS) as first:
        assert output_token_ids(first.generate(A, PARAMS)) == expected["A"]
        gone = [_block_file(first, A[0], 0, r) for r in (0, 1)]  # rank 1's file deleted
        bad = [_block_file(first, A[1], 0, r) for r in (0, 1)]  # rank 1's file corrupted
    gone[1].unlink()
    data = bytearray(bad[1].read_bytes())
    data[-1] ^= 0xFF
    bad[1].write_bytes(bytes(data))
    with LLM(ckpt, kv_disk_path=str(disk), **ROOMY) as second:
        outs = second.generate(A, PARAMS)
        assert output_token_ids(outs) == expected["A"]
        # The first block of prompts 0 and 1 is a miss (so are the blocks after it); prompt 2 hits.
        assert [o.num_cached_tokens for o in outs] == [0, 0, 64]
        stats = second.engine.tiers.disk.stats
        assert stats.invalid_files == 1
        # Rank 0's files of the two blocks were deleted too: recomputed, they are the only files
        # rank 0 wrote (a writer skips a file that exists).
        assert stats.stored_blocks == 2
        _no_leak(second)
    assert all(p.exists() for p in gone + bad) and bad[1].read_bytes() != bytes(data)


@pytest.mark.slow
def test_a_directory_under_one_ranks_block_name_is_a_miss_and_the_tier_goes_on(ckpt, expected, tmp_path, caplog):
    disk = tmp_path / "kv"
    with LLM(ckpt, kv_disk_path=str(disk), **KNOBS) as first:
        assert output_token_ids(first.generate(A, PARAMS)) == expected["A"]
        target = _block_file(first, A[0], 0, 1)
    target.unlink()
    target.mkdir()  # not a regular file: rank 1's read is a miss, not a disk fault
    with caplog.at_level(logging.WARNING), LLM(ckpt, kv_disk_path=str(disk), **ROOMY) as second:
        outs = second.generate(A, PARAMS)
        assert output_token_ids(outs) == expected["A"]
        assert output_token_ids(second.generate(A, PARAMS)) == expected["A"]
        assert engine_metric(second, "prefixserve:kv_disk_errors_total", op="read") == 0
        assert engine_metric(second, "prefixserve:kv_disk_enabled") == 1
        assert outs[0].num_cached_tokens == 0  # the block and those after it recomputed
        _no_leak(second)
    assert not [r for r in caplog.records if "disk tier" in r.getMessage()]


def test_a_fault_a_worker_reports_stops_the_tier_with_one_warning(tmp_path, caplog):
    tier = DiskTier(str(tmp_path), 1 << 20, _key(0))
    try:
        h = b"\x06" * 16
        tier.save(h, b"\x06" * 64, 1_000_000_000)
        workers = _Workers(LOAD_OK)
        workers.collect = lambda what: [([1], ("read", "OSError: [Errno 5] Input/output error"))]  # type: ignore[method-assign]
        store = tp_disk.ShardedDiskTier(tier, workers)  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING):
            assert store.load(h) is None
            assert store.load(h) is None
        assert not tier.enabled and tier.stats.errors["read"] == 1
        assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1
    finally:
        tier.close()


@pytest.mark.slow
async def test_a_drain_at_tp2_writes_every_ranks_file_of_the_hot_blocks(ckpt, tmp_path):
    disk = tmp_path / "kv"
    engine = AsyncEngine(EngineConfig(model=ckpt, kv_disk_path=str(disk), kv_drain_save_timeout_s=60.0, **KNOBS))
    try:
        for i, p in enumerate(A):
            async for _ in engine.generate(p, PARAMS, request_id=f"a{i}"):
                pass
        tiers = engine.engine.tiers
        assert tiers is not None and tiers.flush()
        assert len(_files(disk, 0)) >= 12 and len(_files(disk, 1)) >= 12
        for f in disk.glob("*" + SUFFIX):  # a sibling replica's size bound deleted them
            f.unlink()
    finally:
        await engine.shutdown(save_hot_blocks=True)
    saved = engine.engine.metrics.registry.get_sample_value(
        "prefixserve:kv_drain_saved_blocks_total", {"model_name": engine.engine.model_name, "engine": "0"}
    )
    assert saved == 12  # 4 full blocks of each 70-token prompt
    names = {r: {p.name.replace(f"-tp{r}of2-", "-") for p in _files(disk, r)} for r in (0, 1)}
    assert len(names[0]) == 12 and names[0] == names[1]


# --- the pieces -------------------------------------------------------------------------------


def _key(rank: int) -> DiskKey:
    return DiskKey("ab" * 32, "float32", 16, "cpu:16x1x16.16x1x16", rank, 2, 64)


def test_the_size_bound_deletes_every_ranks_file_of_a_block_together(tmp_path):
    tier = DiskTier(str(tmp_path), 5 * 2 * (64 + 200), _key(0))
    try:
        for i in range(8):
            h = bytes([i]) * 16
            rank1 = Path(tier.rank_files(h)[1])
            rank1.write_bytes(b"x" * 250)  # rank 1's file, as its worker writes it
            os.utime(rank1, ns=(1_000_000_000 + i, 1_000_000_000 + i))  # older than every rank 0 file
            tier.save(h, bytes([i]) * 64, 2_000_000_000 + i)
        ranks = [{p.name.split("-tp")[1][4:] for p in tmp_path.glob(f"*-tp{r}of2-*{SUFFIX}")} for r in (0, 1)]
        assert ranks[0] == ranks[1] and 0 < len(ranks[0]) < 8  # trimmed in whole blocks
        h = bytes([7]) * 16
        assert tier.touch(h, 2_000_000_000)
        Path(tier.rank_files(h)[1]).unlink()
        assert not tier.touch(h, 3_000_000_000)  # one rank's file missing: not there
        tier.discard(h)
        assert not any(Path(f).exists() for f in tier.rank_files(h)) and not tier.contains(h)
    finally:
        tier.close()


def test_disk_messages_carry_their_hashes_and_fingerprints_combine_per_size():
    stores, fills = [(3, b"\x01" * 16), (9, b"\x02" * 16)], [(4, b"\x03" * 16)]
    message = hashed_message(OP_TIER_BEFORE, [stores, fills, []])
    assert int(message[0]) == OP_TIER_BEFORE and parse_hashed_message(message) == [stores, fills, []]
    assert parse_hashed_message(hashed_message(OP_TIER_BEFORE, [[]])) == [[]]
    assert combine_fingerprints(["a"]) == "a"
    assert combine_fingerprints(["a", "b"]) not in ("a", "b", combine_fingerprints(["b", "a"]))


class _Workers:
    """A WorkerGroup stand-in whose one worker answers each read with ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.sent: list[int] = []

    def send(self, message) -> None:
        self.sent.append(int(message[0]))

    def collect(self, what: str) -> list[object]:
        return [([self.status], None)]


@pytest.mark.parametrize("status, hit", [(LOAD_OK, True), (1, False), (2, False)])
def test_a_block_is_a_hit_only_when_every_ranks_read_verified(tmp_path, status, hit):
    tier = DiskTier(str(tmp_path), 1 << 20, _key(0))
    try:
        h = b"\x05" * 16
        tier.save(h, b"\x05" * 64, 1_000_000_000)
        Path(tier.rank_files(h)[1]).write_bytes(b"rank 1")
        store = tp_disk.ShardedDiskTier(tier, _Workers(status))  # type: ignore[arg-type]
        assert (store.load(h) is not None) is hit
        assert all(Path(f).exists() for f in tier.rank_files(h)) is hit
        assert tier.stats.loaded_blocks == int(hit) and tier.stats.invalid_files == int(status == 2)
    finally:
        tier.close()


@pytest.mark.slow
def test_a_tp2_disk_directory_that_cannot_be_used_is_a_clear_error_and_stops_the_workers(ckpt, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_disk_path .* cannot be used"):
        LLM(ckpt, kv_disk_path=str(blocker / "kv"), **KNOBS)
    assert multiprocessing.active_children() == []
