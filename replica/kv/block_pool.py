"""Physical KV blocks: reference counts, the free queue(s), the hash -> block map.

Blocks are the integers ``0 .. num_blocks-1``; the model runner's cache tensors
are indexed by them. Every per-block field is a preallocated Python list:

    ref_cnt[b]     0..number of block tables holding b; owned by the manager's
                   touch/allocate/free calls.
    block_hash[b]  the chained hash of b's content when b is cached (a full block
                   registered in ``hash_to_block``), else None.
    _prev/_next    the free lists' links; indices ``num_blocks ..`` are sentinels.

Free blocks (ref 0) sit in hand-made circular doubly-linked lists over those int
arrays, not deques: a prefix hit takes a cached block out of the *middle* of a
list in O(1), and no operation allocates a node. In-use blocks are in no list,
so eviction can never touch a referenced block.

Eviction is lazy under every policy: a freed full block keeps its hash and can
still be hit until it is popped for reuse; popping it drops its hash (counted in
``num_evictions``). The policies differ only in *which* free block is popped
(``eviction_policy``, ``EVICTION_POLICIES``); every operation is O(1) per block
(amortized O(1) for ``s3fifo``, whose pops may move a few hit blocks first):

``lru`` (vLLM's order)
    One queue: new allocations pop the head (least recently freed); freed
    blocks join the tail. The manager frees a request's blocks tail-first, so
    with equal recency the end of a chain is evicted before its head.
``slru`` (segmented LRU with a ghost list)
    A block enters *probationary*; it is promoted to *protected* when it is hit
    again: a prefix hit (``touch``) while it is free, a second request touching
    it while in use, or its hash being recomputed shortly after it was evicted
    (the ghost list remembers the last ``num_blocks`` evicted hashes, as 2Q's
    A1out). Probationary blocks are evicted first (LRU), then protected ones
    (LRU). Protected free blocks are bounded by ``PROTECTED_FRACTION`` of the
    pool; beyond it the least recent protected block is demoted to the young
    end of probation (and must be hit again to return). So a request's one-shot
    question and answer blocks leave before any shared system prompt.
``lfu`` (LFU with dynamic aging, LFU-DA; SGLang offers plain LFU)
    A freed block's key is ``floor + min(1 + hits, LFU_MAX_FREQ)``, hits being
    its touches since it was allocated; the smallest key is evicted (LRU among
    equals) and the floor rises to the evicted key. The aging rule: a block's
    advantage is at most ``LFU_MAX_FREQ`` floor steps, and the floor rises each
    time the coldest key class is used up, so a block that was hot long ago but
    is not hit any more is evicted after at most ``LFU_MAX_FREQ`` such steps.
    Keys live in the window ``[floor, floor + LFU_MAX_FREQ]``: one list per key
    (a circular array of buckets), so finding the minimum scans a constant
    number of buckets.
``s3fifo`` (S3-FIFO, Yang et al. SOSP'23)
    A small FIFO (``S3FIFO_SMALL_FRACTION`` of the free cached blocks) and a
    main FIFO, with the same ghost list. New blocks enter small; a small block
    that was hit since it entered moves to main instead of being evicted; a
    main block with hits is reinserted at main's tail with one hit fewer.

``mark_reused`` tells the pool that in-use blocks hold content a later request
will hit (the manager passes a request's static prefix, the system prompt its
routing key names), so that a tenant's prompt survives the churn of other
requests' one-shot blocks between its first request on a replica and its
second: ``slru`` frees an unhit marked block into protected at its least
recent end (after every one-shot block, before every block hit twice). The
other policies ignore the hint: ``lru`` keeps vLLM's order, and entering
``s3fifo``'s main or counting a hit under ``lfu`` cost hit rate where a replica
sees more prompts than it holds (the simulator behind round-robin).

Under every policy but ``lru``, free blocks without a hash (never cached, or
copies of content cached elsewhere) sit in a list of their own that is popped
first: evicting them loses nothing.

``free_blocks_cold`` frees blocks that are not expected to be hit again (a
finished one-shot request's generated tokens): under ``lru`` they enter at the
head of the queue instead of the tail (behind the never-cached blocks that lead
the queue in a new or reset pool); under the other policies a block that
would enter the policy's entry list unhit (``slru``'s probation, ``s3fifo``'s
small FIFO, ``lfu``'s key ``floor + 1``) enters at the evicted end instead
(``lfu``: key ``floor``), so it goes before every other cached block, while a
block hit during its use still enters as ``free_blocks`` puts it.

Invariants (``check_invariants``):
  * b is in a free list  <=>  ref_cnt[b] == 0; ``num_free`` is the lists' total.
  * block_hash[b] = h is not None  <=>  hash_to_block[h] == b (a bijection; a hash
    already mapped is never overwritten, so a block never changes identity while
    others may share it).
  * ``num_cached_free`` counts the blocks with ref 0 that carry a hash.
  * ``lru``: the queue's first ``_num_fresh`` blocks carry no hash, ``_fresh_last`` the last of them.
  * policy-specific ones (list counts, the protected bound, key windows).

Pure Python: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# The eviction orders the pool implements (EngineConfig.eviction_policy); see the module docstring.
EVICTION_POLICIES: tuple[str, ...] = ("lru", "slru", "lfu", "s3fifo")


class BlockPool:
    """The pool of ``num_blocks`` physical blocks (see the module docstring).

    ``BlockPool(num_blocks, eviction_policy)`` returns the subclass that
    implements the policy; this class itself is ``lru``.
    """

    eviction_policy = "lru"

    def __new__(cls, num_blocks: int, eviction_policy: str = "lru") -> BlockPool:
        klass: type[BlockPool] = cls
        if cls is BlockPool:
            if eviction_policy not in _POOL_CLASSES:
                raise ValueError(f"eviction_policy must be one of {list(EVICTION_POLICIES)}, got {eviction_policy!r}")
            klass = _POOL_CLASSES[eviction_policy]
        return object.__new__(klass)

    def __init__(self, num_blocks: int, eviction_policy: str = "lru") -> None:
        self._init_common(num_blocks, eviction_policy)
        s = num_blocks  # sentinel
        self._sentinel = s
        # Initial order 0, 1, ..., n-1 so that a fresh pool hands out ids in order.
        self._next: list[int] = list(range(1, num_blocks + 1)) + [0]
        self._prev: list[int] = [s] + list(range(0, num_blocks))
        # The queue's leading run of never-cached blocks (the whole pool at first and after a reset),
        # ending at _fresh_last: free_blocks_cold inserts behind it, not ahead of empty blocks.
        self._num_fresh = num_blocks
        self._fresh_last = num_blocks - 1

    def _init_common(self, num_blocks: int, eviction_policy: str) -> None:
        if eviction_policy != self.eviction_policy:
            raise ValueError(f"{type(self).__name__} implements {self.eviction_policy!r}, not {eviction_policy!r}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}: give the KV cache more memory")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.num_free = num_blocks
        self.num_cached_free = 0
        self.num_evictions = 0
        self._num_resets = 0
        # (block, hash) of every eviction, in order, while a caller collects them (a list; None =
        # not recorded): the KV manager's host tier copies evicted content before it is overwritten.
        self.evicted: list[tuple[int, bytes]] | None = None

    # --- queries -----------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block carrying ``block_hash``, if any (free or in use)."""
        return self.hash_to_block.get(block_hash)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def hash_epoch(self) -> int:
        """Changes whenever a block loses its hash (an eviction, a reset): while it stays the
        same, every block still carries the hash it carried (``cache_blocks`` only adds)."""
        return self.num_evictions + self._num_resets

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
        # The counters are kept in locals (an attribute update per block costs more than the
        # unlink) and written back once, also when a bad block id raises midway.
        taken = cached = 0
        try:
            for b in blocks:
                r = ref[b]
                if r == 0:
                    p, n = prev[b], nxt[b]
                    nxt[p] = n
                    prev[n] = p
                    taken += 1
                    if bhash[b] is not None:
                        cached += 1
                    elif self._num_fresh:  # not a prefix hit (the manager never does it): forget the run
                        self._num_fresh = 0
                        self._fresh_last = self._sentinel
                ref[b] = r + 1
        finally:
            self.num_free -= taken
            self.num_cached_free -= cached

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
        record = self.evicted
        for _ in range(n):
            b = nxt[b]
            h = bhash[b]
            if h is not None:
                del h2b[h]
                bhash[b] = None
                evicted += 1
                if record is not None:
                    record.append((b, h))
            ref[b] = 1
            append(b)
        # Unlink the whole popped run at once: the head now follows the sentinel.
        head = nxt[b]
        nxt[s] = head
        self._prev[head] = s
        if self._num_fresh:
            fresh = self._num_fresh - n
            self._num_fresh = fresh if fresh > 0 else 0
            if fresh <= 0:
                self._fresh_last = s
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
            if r:  # still held elsewhere, or freed once too often
                if r < 0:
                    raise ValueError(f"block {b} freed more often than it was allocated")
                ref[b] = r
                continue
            ref[b] = 0
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

    def free_blocks_cold(self, blocks: Iterable[int]) -> None:
        """``free_blocks``, but those reaching 0 enter at the queue head (evicted next), the first given
        first; behind the never-cached blocks leading the queue, if any (popping those loses nothing)."""
        order = list(blocks)
        self.free_blocks(order)
        anchor = self._fresh_last if self._num_fresh else self._sentinel
        ref, prev, nxt = self.ref_cnt, self._prev, self._next
        for b in reversed(order):
            if ref[b] == 0:
                p, q = prev[b], nxt[b]
                nxt[p] = q
                prev[q] = p
                q = nxt[anchor]
                nxt[anchor] = b
                prev[b] = anchor
                nxt[b] = q
                prev[q] = b

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
        h2b, bhash, ref = self.hash_to_block, self.block_hash, self.ref_cnt
        duplicates = 0  # every other pair is registered (or already was)
        for b, h in zip(blocks, hashes):
            current = bhash[b]
            if current is None:
                if ref[b] == 0:
                    raise ValueError(f"block {b} is free; only blocks in use are registered")
                # One dict operation: b carries no hash, so no hash maps to it yet (the bijection).
                if h2b.setdefault(h, b) != b:
                    duplicates += 1  # duplicate content: the existing mapping stays (see cache_block)
                    continue
                bhash[b] = h
            elif current != h:
                raise ValueError(f"block {b} already carries another hash")
        return min(len(blocks), len(hashes)) - duplicates

    def mark_reused(self, blocks: Iterable[int]) -> None:
        """Hint that these in-use blocks' content will be hit again (module docstring); only
        ``slru`` acts on it (``SLRUBlockPool.mark_reused``)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.num_cached_free = 0
        self._num_resets += 1
        self._num_fresh = self.num_blocks  # every block is free and uncached: the whole queue
        self._fresh_last = self._prev[self._sentinel]
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
        queue = self.free_queue()
        k = self._num_fresh
        assert 0 <= k <= len(queue), f"_num_fresh={k} but {len(queue)} blocks are free"
        assert all(self.block_hash[b] is None for b in queue[:k]), "the fresh run holds a cached block"
        assert self._fresh_last == (queue[k - 1] if k else s), "_fresh_last does not end the fresh run"

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free}, "
            f"cached={len(self.hash_to_block)}, cached_free={self.num_cached_free})"
        )


class _MultiListPool(BlockPool):
    """Shared machinery of the policies with several free lists and a ghost list.

    List ``k``'s sentinel is ``num_blocks + k``; ``_where[b]`` is b's list (-1 in
    use) and ``_count[k]`` each list's length. List 0 (``_COLD``) holds the free
    blocks without a hash and is popped first. ``_hits[b]`` counts the touches of
    b since it was allocated, capped at ``_hit_cap``; what a hit means is the
    subclass's (``free_blocks``, ``_victim``, ``_ghost_hit``).

    The ghost list remembers the hashes of the last ``num_blocks`` evicted
    blocks (a ring buffer of hashes plus a dict hash -> ring slot, O(1) each
    way); a block registered under a remembered hash was evicted too early,
    and the subclass promotes it (``_ghost_hit``); the hash then leaves the
    ghost and its ring slot is emptied. So every hash in the ring is a ghost
    mapped to its slot, and an eviction overwriting a slot drops that hash from
    the ghost without looking it up first.
    """

    _NUM_LISTS = 1
    _COLD = 0
    _USES_GHOST = False

    def __init__(self, num_blocks: int, eviction_policy: str | None = None) -> None:
        self._init_common(num_blocks, self.eviction_policy if eviction_policy is None else eviction_policy)
        n, k = num_blocks, self._NUM_LISTS
        self._sentinel = n  # list 0's sentinel
        # Every block starts in the cold list in order 0..n-1 (a fresh pool hands out ids in order);
        # the other lists start empty (their sentinels point at themselves).
        self._next = list(range(1, n + 1)) + [0] + [n + i for i in range(1, k)]
        self._prev = [n] + list(range(0, n - 1)) + [n - 1] + [n + i for i in range(1, k)]
        self._where: list[int] = [0] * n
        self._count: list[int] = [n] + [0] * (k - 1)
        self._hits: list[int] = [0] * n
        self._hit_cap = 1
        self._ghost: dict[bytes, int] = {}
        self._ghost_ring: list[bytes | None] = [None] * n if self._USES_GHOST else []
        self._ghost_pos = 0

    # --- list primitives (the hot loops inline these) ------------------------

    def _unlink(self, b: int) -> None:
        prev, nxt = self._prev, self._next
        p, q = prev[b], nxt[b]
        nxt[p] = q
        prev[q] = p
        self._count[self._where[b]] -= 1
        self._where[b] = -1

    def _link(self, k: int, b: int, p: int, q: int) -> None:
        """Put unlinked ``b`` into list ``k`` between its adjacent nodes ``p`` and ``q``."""
        prev, nxt = self._prev, self._next
        nxt[p] = b
        prev[b] = p
        nxt[b] = q
        prev[q] = b
        self._where[b] = k
        self._count[k] += 1

    def _push_tail(self, k: int, b: int) -> None:
        s = self.num_blocks + k
        self._link(k, b, self._prev[s], s)

    def _push_head(self, k: int, b: int) -> None:
        s = self.num_blocks + k
        self._link(k, b, s, self._next[s])

    def _head(self, k: int) -> int:
        return self._next[self.num_blocks + k]

    def _list(self, k: int) -> list[int]:
        out = []
        s = self.num_blocks + k
        b = self._next[s]
        while b != s:
            out.append(b)
            b = self._next[b]
        return out

    def _eviction_lists(self) -> list[int]:
        """The lists in the order they are popped (the cold list first)."""
        return list(range(self._NUM_LISTS))

    # --- policy hooks --------------------------------------------------------

    def _victim(self) -> int:
        """The next block to pop (it stays linked; the caller unlinks it)."""
        raise NotImplementedError

    def _ghost_hit(self, block: int) -> None:
        """``block`` was registered under a hash evicted recently (ghost policies only)."""
        raise NotImplementedError

    def _cold_list(self, block: int) -> int:
        """Where ``free_blocks_cold`` moves a block ``free_blocks`` just freed into list
        ``_where[block]``: the list whose head it joins, or -1 to leave it."""
        raise NotImplementedError

    # --- queries ---------------------------------------------------------------

    def free_queue(self) -> list[int]:
        """Free blocks list by list in pop order; O(num_free), for tests and debugging.

        Exact eviction order for ``slru`` and ``lfu``; for ``s3fifo`` a pop may
        first move hit blocks to main's tail, so it is the order before those moves.
        """
        out: list[int] = []
        for k in self._eviction_lists():
            out += self._list(k)
        return out

    # --- mutations ---------------------------------------------------------------

    def touch(self, blocks: Iterable[int]) -> None:
        """ref+1 on each block, taking ref-0 ones (prefix hits) out of their list; counts a hit."""
        ref, prev, nxt = self.ref_cnt, self._prev, self._next
        where, count, hits, cap = self._where, self._count, self._hits, self._hit_cap
        # The free counters follow from the list counts once, after the loop (also when a bad
        # block id raises midway): the blocks taken are the lists' loss, the uncached ones the
        # cold list's (a free block carries a hash exactly when it is in another list).
        uncached = count[self._COLD]
        try:
            for b in blocks:
                r = ref[b]
                if r == 0:
                    p, q = prev[b], nxt[b]
                    nxt[p] = q
                    prev[q] = p
                    count[where[b]] -= 1
                    where[b] = -1
                ref[b] = r + 1
                if hits[b] < cap:
                    hits[b] += 1
        finally:
            taken = self.num_free - sum(count)
            self.num_free -= taken
            self.num_cached_free -= taken - (uncached - count[self._COLD])

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` victims (``_victim``), ref = 1, hits 0, hashes evicted (and remembered by the ghost)."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.num_free} are free")
        ref, prev, nxt, bhash, h2b = self.ref_cnt, self._prev, self._next, self.block_hash, self.hash_to_block
        where, count, hits = self._where, self._count, self._hits
        out: list[int] = []
        gone: list[bytes] = []  # the evicted hashes, in eviction order
        victim = self._victim
        record = self.evicted
        for _ in range(n):
            b = victim()
            p, q = prev[b], nxt[b]
            nxt[p] = q
            prev[q] = p
            count[where[b]] -= 1
            where[b] = -1
            h = bhash[b]
            if h is not None:
                del h2b[h]
                bhash[b] = None
                gone.append(h)
                if record is not None:
                    record.append((b, h))
            ref[b] = 1
            hits[b] = 0
            out.append(b)
        if self._ghost_ring:
            self._remember(gone)
        self.num_free -= n
        self.num_cached_free -= len(gone)
        self.num_evictions += len(gone)
        return out

    def _remember(self, hashes: list[bytes]) -> None:
        """Put evicted hashes in the ghost ring, in order, each in the oldest slot.

        Slice by slice (at most two: ``hashes`` holds at most one ring's worth): an
        overwritten hash is a ghost at that slot (class docstring) and simply leaves.
        """
        ring, ghost = self._ghost_ring, self._ghost
        size, pos, done = len(ring), self._ghost_pos, 0
        while done < len(hashes):
            stop = min(size, pos + len(hashes) - done)
            for old in ring[pos:stop]:
                if old is not None:
                    del ghost[old]
            part = hashes[done : done + stop - pos]
            ring[pos:stop] = part
            ghost.update(zip(part, range(pos, stop)))
            done += stop - pos
            pos = stop if stop < size else 0
        self._ghost_pos = pos

    def free_blocks_cold(self, blocks: Iterable[int]) -> None:
        """``free_blocks``; then each block that reached 0 and entered its policy's entry list
        unhit moves to the evicted end (``_cold_list``), the first given evicted first."""
        order = list(blocks)
        self.free_blocks(order)
        ref, cold = self.ref_cnt, self._cold_list
        for b in reversed(order):
            if ref[b] == 0:
                k = cold(b)
                if k >= 0:
                    self._unlink(b)
                    self._push_head(k, b)

    def _free_to_tails(self, blocks: Iterable[int], state: Sequence[int], list_of_state: Sequence[int]) -> None:
        """ref-1 on each block, in the order given; each reaching 0 joins a list's tail: the cold
        list without a hash, else list ``list_of_state[state[b]]``.

        The policy's choice is a table lookup rather than a method call because this loop runs
        for every block a finished request frees.
        """
        n = self.num_blocks
        ref, prev, nxt, bhash = self.ref_cnt, self._prev, self._next, self.block_hash
        where, count = self._where, self._count
        freed = cached = 0
        for b in blocks:
            r = ref[b] - 1
            if r < 0:
                raise ValueError(f"block {b} freed more often than it was allocated")
            ref[b] = r
            if r:
                continue
            freed += 1
            if bhash[b] is None:
                k = 0
            else:
                cached += 1
                k = list_of_state[state[b]]
            s = n + k
            last = prev[s]
            nxt[last] = b
            prev[b] = last
            nxt[b] = s
            prev[s] = b
            where[b] = k
            count[k] += 1
        self.num_free += freed
        self.num_cached_free += cached

    def _note_registered(self, block: int, block_hash: bytes) -> None:
        ghost = self._ghost
        if ghost and block_hash in ghost:
            self._ghost_ring[ghost.pop(block_hash)] = None
            self._ghost_hit(block)

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """``BlockPool.cache_block``; a hash the ghost remembers promotes the block."""
        fresh = self.block_hash[block] is None
        done = super().cache_block(block, block_hash)
        if done and fresh:
            self._note_registered(block, block_hash)
        return done

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
        """``BlockPool.cache_blocks``; hashes the ghost remembers promote their blocks."""
        h2b, bhash, ref, ghost = self.hash_to_block, self.block_hash, self.ref_cnt, self._ghost
        duplicates = 0  # every other pair is registered (or already was)
        for b, h in zip(blocks, hashes):
            current = bhash[b]
            if current is None:
                if ref[b] == 0:
                    raise ValueError(f"block {b} is free; only blocks in use are registered")
                if h2b.setdefault(h, b) != b:  # as in BlockPool.cache_blocks
                    duplicates += 1  # duplicate content: the existing mapping stays (see cache_block)
                    continue
                bhash[b] = h
                if ghost and h in ghost:
                    self._ghost_ring[ghost.pop(h)] = None
                    self._ghost_hit(b)
            elif current != h:
                raise ValueError(f"block {b} already carries another hash")
        return min(len(blocks), len(hashes)) - duplicates

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, hit count and ghost; refused (False) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        order = self.free_queue()
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.num_cached_free = 0
        self._num_resets += 1
        self._ghost.clear()
        self._ghost_ring = [None] * len(self._ghost_ring)
        self._ghost_pos = 0
        for b in order:
            self._unlink(b)
            self._hits[b] = 0
            self._reset_block(b)
            self._push_tail(self._COLD, b)
        return True

    def _reset_block(self, block: int) -> None:
        """Clear the subclass's per-block state (on reset)."""

    # --- checks ------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant of the module docstring fails."""
        n = self.num_blocks
        prev, nxt = self._prev, self._next
        seen: set[int] = set()
        for k in range(self._NUM_LISTS):
            s = n + k
            b, length = s, 0
            for _ in range(n + 1):
                nb = nxt[b]
                assert prev[nb] == b, f"list {k}: link broken between {b} and {nb}"
                b = nb
                if b == s:
                    break
                assert 0 <= b < n, f"list {k} holds out-of-range block {b}"
                assert b not in seen, f"block {b} is linked twice"
                assert self._where[b] == k, f"block {b} is in list {k} but _where says {self._where[b]}"
                seen.add(b)
                length += 1
            else:
                raise AssertionError(f"list {k} does not return to its sentinel")
            assert length == self._count[k], f"list {k} holds {length} blocks, count says {self._count[k]}"
            if k == self._COLD:
                assert all(self.block_hash[x] is None for x in self._list(k)), "the cold list holds a cached block"
        assert len(seen) == self.num_free, f"num_free={self.num_free} but the lists hold {len(seen)}"
        assert self.num_cached_free == self.num_free - self._count[self._COLD], (
            "the cached free blocks are not exactly those outside the cold list"
        )
        for blk in range(n):
            r = self.ref_cnt[blk]
            assert r >= 0, f"block {blk} has ref {r}"
            assert (r == 0) == (blk in seen), f"block {blk} ref={r} but free={blk in seen}"
            assert (self._where[blk] == -1) == (r > 0), f"block {blk} ref={r} but _where={self._where[blk]}"
            assert 0 <= self._hits[blk] <= self._hit_cap, f"block {blk} has {self._hits[blk]} hits"
        cached_free = 0
        for blk, h in enumerate(self.block_hash):
            if h is not None:
                assert self.hash_to_block.get(h) == blk, f"block {blk} carries a hash mapped elsewhere"
                cached_free += self.ref_cnt[blk] == 0
        for h, blk in self.hash_to_block.items():
            assert self.block_hash[blk] == h, f"hash maps to block {blk} which does not carry it"
            assert h not in self._ghost, "a cached hash is also a ghost"
        assert cached_free == self.num_cached_free, (
            f"num_cached_free={self.num_cached_free} but {cached_free} free blocks carry a hash"
        )
        for h, pos in self._ghost.items():
            assert self._ghost_ring[pos] == h, "a ghost points at a ring slot holding another hash"
        assert sum(h is not None for h in self._ghost_ring) == len(self._ghost), "the ring holds a hash not a ghost"


class SLRUBlockPool(_MultiListPool):
    """``slru``: probation then protected, promotion on a second hit (module docstring)."""

    eviction_policy = "slru"
    # Of num_blocks: the most free blocks that may be protected (0.5 lost ~0.3 pp of hits in the simulator).
    PROTECTED_FRACTION = 0.8
    _NUM_LISTS = 3
    _PROBATION, _PROTECTED = 1, 2
    _USES_GHOST = True

    def __init__(self, num_blocks: int, eviction_policy: str | None = None) -> None:
        super().__init__(num_blocks, eviction_policy)
        self.protected_cap = max(1, int(self.PROTECTED_FRACTION * num_blocks))
        self._hinted: list[bool] = [False] * num_blocks  # marked reused, not hit (mark_reused)

    def _ghost_hit(self, block: int) -> None:
        self._hits[block] = 1

    def mark_reused(self, blocks: Iterable[int]) -> None:
        """Unhit in-use cached ``blocks`` enter protected at its least recent end when freed.

        Not at its young end, where hit blocks go: a replica that sees more
        distinct system prompts than it can hold (behind a round-robin balancer)
        would otherwise churn its protected segment with prompts seen once. So a
        marked block outlives every one-shot block and goes before every block hit
        twice; past the protected cap it stays in probation.
        """
        ref, bhash, hits, hinted = self.ref_cnt, self.block_hash, self._hits, self._hinted
        for b in blocks:
            if ref[b] and bhash[b] is not None and not hits[b]:
                hinted[b] = True

    def _protect_hinted(self, freed: list[int]) -> None:
        """Move marked blocks ``free_blocks`` just put in probation to protected's least recent end.

        ``freed`` is in free order (a chain tail-first), so pushing it in reverse
        leaves the chain's last block first to go, as in probation.
        """
        hinted, hits, count, cap = self._hinted, self._hits, self._count, self.protected_cap
        for b in reversed(freed):
            hinted[b] = False
            if count[2] < cap:
                self._unlink(b)
                self._push_head(2, b)
                hits[b] = 1

    def _cold_list(self, block: int) -> int:
        return self._PROBATION if self._where[block] == self._PROBATION else -1

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """ref-1 on each block, in the order given; those reaching 0 join their list's tail.

        No hash: the cold list; hit since allocated: protected (demoting
        protected's least recent block past the cap); else probation. Each
        list's tail is kept in a local and extended in place (the lists are
        closed and their counts written once, at the end), as ``BlockPool.free_blocks``
        does with its one queue.
        """
        n = self.num_blocks
        ref, prev, nxt, bhash = self.ref_cnt, self._prev, self._next, self.block_hash
        where, count, hits, hinted = self._where, self._count, self._hits, self._hinted
        s0, s1, s2 = n, n + 1, n + 2
        t0, t1, t2 = prev[s0], prev[s1], prev[s2]
        a0 = a1 = a2 = 0  # blocks added to each list
        room = self.protected_cap - count[2]  # protected blocks addable before a demotion
        marked: list[int] = []  # marked reused, freed unhit: moved to protected after the loop
        try:
            for b in blocks:
                r = ref[b] - 1
                if r:  # still held elsewhere, or freed once too often
                    if r < 0:
                        raise ValueError(f"block {b} freed more often than it was allocated")
                    ref[b] = r
                    continue
                ref[b] = 0
                if bhash[b] is None:
                    nxt[t0] = b
                    prev[b] = t0
                    t0 = b
                    where[b] = 0
                    a0 += 1
                elif hits[b]:
                    hinted[b] = False  # hit after it was marked: a hit block
                    nxt[t2] = b
                    prev[b] = t2
                    t2 = b
                    where[b] = 2
                    a2 += 1
                    if a2 > room:
                        # Past the cap: protected's head (not its tail: the cap is >= 1, so it holds
                        # two blocks now) moves to probation's tail and must be hit again.
                        d = nxt[s2]
                        q = nxt[d]
                        nxt[s2] = q
                        prev[q] = s2
                        hits[d] = 0
                        nxt[t1] = d
                        prev[d] = t1
                        t1 = d
                        where[d] = 1
                        a2 -= 1
                        a1 += 1
                else:
                    nxt[t1] = b
                    prev[b] = t1
                    t1 = b
                    where[b] = 1
                    a1 += 1
                    if hinted[b]:
                        marked.append(b)
        finally:
            nxt[t0] = s0
            prev[s0] = t0
            nxt[t1] = s1
            prev[s1] = t1
            nxt[t2] = s2
            prev[s2] = t2
            count[0] += a0
            count[1] += a1
            count[2] += a2
            self.num_free += a0 + a1 + a2
            self.num_cached_free += a1 + a2
        if marked:
            self._protect_hinted(marked)

    def _victim(self) -> int:
        count, nxt, n = self._count, self._next, self.num_blocks
        if count[0]:
            return nxt[n]
        if count[1]:
            return nxt[n + 1]
        return nxt[n + 2]

    def get_new_blocks(self, n: int) -> list[int]:
        """``_MultiListPool.get_new_blocks`` in ``_victim``'s order, popping runs.

        The victims are the heads of the cold list, then probation, then
        protected, so ``n`` pops take a leading run of each list in turn: each
        run is unlinked at once (as ``BlockPool.get_new_blocks`` does), not block
        by block.
        """
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.num_free} are free")
        nb = self.num_blocks
        ref, prev, nxt, bhash, h2b = self.ref_cnt, self._prev, self._next, self.block_hash, self.hash_to_block
        where, count, hits = self._where, self._count, self._hits
        out: list[int] = []
        append = out.append
        gone: list[bytes] = []  # the evicted hashes, in eviction order
        evict = gone.append
        record = self.evicted
        left = n
        for k in (0, 1, 2):
            if not left:
                break
            take = min(count[k], left)
            if not take:
                continue
            s = nb + k
            b = s
            for _ in range(take):
                b = nxt[b]
                where[b] = -1
                ref[b] = 1
                hits[b] = 0
                h = bhash[b]
                if h is not None:
                    del h2b[h]
                    bhash[b] = None
                    evict(h)
                    if record is not None:
                        record.append((b, h))
                append(b)
            head = nxt[b]
            nxt[s] = head
            prev[head] = s
            count[k] -= take
            left -= take
        self._remember(gone)
        self.num_free -= n
        self.num_cached_free -= len(gone)
        self.num_evictions += len(gone)
        return out

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._count[2] <= self.protected_cap, "protected holds more than its cap"
        assert all(self._hits[b] for b in self._list(2)), "an unhit block is protected"
        assert not any(self._hinted[b] for b in range(self.num_blocks) if self.ref_cnt[b] == 0), (
            "a free block is still marked reused"
        )


