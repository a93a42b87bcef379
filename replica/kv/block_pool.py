"""Physical KV blocks: reference counts, the LRU free queue, the hash -> block map.

Blocks are the integers ``0 .. num_blocks-1``; the model runner's cache tensors
are indexed by them. Every per-block field is a preallocated Python list:

    ref_cnt[b]     0..number of block tables holding b; owned by the manager's
                   touch/allocate/free calls.
    block_hash[b]  the chained hash of b's content when b is cached (a full block
                   registered in ``hash_to_block``), else None.
    _prev/_next    the free queue's links; index ``num_blocks`` is the sentinel.

The free queue is a hand-made circular doubly-linked list over those int arrays,
not a deque: a prefix hit takes a cached block out of the *middle* of the queue
in O(1), and no operation allocates a node. Order = eviction order: new
allocations pop the head (least recently freed); freed blocks join the tail.
The manager frees a request's blocks tail-first, so with equal recency the end
of a chain is evicted before its head, which keeps the head hit-able longer.

Eviction is lazy: a freed full block keeps its hash and can still be hit until
it is popped for reuse; popping it drops its hash (counted in ``num_evictions``).

Invariants (``check_invariants``):
  * b is in the free queue  <=>  ref_cnt[b] == 0; ``num_free`` is the queue length.
  * block_hash[b] = h is not None  <=>  hash_to_block[h] == b (a bijection; a hash
    already mapped is never overwritten, so a block never changes identity while
    others may share it).
  * ``num_cached_free`` counts the blocks with ref 0 that carry a hash.

Pure Python: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# The eviction orders the pool implements (EngineConfig.eviction_policy).
EVICTION_POLICIES: tuple[str, ...] = ("lru",)


class BlockPool:
    """The pool of ``num_blocks`` physical blocks (see the module docstring)."""

    def __init__(self, num_blocks: int, eviction_policy: str = "lru") -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {list(EVICTION_POLICIES)}, got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}: give the KV cache more memory")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        s = num_blocks  # sentinel
        self._sentinel = s
        # Initial order 0, 1, ..., n-1 so that a fresh pool hands out ids in order.
        self._next: list[int] = list(range(1, num_blocks + 1)) + [0]
        self._prev: list[int] = [s] + list(range(0, num_blocks))
        self.num_free = num_blocks
        self.num_cached_free = 0
        self.num_evictions = 0

    # --- queries -----------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block carrying ``block_hash``, if any (free or in use)."""
        return self.hash_to_block.get(block_hash)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_queue(self) -> list[int]:
        """The free queue head (next evicted) to tail; O(num_free), for tests and debugging."""
        out = []
        nxt = self._next
        b = nxt[self._sentinel]
        while b != self._sentinel:
            out.append(b)
            b = nxt[b]
        return out

    # --- mutations ---------------------------------------------------------

    def touch(self, blocks: Iterable[int]) -> None:
        """ref+1 on each block, taking ref-0 ones (prefix hits) out of the free queue."""
        ref, prev, nxt, bhash = self.ref_cnt, self._prev, self._next, self.block_hash
        for b in blocks:
            if ref[b] == 0:
                p, n = prev[b], nxt[b]
                nxt[p] = n
                prev[n] = p
                self.num_free -= 1
                if bhash[b] is not None:
                    self.num_cached_free -= 1
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, ref = 1, hashes evicted."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.num_free} are free")
        s = self._sentinel
        ref, nxt, bhash, h2b = self.ref_cnt, self._next, self.block_hash, self.hash_to_block
        out: list[int] = []
        append = out.append
        b = s
        evicted = 0
        for _ in range(n):
            b = nxt[b]
            h = bhash[b]
            if h is not None:
                del h2b[h]
                bhash[b] = None
                evicted += 1
            ref[b] = 1
            append(b)
        # Unlink the whole popped run at once: the head now follows the sentinel.
        head = nxt[b]
        nxt[s] = head
        self._prev[head] = s
        self.num_free -= n
        self.num_cached_free -= evicted
        self.num_evictions += evicted
        return out

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """ref-1 on each block, in the order given; those reaching 0 join the queue tail."""
        s = self._sentinel
        ref, prev, nxt, bhash = self.ref_cnt, self._prev, self._next, self.block_hash
        last = prev[s]
        freed = cached = 0
        for b in blocks:
            r = ref[b] - 1
            if r < 0:
                raise ValueError(f"block {b} freed more often than it was allocated")
            ref[b] = r
            if r == 0:
                # Chain the freed blocks behind the old tail; closed once at the end.
                nxt[last] = b
                prev[b] = last
                last = b
                freed += 1
                if bhash[b] is not None:
                    cached += 1
        nxt[last] = s
        prev[s] = last
        self.num_free += freed
        self.num_cached_free += cached

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Register a full, in-use block under ``block_hash``.

        Returns False and changes nothing when the hash already maps to a block
        (another request computed the same content concurrently): the existing
        mapping is kept, because requests may already share that block, and
        ``block`` stays an uncached private copy that is simply freed later.
        """
        if self.ref_cnt[block] == 0:
            raise ValueError(f"block {block} is free; only blocks in use are registered")
        current = self.block_hash[block]
        if current is not None:
            if current == block_hash:
                return True
            raise ValueError(f"block {block} already carries another hash")
        if block_hash in self.hash_to_block:
            return False
        self.hash_to_block[block_hash] = block
        self.block_hash[block] = block_hash
        return True

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
        """``cache_block`` for each (block, hash) pair; returns how many were registered."""
        h2b, bhash = self.hash_to_block, self.block_hash
        done = 0
        for b, h in zip(blocks, hashes):
            current = bhash[b]
            if current is None:
                if self.ref_cnt[b] == 0:
                    raise ValueError(f"block {b} is free; only blocks in use are registered")
                if h in h2b:
                    continue  # duplicate content: the existing mapping stays (see cache_block)
                h2b[h] = b
                bhash[b] = h
            elif current != h:
                raise ValueError(f"block {b} already carries another hash")
            done += 1
        return done

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.num_cached_free = 0
        return True

    # --- checks ------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when any invariant of the module docstring fails."""
        s, n = self._sentinel, self.num_blocks
        prev, nxt = self._prev, self._next
        seen: set[int] = set()
        b = s
        for _ in range(n + 1):
            nb = nxt[b]
            assert prev[nb] == b, f"free queue link broken between {b} and {nb}"
            b = nb
            if b == s:
                break
            assert 0 <= b < n, f"free queue holds out-of-range block {b}"
            assert b not in seen, f"free queue holds block {b} twice"
            seen.add(b)
        else:
            raise AssertionError("free queue does not return to its sentinel")
        assert len(seen) == self.num_free, f"num_free={self.num_free} but the queue holds {len(seen)}"
        for blk in range(n):
            r = self.ref_cnt[blk]
            assert r >= 0, f"block {blk} has ref {r}"
            assert (r == 0) == (blk in seen), f"block {blk} ref={r} but in_free_queue={blk in seen}"
        cached_free = 0
        for blk, h in enumerate(self.block_hash):
            if h is not None:
                assert self.hash_to_block.get(h) == blk, f"block {blk} carries a hash mapped elsewhere"
                cached_free += self.ref_cnt[blk] == 0
        for h, blk in self.hash_to_block.items():
            assert self.block_hash[blk] == h, f"hash maps to block {blk} which does not carry it"
        assert cached_free == self.num_cached_free, (
            f"num_cached_free={self.num_cached_free} but {cached_free} free blocks carry a hash"
        )

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free}, "
            f"cached={len(self.hash_to_block)}, cached_free={self.num_cached_free})"
        )
