"""Per-request block tables on top of the block pool: lookup, allocate, free, fork.

The scheduler's view of the KV cache. A request's block table maps its logical
blocks (token positions ``i*block_size .. (i+1)*block_size-1``) to physical
blocks of the ``BlockPool``. With prefix caching on, every full block whose
tokens are known is registered under its chained hash (``hashing.py``), and a
new request's longest run of cached leading blocks is shared instead of
recomputed.

Invariants (``check_invariants``, on top of the pool's):
  * ref_cnt[b] == the number of block tables holding b (a table holds a block
    at most once).
  * a request with ``num_tokens`` slots holds exactly ceil(num_tokens / block_size) blocks.
  * a cached block in a table sits at the position its hash was computed for.

Choices a reader should know:
  * Lookup (``get_computed_blocks``) changes no state and never covers the whole
    prompt: the last prompt token is always computed so that it has logits.
  * Prefix queries and hits are counted in tokens when a request is *admitted*
    (its first ``allocate_slots`` succeeds), not on lookup, so a request looked up
    again and again while waiting for room is counted once.
  * Full blocks are registered when they are allocated for tokens about to be
    computed, so a request admitted in the same step can share them: the engine
    writes a step's KV before its attention reads it. The caller must therefore
    compute what it allocated, in that step.
  * A hash is never overwritten: when a newly full block's hash already maps to
    another block (two requests computed the same content concurrently), the
    existing mapping wins and the new block stays a private, uncached copy.
  * ``fork`` expects every slot of the parent to hold a known token (call it
    between steps, e.g. for parallel sampling after the prefill).
  * ``free(request_id, generated_cold=True)`` is for a finished request whose
    generated tokens no later prompt will contain (not a conversation turn): its
    blocks from the one holding the end of the prompt on enter the pool's cold end
    (``BlockPool.free_blocks_cold``). The prompt is the tokens known at the first
    ``allocate_slots`` (after a recompute preemption, what was generated before it
    counts as prompt). Off unless the caller passes it.
  * ``free(request_id, static_prefix_tokens=n)`` releases the full cached blocks of
    the prompt's first ``n`` tokens (the static prefix the request's routing key
    names) as reused (``BlockPool.mark_reused``): under ``slru`` a system prompt
    outlives every one-shot block from its first request on. Preempted requests pass
    it too.

Swap (``preemption_mode="swap"``; ``num_host_blocks`` > 0): ``swap_out`` takes a
request's table off the device without losing its KV, block by block, in table order:
  * a block others also hold (ref > 1) stays held by the swapped request: not copied
    (releasing it would free no memory, and holding it keeps it for the resume);
  * every other block is copied to a host slot and released. A block with a cached
    hash is copied once: a second swapped request with the same block shares the
    host copy (host slots are ref-counted by hash, as vLLM's CPU block allocator
    does), and the released device block stays in the pool as an evictable cached
    block that other requests may still hit.
If the host pool lacks slots for the copies, ``swap_out`` refuses (False) and changes
nothing: the caller preempts by recompute instead. ``swap_in`` rebuilds the same
table in the same order (a hashed block still cached on the device is taken from
there; the others are copied from the host into fresh blocks and cached again) and
allocates the next tokens. The (device, host) and (host, device) copies are queued
for the model runner (``take_swap_ops``): swap-outs before anything reuses those
device blocks in the same step, swap-ins before the forward pass. Host slots freed
in a step are reused only after ``take_swap_ops``.

Host tier (``host_tier=True``; vLLM's CPU offloading, SGLang's HiCache): the host slots
also keep copies of evicted device blocks, so one slot array (one budget) serves swap and
the tier (``replica/kv/tiers.py``):
  * a full, hashed block the device pool evicts (``BlockPool.evicted``) is copied to a host
    slot (a swap-out copy, applied before anything overwrites the block) unless its hash
    already has one; the slot then sits in the host tier's LRU order (ref 0, hashed);
  * a swapped slot whose last reference goes keeps its hash and joins the tier too;
  * a slot is taken from the free ones first, then from the tier's least recent end (a
    swap may evict tier copies; a tier copy never evicts a swapped block: with every
    slot swapped the evicted block is dropped, as without a tier);
  * a lookup that misses on the device continues into the host tier (and, with a
    ``disk`` store, reads the next blocks from it into host slots: ``TierOps.host_fills``),
    at most ``max_load_blocks_per_step`` blocks per step, so a large load never stalls
    the running batch (the rest of the prompt is computed); the hits are ``TIER_BLOCK``
    entries that ``allocate_slots`` turns into fresh device blocks filled by swap-in
    copies before the forward pass, registered under their hashes;
  * a slot written or read by a copy this step is pinned until ``take_swap_ops`` (one
    write per slot per step, and no read after a write of other content).
With a ``disk`` store, every block registered for tokens computed this step is queued
for the disk after the forward pass (``TierOps.device_stores``, write-behind), and a
tier slot leaving the host tier is queued before its reuse (``TierOps.host_stores``)
unless the disk holds it already. Hit tokens from the tiers count in ``cached_tokens``
(the scheduler's ``num_cached``) and in ``TierStats``, not in ``prefix_hit_tokens``
(vLLM's local-cache counter).

Retention pins (``pin_budget_blocks`` > 0; OpenAI's ``prompt_cache_retention: "24h"``;
``replica/kv/pins.py``): ``pin(request_id, owner)``, called before a request's ``free``, holds one
reference on each of its leading full cached blocks, so they survive any churn of other
requests, until the pin's time to live runs out (``expire_pins``; refreshed by every hit) or
running requests need the room (``release_pins``, before any preemption). ``ref_cnt[b]`` then
counts the pin as one more holder. A reset of the prefix cache unpins everything, and is refused
as before while a request holds a block.

Sliding window (``sliding_window``: every layer of the model attends to at most the
last ``sliding_window`` positions; vLLM's SlidingWindowManager): a position ``p``
needs keys from ``p - sliding_window + 1`` on, so once a request's next token is at
``num_tokens``, its blocks wholly before ``num_tokens - sliding_window + 1`` are
freed (``allocate_slots`` does it before allocating) and their table entries become
``NULL_BLOCK`` (-1; always a leading run, ``_Request.num_skipped`` long; kernels
never read them, the runner passes block 0 in their place). A prefix hit needs only
the blocks inside the window of its first uncomputed token: the longest hit of ``k``
blocks whose last ``ceil((sliding_window - 1) / block_size)`` blocks (all of them,
when fewer) are cached; the blocks before are NULL_BLOCK.

Pure Python, no torch and no ray: the cluster simulator runs thousands of these.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixserve.replica.kv.block_pool import BlockPool
from prefixserve.replica.kv.event_recorder import KVEventRecorder
from prefixserve.replica.kv.hashing import DEFAULT_HASH_ALGO, DEFAULT_HASH_SEED, BlockHasher, BlockKeys
from prefixserve.replica.kv.pins import PinTable
from prefixserve.replica.kv.tiers import (
    MEDIUM_DEVICE,
    MEDIUM_DISK,
    MEDIUM_HOST,
    TIER_BLOCK,
    BlockStore,
    TierOps,
    TierStats,
)


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the cache; block counts are physical blocks."""

    num_blocks: int
    block_size: int
    num_used_blocks: int  # ref > 0
    num_cached_blocks: int  # carry a hash (used or not)
    num_cached_free_blocks: int  # ref == 0 but still hit-able (evictable)
    num_free_blocks: int  # ref == 0, cached or not: all can be allocated
    usage: float  # num_used_blocks / num_blocks
    prefix_query_tokens: int  # prompt tokens of admitted requests (caching on)
    prefix_hit_tokens: int  # of which were served from cached blocks
    hit_rate: float  # prefix_hit_tokens / prefix_query_tokens (0 when no queries)
    num_evictions: int  # cached blocks popped for reuse
    num_cow_copies: int  # copy-on-write copies queued for the model runner
    num_requests: int  # requests holding a block table
    num_swapped_requests: int = 0  # requests swapped out (their tables held off the device)
    num_host_blocks: int = 0  # the swap pool's size
    num_used_host_blocks: int = 0  # host slots holding swapped blocks
    num_swapped_out_blocks: int = 0  # blocks copied device -> host, cumulative
    num_swapped_in_blocks: int = 0  # blocks copied host -> device, cumulative
    num_window_freed_blocks: int = 0  # blocks freed for lying outside the sliding window, cumulative
    num_pinned_blocks: int = 0  # held by retention pins (replica/kv/pins.py)
    num_pins_expired: int = 0  # pins whose time to live ran out, cumulative
    num_pins_released_for_room: int = 0  # pins given up so that running requests had blocks, cumulative
    tiers: TierStats = field(default_factory=TierStats)  # the host and disk tiers (host_tier=True)


