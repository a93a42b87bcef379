"""Helpers for the KV tests: a full, comparable picture of a KV manager's state, and the
BlockStored events of the KV-event contract."""

from __future__ import annotations

from prefixserve.replica.contract.vllm_kv_events import BlockStored
from prefixserve.replica.kv.manager import KVCacheManager


def snapshot(m: KVCacheManager) -> tuple:
    """Everything observable about the cache: refs, hashes, free-queue order, tables, counters."""
    pool = m.pool
    tables = {rid: (m.block_table(rid), m.num_tokens(rid)) for rid in sorted(m._requests)}
    return (
        list(pool.ref_cnt),
        list(pool.block_hash),
        dict(pool.hash_to_block),
        pool.free_queue(),
        tables,
        m.stats,
        list(m._copy_ops),
    )


def block_stored(hashes: list[int], medium: str | None = "GPU") -> BlockStored:
    """A BlockStored event of blocks of 16 tokens (token ids and parent left out) under ``hashes``."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
