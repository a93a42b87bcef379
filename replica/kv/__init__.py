"""The replica's paged KV block manager with prefix caching (pure Python).

``KVCacheManager`` is what the scheduler uses; ``hashing`` is Contract 2 of
docs/design.md (the router imports it too); ``BlockPool`` is the physical layer,
with the eviction policies of ``EVICTION_POLICIES`` (``BlockPool(n, policy)``).
"""

from prefixserve.replica.kv.block_pool import EVICTION_POLICIES, BlockPool
from prefixserve.replica.kv.hashing import (
    DEFAULT_HASH_ALGO,
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    BlockHasher,
    encode_extra,
    encode_tokens,
    hash_blocks,
)
from prefixserve.replica.kv.manager import KVCacheManager, KVCacheStats

__all__ = [
    "DEFAULT_HASH_ALGO",
    "DEFAULT_HASH_SEED",
    "EVICTION_POLICIES",
    "HASH_ALGOS",
    "BlockHasher",
    "BlockPool",
    "KVCacheManager",
    "KVCacheStats",
    "encode_extra",
    "encode_tokens",
    "hash_blocks",
]