@dataclass(slots=True)
class _Request:
    blocks: list[int]  # the block table
    num_tokens: int  # tokens with slots
    hashes: list[bytes]  # chained hashes of the known full blocks (caching on)
    num_registered: int  # leading full blocks already offered to the hash map
    salt: str | bytes | BlockKeys | None
    num_skipped: int = 0  # leading entries that are NULL_BLOCK (outside the sliding window)
    num_prompt_tokens: int = 0  # tokens known at the first allocate_slots: blocks past them are generated


# A swapped request's logical block is either still held on the device (block id), in a
# host slot (slot id; with the block's hash when it had one), or outside the window.
_HELD, _HOST, _SKIPPED = 0, 1, 2
# The table entry of a block freed (or never needed) because it lies outside the sliding window.
NULL_BLOCK = -1


@dataclass(slots=True)
class _Swapped:
    """A request's block table while it is swapped out (see the module docstring)."""

    entries: list[tuple[int, int, bytes | None]]  # per logical block: (_HELD, block, None) | (_HOST, slot, hash)
    num_tokens: int
    hashes: list[bytes]
    num_registered: int
    salt: str | bytes | BlockKeys | None
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class _Lookup:
    """The last lookup's hashes and hit, so the allocation right after it neither rehashes
    nor checks the hit blocks' hashes again."""

    salt: str | bytes | BlockKeys | None
    tokens: list[int]  # a private copy of the tokens the hashes cover (whole blocks)
    hashes: list[bytes]
    hit: list[int] = field(default_factory=list)  # a private copy of the blocks the lookup returned
    hash_epoch: int = -1  # the pool's hash_epoch then: the hit blocks kept their hashes while it is unchanged

    def covers(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` starts with ``tokens`` (the hashes are then its leading blocks').

        Compares without copying when ``token_ids`` is a list of exactly that length
        (a whole-block prompt): a 4,096-token copy costs more than the comparison.
        Another prompt usually differs in the last token covered: checked first.
        """
        n = len(self.tokens)
        if len(token_ids) < n or (n and token_ids[n - 1] != self.tokens[-1]):
            return False
        if len(token_ids) == n and type(token_ids) is list:
            return self.tokens == token_ids
        head = token_ids[:n]
        return self.tokens == (head if type(head) is list else list(head))


class KVCacheManager:
    """Paged KV block manager with automatic prefix caching (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = DEFAULT_HASH_ALGO,
        hash_seed: str | bytes = DEFAULT_HASH_SEED,
        eviction_policy: str = "lru",
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
        host_tier: bool = False,
        max_load_blocks_per_step: int = 512,
        disk: BlockStore | None = None,
        pin_budget_blocks: int = 0,
        pin_budget_per_owner: int | None = None,
        pin_ttl_s: float = 86400.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(hash_algo, hash_seed)  # validates the algo even when caching is off
        self.pool = BlockPool(num_blocks, eviction_policy)
        self._requests: dict[str, _Request] = {}
        self._copy_ops: list[tuple[int, int]] = []
        self._lookup: _Lookup | None = None
        self._query_tokens = 0
        self._hit_tokens = 0
        self._cow_copies = 0
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self._num_window_freed = 0
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))  # a stack: slot 0 first
        # Slots freed, written or read since the last take_swap_ops (insertion-ordered): reusable
        # (free, or the host tier's when hashed) only after it.
        self._host_pending: dict[int, None] = {}
        self._host_ref = [0] * num_host_blocks  # swapped table entries per host slot
        self._host_of_hash: dict[bytes, int] = {}  # a cached block's one host copy (shared, not duplicated)
        self._hash_of_host: dict[int, bytes] = {}
        self._swapped: dict[str, _Swapped] = {}
        self._swap_out_ops: list[tuple[int, int]] = []
        self._swap_in_ops: list[tuple[int, int]] = []
        self._swapped_out_blocks = 0
        self._swapped_in_blocks = 0
        if disk is not None and not host_tier:
            raise ValueError("a disk tier needs the host tier (its reads land in host slots)")
        if max_load_blocks_per_step < 1:
            raise ValueError(f"max_load_blocks_per_step must be >= 1, got {max_load_blocks_per_step}")
        self.host_tier = host_tier and num_host_blocks > 0 and enable_prefix_caching
        self.max_load_blocks_per_step = max_load_blocks_per_step
        self.disk = disk if self.host_tier else None
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # cached ref-0 slots, least recent first
        self._loads_this_step = 0
        self._disk_slots: set[int] = set()  # slots filled from disk not yet copied to the device
        self._tier_ops = TierOps()
        self._tier = {k: 0 for k in TierStats.__dataclass_fields__ if k != "num_host_cached_blocks"}
        if self.host_tier:
            self.pool.evicted = []
        # vLLM-format KV events (replica/kv/event_recorder.py), when the engine publishes them.
        self.events: KVEventRecorder | None = None
        # Retention pins (module docstring); None when retention is off or nothing is cached.
        self.pins: PinTable | None = None
        if pin_budget_blocks > 0 and enable_prefix_caching:
            per_owner = pin_budget_blocks if pin_budget_per_owner is None else pin_budget_per_owner
            self.pins = PinTable(min(pin_budget_blocks, num_blocks), per_owner, pin_ttl_s)
        self._clock = clock

    def record_events(self, recorder: KVEventRecorder) -> None:
        """Report every block registered, evicted or dropped from the host tier to ``recorder`` from now on."""
        self.events = recorder
        if self.pool.evicted is None:  # evictions are what BlockRemoved reports
            self.pool.evicted = []

    # --- hashing -----------------------------------------------------------

    def _memo_for(self, token_ids: Sequence[int], salt: str | bytes | BlockKeys | None) -> _Lookup | None:
        """The last lookup's memo when its hashes are those of leading blocks of ``token_ids``."""
        memo = self._lookup
        if memo is not None and memo.salt == salt and memo.covers(token_ids):
            return memo
        return None

    def _full_block_hashes(
        self, token_ids: Sequence[int], salt: str | bytes | BlockKeys | None, memo: _Lookup | None
    ) -> list[bytes]:
        """Hashes of every full block of ``token_ids``, the leading ones from ``memo`` (``_memo_for``).

        When the memo covers them all this is its own list: copy it before changing it.
        """
        bs = self.block_size
        if memo is None:
            return self.hasher.hash_blocks(token_ids, bs, salt)
        k = len(memo.hashes)
        if k == len(token_ids) // bs:
            return memo.hashes
        return memo.hashes + self.hasher.hash_blocks(
            token_ids, bs, salt, start=k, parent=memo.hashes[-1] if k else None
        )

    # --- lookup ------------------------------------------------------------

    def get_computed_blocks(
        self, token_ids: Sequence[int], cache_salt: str | bytes | BlockKeys | None = None
    ) -> tuple[list[int], int]:
        """The longest run of cached leading full blocks of a prompt, and its token count.

        Never the whole prompt (the last token must be computed for its logits).
        Changes no cache state and counts nothing; pass the blocks to the
        ``allocate_slots`` call that admits the request, before any other
        allocation (a block popped in between would make them stale).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        memo = self._memo_for(token_ids, cache_salt)
        hashes = self._full_block_hashes(token_ids, cache_salt, memo)
        if memo is None or hashes is not memo.hashes:  # else the memo already holds these
            tokens = token_ids[: len(hashes) * self.block_size]
            memo = self._lookup = _Lookup(cache_salt, tokens if type(tokens) is list else list(tokens), hashes)
        pool = self.pool
        get = pool.hash_to_block.get
        if self.sliding_window is not None:
            cached = [get(h) for h in hashes[:max_blocks]]
            if self.host_tier:
                self._window_from_tiers(cached, hashes)
            blocks, num_hit = self._window_hit(cached)
        else:
            blocks = []
            for h in hashes:  # not a slice: a copy of the hashes costs more than one lookup too many
                b = get(h)
                if b is None:
                    break
                blocks.append(b)
            del blocks[max_blocks:]
            if self.host_tier and len(blocks) < max_blocks:
                self._extend_from_tiers(blocks, hashes, max_blocks)
            num_hit = len(blocks) * self.block_size
        memo.hit, memo.hash_epoch = list(blocks), pool.hash_epoch
        return blocks, num_hit

    def _tier_has(self, h: bytes) -> bool:
        """Whether the host tier holds ``h``, reading it from the disk store into a host slot
        when only the disk does (a cache fill: it changes no device state and counts no hit).
        A slot found is pinned for the step (a later disk read in this lookup must not evict
        it) and rejoins the LRU order at its recent end."""
        slot = self._host_of_hash.get(h)
        if slot is not None:
            if slot in self._host_lru:
                del self._host_lru[slot]
                self._host_pending[slot] = None
            return True
        disk = self.disk
        if disk is None or not disk.enabled:
            return False
        if self._loads_this_step >= self.max_load_blocks_per_step or not (self._host_free or self._host_lru):
            return False
        payload = disk.load(h)
        if payload is None:
            return False
        slot = self._take_host_slot()
        assert slot is not None, "checked above: a free or cached slot exists"
        self._host_of_hash[h] = slot
        self._hash_of_host[slot] = h
        self._host_pending[slot] = None
        self._tier_ops.host_fills.append((slot, h, payload))
        if self.events is not None:
            self.events.stored([h], None, (), 0, MEDIUM_HOST)
        self._disk_slots.add(slot)
        self._loads_this_step += 1
        self._tier["disk_read_blocks"] += 1
        return True

    def _extend_from_tiers(self, blocks: list[int], hashes: list[bytes], max_blocks: int) -> None:
        """Continue a device hit run with device or host-tier blocks, within the step's load budget."""
        get = self.pool.hash_to_block.get
        budget = self.max_load_blocks_per_step - self._loads_this_step
        for i in range(len(blocks), max_blocks):
            h = hashes[i]
            b = get(h)
            if b is not None:
                blocks.append(b)
            elif budget > 0 and self._tier_has(h):
                blocks.append(TIER_BLOCK)
                budget -= 1
            else:
                return

    def _window_from_tiers(self, cached: list[int | None], hashes: list[bytes]) -> None:
        """Fill device misses of a sliding-window lookup with host-tier entries, within the budget."""
        budget = self.max_load_blocks_per_step - self._loads_this_step
        for i, b in enumerate(cached):
            if b is None and budget > 0 and self._tier_has(hashes[i]):
                cached[i] = TIER_BLOCK
                budget -= 1

    def _window_hit(self, cached: list[int | None]) -> tuple[list[int], int]:
        """vLLM's sliding-window hit: the longest ``k`` whose last ``need`` blocks are cached."""
        assert self.sliding_window is not None
        need = -(-(self.sliding_window - 1) // self.block_size)
        best, run = 0, 0
        for i, b in enumerate(cached):
            run = run + 1 if b is not None else 0
            if run >= need or run == i + 1:
                best = i + 1
        keep = min(best, need)
        blocks = [NULL_BLOCK] * (best - keep) + [b for b in cached[best - keep : best] if b is not None]
        return blocks, best * self.block_size

    # --- allocation --------------------------------------------------------

    def _plan(self, request_id: str, num_new_tokens: int, computed_blocks: Sequence[int]) -> tuple[int, bool]:
        """(new blocks for growth, copy-on-write?): with the revived hits (``_num_revived``),
        the blocks ``allocate_slots`` takes from the free pool."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        req = self._requests.get(request_id)
        if req is None:
            if computed_blocks and not self.enable_prefix_caching:
                raise ValueError("computed_blocks given but prefix caching is off")
            held = len(computed_blocks)
            num_tokens = held * bs
            cow = False
        else:
            if computed_blocks:
                raise ValueError(
                    f"request {request_id!r} already has a block table; "
                    "computed_blocks belong to its first allocate_slots only"
                )
            held = len(req.blocks)
            num_tokens = req.num_tokens
            # Writing into a partial last block that a fork shares: copy it first.
            cow = num_new_tokens > 0 and num_tokens % bs != 0 and self.pool.ref_cnt[req.blocks[-1]] > 1
        total = num_tokens + num_new_tokens
        return max(0, -(-total // bs) - held), cow

    def _num_revived(self, computed_blocks: Sequence[int]) -> int:
        """Hit blocks that are free now: attaching them takes them off the free pool."""
        ref = self.pool.ref_cnt
        return sum(1 for b in computed_blocks if b == TIER_BLOCK or (b >= 0 and ref[b] == 0))

    def num_blocks_needed(self, request_id: str, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks ``allocate_slots`` would consume (growth, copy-on-write, revived hits)."""
        grow, cow = self._plan(request_id, num_new_tokens, computed_blocks)
        return grow + cow + self._num_revived(computed_blocks)

    def can_allocate(self, request_id: str, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now."""
        return self.num_blocks_needed(request_id, num_new_tokens, computed_blocks) <= self.pool.num_free

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        cache_salt: str | bytes | BlockKeys | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the whole block table.

        ``token_ids`` are all the request's tokens known so far. On the first call
        ``computed_blocks`` (from ``get_computed_blocks``) are attached and count
        as already computed::

            | computed_blocks | already slotted | num_new_tokens |  (free space)
            0          first call only         num_tokens      num_tokens + new
                                  full blocks of known tokens in here get registered

        Returns None and changes nothing when the free blocks are too few.
        ``cache_salt`` matters on the first call only (it is the request's).
        """
        req = self._requests.get(request_id)
        if req is not None and self.sliding_window is not None:
            self._free_outside_window(req)
        grow, cow = self._plan(request_id, num_new_tokens, computed_blocks)
        pool = self.pool
        hashes: list[bytes] = []
        if req is None and self.enable_prefix_caching:
            memo = self._memo_for(token_ids, cache_salt)
            hashes = self._full_block_hashes(token_ids, cache_salt, memo)
            if memo is not None and hashes is memo.hashes:
                hashes = list(hashes)  # the request extends its own list (_register)
            if len(computed_blocks) > len(hashes):
                raise ValueError("computed_blocks cover more full blocks than token_ids has")
            # Blocks the lookup of these hashes returned, with no hash lost since (no eviction, no
            # reset), still carry them; other blocks are checked one by one.
            if memo is None or memo.hash_epoch != pool.hash_epoch or memo.hit != computed_blocks:
                bhash = pool.block_hash
                for i, b in enumerate(computed_blocks):
                    if b >= 0 and bhash[b] != hashes[i]:
                        raise ValueError(
                            f"computed block {b} no longer holds block {i} of this prompt: "
                            "call get_computed_blocks right before allocate_slots"
                        )
        # Counting every hit as revived bounds the need: the exact count only when the bound does not fit.
        free = pool.num_free
        if grow + cow + len(computed_blocks) > free and grow + cow + self._num_revived(computed_blocks) > free:
            return None
        if req is None:
            num_tier = computed_blocks.count(TIER_BLOCK) if self.host_tier else 0
            if self.enable_prefix_caching:
                self._query_tokens += len(token_ids)
                self._hit_tokens += (len(computed_blocks) - num_tier) * self.block_size
            # Hits leave the free queue before new blocks are popped, so none is evicted.
            skipped = computed_blocks.count(NULL_BLOCK)
            pool.touch([b for b in computed_blocks if b >= 0] if skipped or num_tier else computed_blocks)
            if self.pins:
                now, bhash = self._clock(), pool.block_hash
                for b in computed_blocks:
                    if b >= 0 and (h := bhash[b]) is not None:
                        self.pins.refresh(h, now)
            held = len(computed_blocks)
            req = _Request(
                list(computed_blocks), held * self.block_size, hashes, held, cache_salt, skipped, len(token_ids)
            )
            self._requests[request_id] = req
            if num_tier:
                self._load_from_host(req, token_ids)
        if cow:
            src = req.blocks[-1]
            (dst,) = self._pop_blocks(1)
            req.blocks[-1] = dst
            pool.free_blocks((src,))  # ref stays > 0: the other sharers keep it
            self._copy_ops.append((src, dst))
            self._cow_copies += 1
        if grow:
            req.blocks += self._pop_blocks(grow)
        req.num_tokens += num_new_tokens
        if self.enable_prefix_caching:
            self._register(req, token_ids)
        return list(req.blocks)

    def register_known(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer the request's full blocks whose tokens became known since its last allocation
        (asynchronous scheduling allocates a placeholder's slot before its token exists); the
        hash map then holds what a synchronous engine's would."""
        req = self._requests.get(request_id)
        if req is not None and self.enable_prefix_caching:
            self._register(req, token_ids)

    def _register(self, req: _Request, token_ids: Sequence[int]) -> None:
        """Offer the request's newly full, known blocks to the hash map."""
        bs = self.block_size
        known = min(req.num_tokens, len(token_ids)) // bs
        start = req.num_registered
        if known <= start:
            return
        hashes = req.hashes
        if len(hashes) < known:
            hashes += self.hasher.hash_blocks(
                token_ids, bs, req.salt, start=len(hashes), stop=known, parent=hashes[-1] if hashes else None
            )
        # Duplicate content (hash already mapped elsewhere) is skipped: the old mapping stays.
        start = max(start, req.num_skipped)
        if start < known:
            self.pool.cache_blocks(req.blocks[start:known], hashes[start:known])
            if self.events is not None:
                self._note_stored(hashes, range(start, known), req.blocks[start:known], token_ids)
            if self.disk is not None and self.disk.enabled:
                bhash = self.pool.block_hash
                self._tier_ops.device_stores += (
                    (b, h) for b, h in zip(req.blocks[start:known], hashes[start:known]) if bhash[b] == h
                )
        req.num_registered = known

    def _note_stored(
        self, hashes: Sequence[bytes], idx: Sequence[int], blocks: Sequence[int], token_ids: Sequence[int]
    ) -> None:
        """Report the request's blocks ``idx`` (ascending; in ``blocks``) that now hold their hash: one
        ``BlockStored`` per consecutive run (a hash already held by another block stays that block's)."""
        assert self.events is not None
        bhash, bs = self.pool.block_hash, self.block_size
        run: list[int] = []
        for i, b in [*zip(idx, blocks, strict=True), (-1, -1)]:
            if run and (b < 0 or i != run[-1] + 1 or bhash[b] != hashes[i]):
                first = run[0]
                parent = hashes[first - 1] if first else None
                self.events.stored([hashes[j] for j in run], parent, token_ids[first * bs : (run[-1] + 1) * bs], bs)
                run = []
            if b >= 0 and bhash[b] == hashes[i]:
                run.append(i)

    # --- host tier ---------------------------------------------------------

    def _pop_blocks(self, n: int) -> list[int]:
        """``pool.get_new_blocks``; with the host tier, the hashed blocks it evicted are offloaded."""
        out = self.pool.get_new_blocks(n)
        evicted = self.pool.evicted
        if evicted:
            if self.events is not None:
                self.events.removed([h for _, h in evicted])
            if self.host_tier:
                self._offload(evicted)
            evicted.clear()
        return out

    def _offload(self, evicted: list[tuple[int, bytes]]) -> None:
        """Queue a host copy of each evicted (block, hash) not in the host tier yet."""
        host_of = self._host_of_hash
        for b, h in evicted:
            if h in host_of:
                continue
            slot = self._take_host_slot()
            if slot is None:
                self._tier["host_dropped_blocks"] += 1
                continue
            self._swap_out_ops.append((b, slot))
            host_of[h] = slot
            self._hash_of_host[slot] = h
            self._host_pending[slot] = None
            self._tier["host_offloaded_blocks"] += 1
            if self.events is not None:
                self.events.stored([h], None, (), 0, MEDIUM_HOST)

    def _take_host_slot(self) -> int | None:
        """A host slot to write this step: a free one, else the tier's least recent copy (queued
        for the disk first when the disk lacks it); None when every slot is swapped or pinned."""
        if self._host_free:
            return self._host_free.pop()
        if not self._host_lru:
            return None
        slot, _ = self._host_lru.popitem(last=False)
        h = self._hash_of_host.pop(slot)
        del self._host_of_hash[h]
        if self.events is not None:
            self.events.removed([h], MEDIUM_HOST)
        self._disk_slots.discard(slot)
        self._tier["host_evicted_blocks"] += 1
        disk = self.disk
        if disk is not None and disk.enabled and not disk.contains(h):
            self._tier_ops.host_stores.append((slot, h))
        return slot

    def _ref_host_slot(self, slot: int) -> None:
        """One more swapped entry holds ``slot`` (a tier copy it holds leaves the LRU order)."""
        self._host_ref[slot] += 1
        self._host_lru.pop(slot, None)

    def _load_from_host(self, req: _Request, token_ids: Sequence[int]) -> None:
        """Fresh device blocks for the request's ``TIER_BLOCK`` entries, filled from their host slots."""
        idx = [i for i, b in enumerate(req.blocks) if b == TIER_BLOCK]
        slots = [self._host_of_hash[req.hashes[i]] for i in idx]
        for slot in slots:  # pinned before any block is popped: an offload must not reuse them
            self._host_lru.pop(slot, None)
            self._host_pending[slot] = None
        fresh = self._pop_blocks(len(idx))
        bs = self.block_size
        for i, slot, dst in zip(idx, slots, fresh):
            req.blocks[i] = dst
            self._swap_in_ops.append((slot, dst))
            if slot in self._disk_slots:
                self._disk_slots.discard(slot)
                self._tier["disk_hit_tokens"] += bs
        self.pool.cache_blocks(fresh, [req.hashes[i] for i in idx])
        if self.events is not None:
            self._note_stored(req.hashes, idx, fresh, token_ids)
        self._loads_this_step += len(idx)
        self._tier["host_loaded_blocks"] += len(idx)
        self._tier["host_hit_tokens"] += len(idx) * bs

    def take_tier_ops(self) -> TierOps:
        """The disk copies queued since the last call (``TierOps``; empty without a disk store)."""
        ops, self._tier_ops = self._tier_ops, TierOps()
        return ops

    # --- release, sharing --------------------------------------------------

    def free(self, request_id: str, generated_cold: bool = False, static_prefix_tokens: int = 0) -> bool:
        """Release a request's blocks tail-first (or its swapped table); False when it held no table.

        ``generated_cold``: the request finished and its generated tokens will not
        be part of a later prompt (not a conversation turn): the blocks from the one
        holding the end of the prompt on (``pool.free_blocks_cold``) enter at the
        pool's cold end, evicted before the blocks other requests left cached. Not
        for a preempted request (it comes back for them).
        ``static_prefix_tokens``: the prompt's leading tokens that later requests
        share (its static prefix, Contract 1): its full cached blocks are released
        as reused (``pool.mark_reused``), also on the request's first sight of them.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return self.discard_swapped(request_id)
        if static_prefix_tokens > 0:
            n = min(static_prefix_tokens // self.block_size, req.num_registered, len(req.blocks))
            if n > req.num_skipped:
                self.pool.mark_reused(req.blocks[req.num_skipped : n])
        if generated_cold:
            cut = max(req.num_prompt_tokens // self.block_size, req.num_skipped)
            self.pool.free_blocks_cold(reversed(req.blocks[cut:]))
            self.pool.free_blocks(reversed(req.blocks[req.num_skipped : cut]))
        else:
            self.pool.free_blocks(reversed(req.blocks[req.num_skipped :] if req.num_skipped else req.blocks))
        return True

    # --- retention pins ----------------------------------------------------

    def can_pin(self, request_id: str, owner: str) -> bool:
        """Whether the pin budget holds ``owner`` pinning every full prompt block of the request
        (which has a table) that is not pinned already."""
        pins = self.pins
        if pins is None:
            return False
        req = self._requests[request_id]
        full = req.hashes[: req.num_prompt_tokens // self.block_size]
        return sum(1 for h in full if h not in pins) <= pins.room(owner)

    def pin(self, request_id: str, owner: str) -> int:
        """Pin the request's leading full cached blocks for ``owner``, refreshing those already
        pinned, as many as the budget holds (the chain's head first: a prefix is only a hit from
        its start). Call before ``free``. Returns the number newly pinned."""
        pins, req = self.pins, self._requests.get(request_id)
        if pins is None or req is None:
            return 0
        now, pool, added = self._clock(), self.pool, 0
        for h in req.hashes[req.num_skipped : req.num_registered]:
            if pins.refresh(h, now):
                continue
            # This table's block, or the one the hash map kept when this one is a private copy.
            block = pool.get_cached_block(h)
            if block is None or pins.room(owner) == 0:
                break
            pool.touch((block,))
            pins.add(h, block, owner, now)
            added += 1
        return added

    def expire_pins(self) -> int:
        """Unpin the pins whose time to live ran out (their blocks become evictable); how many."""
        if not self.pins:
            return 0
        blocks = self.pins.pop_expired(self._clock())
        self.pool.free_blocks(blocks)
        return len(blocks)

    def release_pins(self, num_blocks: int) -> int:
        """Unpin up to ``num_blocks`` pins whose block nothing else holds, least recently
        refreshed first, so that their blocks can be allocated (evicted to the host tier when
        there is one); how many."""
        if not self.pins or num_blocks < 1:
            return 0
        ref = self.pool.ref_cnt
        blocks = self.pins.pop_oldest(num_blocks, lambda pin: ref[pin.block] == 1)
        self.pool.free_blocks(blocks)
        return len(blocks)

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Give ``child_id`` the parent's table, sharing every block (ref+1); returns it."""
        if child_id in self._requests:
            raise ValueError(f"fork target {child_id!r} already has a block table; free it first")
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"fork source {parent_id!r} has no block table")
        self.pool.touch(parent.blocks[parent.num_skipped :])
        self._requests[child_id] = _Request(
            list(parent.blocks),
            parent.num_tokens,
            list(parent.hashes),
            parent.num_registered,
            parent.salt,
            parent.num_skipped,
            parent.num_prompt_tokens,
        )
        return list(parent.blocks)

    def _free_outside_window(self, req: _Request) -> None:
        """Free the blocks wholly before the window of the request's next token (``num_tokens``)."""
        assert self.sliding_window is not None
        first_needed = max(0, req.num_tokens - self.sliding_window + 1) // self.block_size
        if first_needed <= req.num_skipped:
            return
        freed = req.blocks[req.num_skipped : first_needed]
        req.blocks[req.num_skipped : first_needed] = [NULL_BLOCK] * len(freed)
        req.num_skipped = first_needed
        self._num_window_freed += len(freed)
        self.pool.free_blocks(reversed(freed))

    # --- swap ---------------------------------------------------------------

    def swap_out(self, request_id: str) -> bool:
        """Take a request's table off the device (module docstring); False, changing nothing,
        when the host pool has too few free slots for the blocks it must copy."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"swap_out: {request_id!r} has no block table")
        pool = self.pool
        ref, bhash = pool.ref_cnt, pool.block_hash
        host_of = self._host_of_hash
        live = req.blocks[req.num_skipped :]
        needed = sum(1 for b in live if ref[b] == 1 and (bhash[b] is None or bhash[b] not in host_of))
        if needed > len(self._host_free) + len(self._host_lru):
            return False
        entries: list[tuple[int, int, bytes | None]] = [(_SKIPPED, NULL_BLOCK, None)] * req.num_skipped
        released: list[int] = []
        for b in live:
            if ref[b] > 1:
                entries.append((_HELD, b, None))
                continue
            h = bhash[b]
            slot = host_of.get(h) if h is not None else None
            if slot is None:
                slot = self._take_host_slot()
                assert slot is not None, "swap_out counted the slots it needs"
                self._swap_out_ops.append((b, slot))
                self._swapped_out_blocks += 1
                if h is not None:
                    host_of[h] = slot
                    self._hash_of_host[slot] = h
            self._ref_host_slot(slot)
            entries.append((_HOST, slot, h))
            released.append(b)
        del self._requests[request_id]
        pool.free_blocks(reversed(released))
        self._swapped[request_id] = _Swapped(
            entries, req.num_tokens, req.hashes, req.num_registered, req.salt, req.num_prompt_tokens
        )
        return True

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def _release_host_slot(self, slot: int) -> None:
        self._host_ref[slot] -= 1
        if self._host_ref[slot] == 0:
            if not self.host_tier:  # with the tier a hashed slot stays cached (take_swap_ops)
                h = self._hash_of_host.pop(slot, None)
                if h is not None:
                    del self._host_of_hash[h]
            self._host_pending[slot] = None

    def discard_swapped(self, request_id: str) -> bool:
        """Drop a swapped request's table (held blocks freed, host slots returned); False if not swapped."""
        sw = self._swapped.pop(request_id, None)
        if sw is None:
            return False
        self.pool.free_blocks(reversed([v for kind, v, _ in sw.entries if kind == _HELD]))
        for kind, slot, _ in sw.entries:
            if kind == _HOST:
                self._release_host_slot(slot)
        return True

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int) -> list[int] | None:
        """Restore a swapped request's table (same order) and allocate ``num_new_tokens`` more
        slots, as ``allocate_slots`` does; None, changing nothing, when free blocks are too few.

        A swapped block whose hash is still cached on the device is taken from there (no
        copy); the others are copied from their host slots into fresh blocks, which are
        registered under their hash again.
        """
        sw = self._swapped[request_id]
        pool = self.pool
        h2b, ref = pool.hash_to_block, pool.ref_cnt
        on_device: dict[int, int] = {}  # entry index -> cached device block
        num_copies = 0
        for i, (kind, _, h) in enumerate(sw.entries):
            if kind != _HOST:
                continue
            b = h2b.get(h) if h is not None else None
            if b is None:
                num_copies += 1
            else:
                on_device[i] = b
        bs = self.block_size
        revive = sum(1 for b in on_device.values() if ref[b] == 0)
        grow = max(0, -(-(sw.num_tokens + num_new_tokens) // bs) - len(sw.entries))
        last_kind, last, _ = sw.entries[-1] if sw.entries else (_HOST, 0, None)
        cow = num_new_tokens > 0 and sw.num_tokens % bs != 0 and last_kind == _HELD and ref[last] > 1
        if revive + num_copies + grow + cow > pool.num_free:
            return None
        del self._swapped[request_id]
        pool.touch(list(on_device.values()))  # before any new block is popped, so none of them is evicted
        fresh = iter(self._pop_blocks(num_copies))
        blocks: list[int] = []
        recached: list[tuple[int, bytes]] = []
        recached_idx: list[int] = []  # their logical block indexes
        for i, (kind, v, h) in enumerate(sw.entries):
            if kind != _HOST:  # held, or NULL_BLOCK outside the window
                blocks.append(v)
                continue
            if i in on_device:
                blocks.append(on_device[i])
            else:
                dst = next(fresh)
                self._swap_in_ops.append((v, dst))
                self._swapped_in_blocks += 1
                blocks.append(dst)
                if h is not None:
                    recached.append((dst, h))
                    recached_idx.append(i)
            self._release_host_slot(v)
        if recached:
            pool.cache_blocks([b for b, _ in recached], [h for _, h in recached])
            if self.events is not None:
                self._note_stored(sw.hashes, recached_idx, [b for b, _ in recached], token_ids)
        skipped = sum(1 for kind, _, _ in sw.entries if kind == _SKIPPED)
        self._requests[request_id] = _Request(
            blocks, sw.num_tokens, sw.hashes, sw.num_registered, sw.salt, skipped, sw.num_prompt_tokens
        )
        table = self.allocate_slots(request_id, token_ids, num_new_tokens)
        assert table is not None, "swap_in counted the blocks allocate_slots needs"
        return table

    def take_swap_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(device block, host slot) swap-out copies and (host slot, device block) swap-in copies
        queued since the last call; the runner applies the swap-outs first. Host slots freed
        since the last call become reusable now."""
        out, into = self._swap_out_ops, self._swap_in_ops
        self._swap_out_ops, self._swap_in_ops = [], []
        ref, hashed, lru = self._host_ref, self._hash_of_host, self._host_lru
        for slot in reversed(self._host_pending):
            if ref[slot]:
                continue  # swapped again since: held
            if slot in hashed:
                lru[slot] = None
                lru.move_to_end(slot)
            else:
                self._host_free.append(slot)
        self._host_pending = {}
        self._loads_this_step = 0
        return out, into

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Copy-on-write copies (src, dst) queued since the last call; the runner copies them."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, the host tier's too, unpinning every block; refused (False)
        while a request holds a block."""
        if self.pins:
            ref = self.pool.ref_cnt
            if self.pool.num_used > sum(1 for _, pin in self.pins.items() if ref[pin.block] == 1):
                return False
            self.pool.free_blocks(self.pins.pop_all())
        if not self.pool.reset_prefix_cache():
            return False
        if self.events is not None:
            self.events.cleared()
        for slot in list(self._host_lru):
            del self._host_of_hash[self._hash_of_host.pop(slot)]
            self._host_free.append(slot)
        self._host_lru.clear()
        self._disk_slots.clear()
        return True

    # --- queries -----------------------------------------------------------

    def tier_medium(self, block_hash: bytes) -> str | None:
        """The tier behind the device pool that holds ``block_hash`` (host, then disk), or None.

        Reads only (a dict lookup, the disk tier's known-hash set), so the routing-stats thread may ask
        while the engine steps: the KV events' medium of a block the device lacks.
        """
        if block_hash in self._host_of_hash:
            return MEDIUM_HOST
        disk = self.disk
        if disk is not None and disk.enabled and disk.contains(block_hash):
            return MEDIUM_DISK
        return None

    def hot_blocks(self) -> list[tuple[str, int, bytes]]:
        """Every cached block as (medium, device block or host slot, hash), the most reused first.

        The order the tiers would keep them in: device blocks in use, then the pool's free
        cached blocks from the last evicted back to the next (the reverse of its eviction
        order, so a chain's head, freed last, comes before its tail), then the host tier's
        cached slots from the most recently used. O(cached blocks); for a drain's save.
        """
        pool = self.pool
        out = [(MEDIUM_DEVICE, b, h) for b, h in enumerate(pool.block_hash) if h is not None and pool.ref_cnt[b] > 0]
        out += [(MEDIUM_DEVICE, b, h) for b in reversed(pool.free_queue()) if (h := pool.block_hash[b]) is not None]
        out += [(MEDIUM_HOST, slot, self._hash_of_host[slot]) for slot in reversed(self._host_lru)]
        return out

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (KeyError if it has none)."""
        return list(self._requests[request_id].blocks)

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request has slots for (KeyError if it has no table)."""
        return self._requests[request_id].num_tokens

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0, cached or not: all of them can be allocated."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref > 0), 0..1."""
        return self.pool.num_used / self.pool.num_blocks

    @property
    def stats(self) -> KVCacheStats:
        pool = self.pool
        q, h = self._query_tokens, self._hit_tokens
        idle = [s for s in self._host_pending if not self._host_ref[s]]
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_used_blocks=pool.num_used,
            num_cached_blocks=len(pool.hash_to_block),
            num_cached_free_blocks=pool.num_cached_free,
            num_free_blocks=pool.num_free,
            usage=pool.num_used / pool.num_blocks,
            prefix_query_tokens=q,
            prefix_hit_tokens=h,
            hit_rate=h / q if q else 0.0,
            num_evictions=pool.num_evictions,
            num_cow_copies=self._cow_copies,
            num_requests=len(self._requests),
            num_swapped_requests=len(self._swapped),
            num_host_blocks=self.num_host_blocks,
            num_used_host_blocks=self.num_host_blocks - len(self._host_free) - len(self._host_lru) - len(idle),
            num_swapped_out_blocks=self._swapped_out_blocks,
            num_swapped_in_blocks=self._swapped_in_blocks,
            num_window_freed_blocks=self._num_window_freed,
            num_pinned_blocks=len(self.pins) if self.pins is not None else 0,
            num_pins_expired=self.pins.num_expired if self.pins is not None else 0,
            num_pins_released_for_room=self.pins.num_released_for_room if self.pins is not None else 0,
            tiers=TierStats(
                **self._tier,
                num_host_cached_blocks=len(self._host_lru) + sum(1 for s in idle if s in self._hash_of_host),
            ),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant (module docstrings) fails."""
        pool = self.pool
        pool.check_invariants()
        bs = self.block_size
        holders = [0] * pool.num_blocks
        for rid, req in self._requests.items():
            assert len(req.blocks) == -(-req.num_tokens // bs), (
                f"{rid}: {len(req.blocks)} blocks for {req.num_tokens} tokens"
            )
            skipped, live = req.blocks[: req.num_skipped], req.blocks[req.num_skipped :]
            assert all(b == NULL_BLOCK for b in skipped) and NULL_BLOCK not in live, (
                f"{rid}: NULL_BLOCK entries must be exactly the leading {req.num_skipped}"
            )
            assert self.sliding_window is not None or not skipped, f"{rid} skips blocks without a window"
            assert len(set(live)) == len(live), f"{rid} holds a block twice"
            assert req.num_registered <= len(req.blocks), f"{rid} registered blocks it does not hold"
            for i, b in enumerate(req.blocks):
                if b == NULL_BLOCK:
                    continue
                holders[b] += 1
                h = pool.block_hash[b]
                if h is not None:
                    assert i < len(req.hashes) and req.hashes[i] == h, (
                        f"{rid}: block {b} at position {i} carries a hash of other content"
                    )
        host_used: list[int] = []
        for rid, sw in self._swapped.items():
            assert rid not in self._requests, f"{rid} is both swapped and on the device"
            assert len(sw.entries) == -(-sw.num_tokens // bs), f"{rid}: swapped table does not fit its tokens"
            for kind, v, _ in sw.entries:
                if kind == _HELD:
                    holders[v] += 1
                elif kind == _HOST:
                    host_used.append(v)
        for slot in range(self.num_host_blocks):
            assert self._host_ref[slot] == host_used.count(slot), f"host slot {slot}: wrong ref count"
        used = set(host_used)
        idle = [s for s in self._host_pending if s not in used]
        host_all = sorted(used) + self._host_free + idle + list(self._host_lru)
        assert sorted(host_all) == list(range(self.num_host_blocks)), "host slots lost or double-booked"
        assert all(self._host_ref[s] == 0 and s in self._hash_of_host for s in self._host_lru), (
            "the host tier's LRU holds a swapped or unhashed slot"
        )
        assert self.host_tier or not self._host_lru, "host tier entries without a host tier"
        for h, slot in self._host_of_hash.items():
            assert self._hash_of_host.get(slot) == h, "host hash map out of sync"
            assert self._host_ref[slot] > 0 or (self.host_tier and (slot in self._host_lru or slot in idle)), (
                f"host slot {slot} is hashed but neither swapped nor in the host tier"
            )
        if self.pins is not None:
            self.pins.check_invariants()
            for h, pin in self.pins.items():
                assert pool.block_hash[pin.block] == h, f"pinned block {pin.block} lost its hash"
                holders[pin.block] += 1
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == holders[b], f"block {b}: ref {pool.ref_cnt[b]} but {holders[b]} holders"
        if not self.enable_prefix_caching:
            assert not pool.hash_to_block, "prefix caching is off but blocks carry hashes"
