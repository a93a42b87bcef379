"""Helpers for the KV manager tests: a full, comparable picture of a manager's state."""

from __future__ import annotations

from prefixserve.replica.kv import KVCacheManager


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