class LFUBlockPool(_MultiListPool):
    """``lfu``: LFU with dynamic aging over key buckets (module docstring)."""

    eviction_policy = "lfu"
    LFU_MAX_FREQ = 8  # the largest key offset over the floor; the aging horizon in floor steps

    def __init__(self, num_blocks: int, eviction_policy: str | None = None) -> None:
        f = self.LFU_MAX_FREQ
        self._NUM_LISTS = f + 2  # the cold list + one bucket per key in [floor, floor + f]
        super().__init__(num_blocks, eviction_policy)
        self._hit_cap = f - 1
        self._floor = 0

    def _ghost_hit(self, block: int) -> None:  # pragma: no cover - lfu keeps no ghost
        pass

    def _bucket(self, key: int) -> int:
        return 1 + key % (self.LFU_MAX_FREQ + 1)

    def _cold_list(self, block: int) -> int:
        # An unhit cached block enters with key floor + 1; cold, it takes the floor's key.
        if self._hits[block] == 0 and self._where[block] == self._bucket(self._floor + 1):
            return self._bucket(self._floor)
        return -1

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """ref-1 on each block, in the order given; those reaching 0 join their key's bucket tail."""
        floor, width = self._floor, self.LFU_MAX_FREQ + 1
        # A cached block's key is floor + 1 + its hits (at most _hit_cap).
        self._free_to_tails(blocks, self._hits, [1 + (floor + 1 + h) % width for h in range(self._hit_cap + 1)])

    def _victim(self) -> int:
        count, nxt, n = self._count, self._next, self.num_blocks
        if count[0]:
            return nxt[n]
        floor, width = self._floor, self.LFU_MAX_FREQ + 1
        for d in range(width):
            k = 1 + (floor + d) % width
            if count[k]:
                self._floor = floor + d  # the evicted key: the aging step
                return nxt[n + k]
        raise AssertionError("no free block to evict")  # get_new_blocks checked num_free

    def _eviction_lists(self) -> list[int]:
        width = self.LFU_MAX_FREQ + 1
        return [0] + [1 + (self._floor + d) % width for d in range(width)]


