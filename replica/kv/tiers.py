"""The tiers behind the device KV pool, as the KV manager sees them (pure Python).

Three tiers hold a block's KV, each keyed by the block's chained hash (Contract 2 of
docs/design.md, which covers the parent chain and ``cache_salt``):

``device``
    The ``BlockPool``: what attention reads.
``host``
    The host pool's slots (pinned on CUDA), shared with swap preemption: one slot array,
    one budget. A slot holds a swapped block (ref > 0) or a cached copy of an evicted
    device block (ref 0, in the host tier's LRU order), never both twice: a hashed block
    has at most one host copy (``KVCacheManager`` docstring, "Host tier").
``disk``
    A directory of content-addressed files shared by every replica that mounts it
    (``replica/kv/disk_tier.py``), behind the ``BlockStore`` interface below so that the
    manager stays free of I/O: it asks whether a hash is stored and for a verified
    payload, and queues the copies the engine applies around the forward pass
    (``TierOps``).

The medium names are vLLM's KV-event mediums lowered ("GPU" / "CPU" in vLLM's
``BlockStored.medium``; ``disk`` for the file tier), so that KV events can carry the
tier of a block later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Media, in lookup order (the value of a tier label and of a future KV event's medium).
MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "device", "host", "disk"
TIER_MEDIA: tuple[str, ...] = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)

# A ``get_computed_blocks`` entry whose KV is in the host tier: ``allocate_slots`` gives it
# a fresh device block and queues the copy back (NULL_BLOCK, -1, is the window's entry).
TIER_BLOCK = -2


class BlockStore(Protocol):
    """A shared tier of block payloads keyed by block hash (the disk tier implements it)."""

    @property
    def enabled(self) -> bool:
        """False once the store stopped (a disk fault): every lookup is then a miss."""
        ...

    def load(self, block_hash: bytes) -> bytes | bytearray | None:
        """The verified payload stored under ``block_hash``; None on a miss (a bad file is deleted).
        It may be a buffer the store lends until the step's fills are done."""
        ...

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file for ``block_hash`` exists (not verified: ``load`` verifies)."""
        ...


@dataclass
class TierOps:
    """The tier copies one step queued, applied by the engine on every rank (each its own shard)
    in this order: ``host_stores`` (read before those slots are reused this step),
    ``host_fills``, the step's swap copies (``take_swap_ops``), the forward pass, then
    ``device_stores``. A fill carries rank 0's payload; the other ranks read theirs when the
    lookup's ``BlockStore.load`` asked them (``replica/executor/tp_disk.py``)."""

    host_stores: list[tuple[int, bytes]] = field(default_factory=list)  # (host slot, hash) -> disk
    # (host slot, hash, payload) from disk
    host_fills: list[tuple[int, bytes, bytes | bytearray]] = field(default_factory=list)
    device_stores: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, hash) -> disk

    def __bool__(self) -> bool:
        return bool(self.host_stores or self.host_fills or self.device_stores)


@dataclass(frozen=True)
class TierStats:
    """Cumulative tier counters of one KV manager (blocks unless named tokens)."""

    host_hit_tokens: int = 0  # prompt tokens whose KV came back from the host tier
    disk_hit_tokens: int = 0  # of which the host tier had read from disk first
    host_offloaded_blocks: int = 0  # evicted device blocks copied to the host tier
    host_loaded_blocks: int = 0  # host tier blocks copied back to the device
    host_evicted_blocks: int = 0  # cached host slots reused for other content
    host_dropped_blocks: int = 0  # evicted device blocks not offloaded (every host slot swapped)
    disk_read_blocks: int = 0  # disk payloads read into the host tier
    num_host_cached_blocks: int = 0  # host slots holding a cached (not swapped) copy now
