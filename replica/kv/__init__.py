"""The replica's paged KV block manager with prefix caching (pure Python).

``manager.KVCacheManager`` is what the scheduler uses; ``hashing`` is Contract 2 of
docs/design.md, which the router imports too (so this package's face imports nothing:
the router's import of the hashing loads no block manager); ``block_pool.BlockPool`` is
the physical layer, with the eviction policies of ``EVICTION_POLICIES``.
"""