class S3FIFOBlockPool(_MultiListPool):
    """``s3fifo``: small FIFO, main FIFO with reinsertion, ghost list (module docstring)."""

    eviction_policy = "s3fifo"
    S3FIFO_SMALL_FRACTION = 0.1  # of the free cached blocks: the small FIFO's share before it is drained
    _NUM_LISTS = 3
    _SMALL, _MAIN = 1, 2
    _USES_GHOST = True

    def __init__(self, num_blocks: int, eviction_policy: str | None = None) -> None:
        super().__init__(num_blocks, eviction_policy)
        self._hit_cap = 3
        self._main: list[bool] = [False] * num_blocks

    def _ghost_hit(self, block: int) -> None:
        self._main[block] = True

    def _reset_block(self, block: int) -> None:
        self._main[block] = False

    def _cold_list(self, block: int) -> int:
        return self._SMALL if self._where[block] == self._SMALL and not self._hits[block] else -1

    def get_new_blocks(self, n: int) -> list[int]:
        """``_MultiListPool.get_new_blocks``; the popped blocks start in small again."""
        out = super().get_new_blocks(n)
        main = self._main
        for b in out:
            main[b] = False
        return out

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """ref-1 on each block, in the order given; those reaching 0 join the cold, small or main tail."""
        self._free_to_tails(blocks, self._main, [self._SMALL, self._MAIN])

    def _victim(self) -> int:
        count, nxt, n, hits = self._count, self._next, self.num_blocks, self._hits
        if count[0]:
            return nxt[n]
        frac = self.S3FIFO_SMALL_FRACTION
        # Each pass either returns or spends a hit (amortized O(1) per pop).
        while True:
            small, big = count[1], count[2]
            if small and (big == 0 or small >= frac * (small + big)):
                b = nxt[n + 1]
                if not hits[b]:
                    return b
                self._unlink(b)  # hit while in small: it earned main
                hits[b] = 0
                self._main[b] = True
                self._push_tail(2, b)
            else:
                b = nxt[n + 2]
                if not hits[b]:
                    return b
                self._unlink(b)
                hits[b] -= 1
                self._push_tail(2, b)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert all(self._main[b] for b in self._list(2)), "a block in main is not marked main"
        assert not any(self._main[b] for b in self._list(1)), "a block in small is marked main"


_POOL_CLASSES: dict[str, type[BlockPool]] = {
    "lru": BlockPool,
    "slru": SLRUBlockPool,
    "lfu": LFUBlockPool,
    "s3fifo": S3FIFOBlockPool,
}
assert tuple(_POOL_CLASSES) == EVICTION_POLICIES
