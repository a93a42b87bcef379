"""Which replicas hold which KV blocks, from vLLM-format KV events (replica/contract/vllm_kv_events.py).

Job: the router-side state behind KV-aware routing over vLLM servers (or our replicas
publishing the same format): ``apply(replica, batch)`` folds one event batch in,
``longest_prefix(block_hashes)`` answers, per replica, how many of a request's leading
blocks it holds. ``BlockStored`` adds each hash for the replica in its medium (``GPU`` when
absent), ``BlockRemoved`` takes it out of that medium, ``AllBlocksCleared`` forgets the
replica's blocks. Hashes are kept in vLLM's int form (``normalize_block_hash``), so bytes
and int publishers and bytes digests from router/kv_index/vllm_hashes.py all meet.

Bounded: at most ``max_entries`` (hash, replica) pairs. Past it the least recently stored
hashes go first, all their replicas with them: the index then under-claims, which only
costs a cache hit, never sends a request where its prefix is not.

Ordering (``SequenceTracker``): each replica's batches carry a sequence number. The
subscriber asks the tracker what a new one means: the next one (apply it), a gap (fetch
the missing ones from the replay socket first, or, when they cannot be had, forget the
replica and start over from this one: a view with holes would over-claim) or one at or
below the last (a restarted publisher counts from 0 again: forget the replica first).

Pure: no sockets. One lock makes ``apply`` and the queries atomic (the subscriber thread
applies while routing threads ask).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from prefixserve.replica.contract.vllm_kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    normalize_block_hash,
)


@dataclass
class IndexStats:
    """Counters of what the index saw (cumulative)."""

    batches: int = 0
    stored: int = 0  # (hash, replica, medium) additions
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared events and replicas forgotten
    evicted: int = 0  # (hash, replica) pairs dropped for the bound
    invalid_hashes: int = 0  # hashes neither bytes nor int, skipped


@dataclass
class _Holders:
    """The replicas holding one hash, each with its media."""

    media: dict[str, set[str]] = field(default_factory=dict)


class KVEventIndex:
    """Block hash -> replicas (per medium), from KV event batches; bounded (the module docstring)."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._blocks: OrderedDict[int, _Holders] = OrderedDict()  # least recently stored first
        self._per_replica: dict[str, set[int]] = {}
        self._entries = 0  # (hash, replica) pairs
        self._lock = threading.Lock()
        self.stats = IndexStats()

    def __len__(self) -> int:
        """The (hash, replica) pairs held: at most ``max_entries``."""
        return self._entries

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(r for r, hashes in self._per_replica.items() if hashes)

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return len(self._per_replica.get(replica, ()))

    # --- updates -----------------------------------------------------------------

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        """Fold one batch's events in, in order."""
        with self._lock:
            self.stats.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._store(replica, event.block_hashes, event.medium or MEDIUM_GPU)
                elif isinstance(event, BlockRemoved):
                    self._remove(replica, event.block_hashes, event.medium or MEDIUM_GPU)
                elif isinstance(event, AllBlocksCleared):
                    self.stats.cleared += 1
                    self._forget(replica)

    def forget(self, replica: str) -> None:
        """Drop everything known of ``replica`` (gone, restarted, or its stream lost events)."""
        with self._lock:
            self.stats.cleared += 1
            self._forget(replica)

    def _valid(self, hashes: Iterable[object]) -> Iterator[int]:
        """The hashes as ints, in order; one that is not a block hash is counted and skipped."""
        for raw in hashes:
            h = normalize_block_hash(raw)
            if h is None:
                self.stats.invalid_hashes += 1
            else:
                yield h

    def _store(self, replica: str, hashes: Iterable[object], medium: str) -> None:
        blocks, mine = self._blocks, self._per_replica.setdefault(replica, set())
        for h in self._valid(hashes):
            holders = blocks.get(h)
            if holders is None:
                holders = blocks[h] = _Holders()
            else:
                blocks.move_to_end(h)
            media = holders.media.get(replica)
            if media is None:
                media = holders.media[replica] = set()
                mine.add(h)
                self._entries += 1
            if medium not in media:
                media.add(medium)
                self.stats.stored += 1
        while self._entries > self.max_entries:
            h, holders = blocks.popitem(last=False)
            for r in holders.media:
                self._per_replica[r].discard(h)
            self._entries -= len(holders.media)
            self.stats.evicted += len(holders.media)

    def _remove(self, replica: str, hashes: Iterable[object], medium: str) -> None:
        blocks = self._blocks
        for h in self._valid(hashes):
            holders = blocks.get(h)
            media = holders.media.get(replica) if holders is not None else None
            if holders is None or media is None or medium not in media:
                continue  # never stored, or already evicted for the bound
            media.discard(medium)
            self.stats.removed += 1
            if not media:
                self._drop(h, holders, replica)

    def _drop(self, h: int, holders: _Holders, replica: str) -> None:
        del holders.media[replica]
        self._per_replica[replica].discard(h)
        self._entries -= 1
        if not holders.media:
            del self._blocks[h]

    def _forget(self, replica: str) -> None:
        hashes = self._per_replica.pop(replica, set())
        for h in hashes:
            holders = self._blocks[h]
            del holders.media[replica]
            self._entries -= 1
            if not holders.media:
                del self._blocks[h]

    # --- queries -----------------------------------------------------------------

    def holders(self, block_hash: object) -> dict[str, frozenset[str]]:
        """The replicas holding ``block_hash`` (bytes or int), each with its media."""
        h = normalize_block_hash(block_hash)
        with self._lock:
            holders = self._blocks.get(h) if h is not None else None
            return {} if holders is None else {r: frozenset(m) for r, m in holders.media.items()}

    def longest_prefix(self, block_hashes: Sequence[object], media: Collection[str] | None = None) -> dict[str, int]:
        """Per replica holding block 0, how many leading blocks of ``block_hashes`` it holds in any of
        ``media`` (all media when None). Replicas holding none are absent."""
        out: dict[str, int] = {}
        with self._lock:
            alive: set[str] | None = None
            for n, raw in enumerate(block_hashes):
                h = normalize_block_hash(raw)
                holders = self._blocks.get(h) if h is not None else None
                if holders is None:
                    break
                here = {r for r, m in holders.media.items() if media is None or not m.isdisjoint(media)}
                alive = here if alive is None else alive & here
                if not alive:
                    break
                for r in alive:
                    out[r] = n + 1
        return out


class Verdict(Enum):
    """What a replica's next sequence number means (``SequenceTracker.check``)."""

    NEXT = "next"  # apply it
    GAP = "gap"  # batches are missing before it: replay them first
    RESTART = "restart"  # at or below the last one: the publisher started over


@dataclass
class SequenceTracker:
    """Each replica's last applied sequence number; a new one's ``Verdict``."""

    _last: dict[str, int] = field(default_factory=dict)

    def check(self, replica: str, seq: int) -> Verdict:
        last = self._last.get(replica)
        if last is None:
            return Verdict.NEXT if seq == 0 else Verdict.GAP
        if seq == last + 1:
            return Verdict.NEXT
        return Verdict.GAP if seq > last + 1 else Verdict.RESTART

    def expected(self, replica: str) -> int:
        """The sequence number the replica's next batch should carry (0 before any)."""
        last = self._last.get(replica)
        return 0 if last is None else last + 1

    def applied(self, replica: str, seq: int) -> None:
        self._last[replica] = seq

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
