"""The shared disk tier of a tensor-parallel replica, seen from rank 0.

Every rank holds its shard of every block, so a block on disk is one file per rank (the
name carries ``tp<rank>of<size>``, replica/kv/disk_tier.py). Rank 0's ``DiskTier`` makes
every decision (what is present, the size bound over all ranks' files, what to delete);
each worker rank reads and writes only its own files, through its ``ShardTierIO``
(replica/worker/tier_io.py), when rank 0's messages (replica/executor/tp_protocol.py) ask:

* **Start.** Each worker sends its ``DiskKey``; every rank's key carries one model
  fingerprint, the digest of all ranks' shard fingerprints (``combine_fingerprints``), so
  two replicas of one model at one size share files, and the size in the name keeps a
  replica at another size (TP 1 included) from ever reading them.
* **Lookup.** :meth:`ShardedDiskTier.load` is the KV manager's ``BlockStore.load``: it asks
  every worker to read and verify its file of the block while rank 0 reads its own. A
  block is a hit only when every rank's file verified; otherwise it is a miss on every
  rank (the workers drop what they read when the step's fills come, since no fill names
  it) and every rank's file of it is deleted (``DiskTier.discard``): never mixed tokens.
* **Step.** The step's tier copies reach the workers beside the swap message: host slots
  to store and to fill (``OP_TIER_BEFORE``, sent before the swap message) and the device
  blocks computed (``OP_TIER_AFTER``, after the step message); each rank copies its shard.
* **Faults.** A worker's first disk fault comes back in its next answer (a read, a flush, a
  save) and stops the tier for the whole replica: one warning, one error count, serving
  goes on. A fault of the directory itself (gone, read-only, full) hits rank 0 at its own
  next read or write, since every rank uses the same directory.
* **Drain.** ``EngineTiers.save_hot_blocks`` writes rank 0's files of the blocks the disk
  lacks, then asks each worker to write its own (:meth:`ShardedDiskTier.save`).
"""

from __future__ import annotations

import dataclasses

import torch

from prefixserve.replica.executor.tensor_parallel import WorkerGroup
from prefixserve.replica.executor.tp_protocol import (
    OP_DISK_FLUSH,
    OP_DISK_KEY,
    OP_DISK_LOAD,
    OP_DISK_OPEN,
    OP_DISK_SAVE,
    OP_TIER_AFTER,
    OP_TIER_BEFORE,
    hashed_message,
)
from prefixserve.replica.kv.disk_tier import DiskKey, DiskTier
from prefixserve.replica.kv.tiers import TierOps
from prefixserve.replica.worker.tier_io import LOAD_INVALID, LOAD_MISSING, LOAD_OK, combine_fingerprints


class ShardedDiskTier:
    """Rank 0's view of a tensor-parallel replica's disk tier (module docstring): the KV
    manager's ``BlockStore``, and the step's and drain's messages to the workers."""

    def __init__(self, disk: DiskTier, workers: WorkerGroup) -> None:
        self.disk = disk
        self.workers = workers

    @classmethod
    def open(
        cls, path: str, size_bytes: int, key: DiskKey, workers: WorkerGroup, queue_blocks: int = 256
    ) -> ShardedDiskTier:
        """Rank 0's ``DiskTier`` for ``key`` (rank 0's) and every worker's files, under one fingerprint."""
        workers.send(torch.tensor([OP_DISK_KEY], dtype=torch.int64))
        keys: list[DiskKey] = [key, *workers.collect("naming its KV block files")]
        fingerprint = combine_fingerprints([k.model_fingerprint for k in keys])
        keys = [dataclasses.replace(k, model_fingerprint=fingerprint) for k in keys]
        disk = DiskTier(path, size_bytes, keys[0], queue_blocks=queue_blocks)
        try:
            workers.send(torch.tensor([OP_DISK_OPEN], dtype=torch.int64))
            for conn, k in zip(workers.conns, keys[1:], strict=True):
                conn.send((disk.path, k, queue_blocks))
            workers.collect("opening the KV disk tier")
        except BaseException:
            disk.close()
            raise
        return cls(disk, workers)

    # --- the BlockStore interface ----------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.disk.enabled

    def contains(self, block_hash: bytes) -> bool:
        return self.disk.contains(block_hash)

    def load(self, block_hash: bytes) -> bytes | bytearray | None:
        """Rank 0's verified payload when every rank's file of the block verified, else None
        (every rank's file deleted)."""
        disk = self.disk
        if not disk.enabled:
            return None
        self.workers.send(hashed_message(OP_DISK_LOAD, [[(0, block_hash)]]))
        own = disk.read(block_hash)  # while the workers read theirs
        replies = self.workers.collect("reading its KV block files")
        self._faults(replies)
        statuses = [s for answer, _ in replies for s in answer]
        disk.stats.invalid_files += statuses.count(LOAD_INVALID)
        if own is not None and disk.enabled and all(s == LOAD_OK for s in statuses):
            disk.count_loaded(own)
            return own
        if own is not None or any(s != LOAD_MISSING for s in statuses):
            disk.discard(block_hash)  # a block is whole or gone
        return None

    # --- the step's copies ---------------------------------------------------------

    def before_swap(self, ops: TierOps) -> None:
        """The workers' host-slot stores and fills, ahead of the step's swap message."""
        if ops.host_stores or ops.host_fills:
            fills = [(slot, h) for slot, h, _ in ops.host_fills]
            self.workers.send(hashed_message(OP_TIER_BEFORE, [ops.host_stores, fills]))

    def after_forward(self, ops: TierOps) -> None:
        """The workers' stores of the blocks computed this step (after the step message)."""
        if ops.device_stores:
            self.workers.send(hashed_message(OP_TIER_AFTER, [ops.device_stores]))

    # --- flush, drain --------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every rank's queued writes are done; False on a timeout."""
        self.workers.send(torch.tensor([OP_DISK_FLUSH, int(timeout_s * 1000)], dtype=torch.int64))
        own = self.disk.flush(timeout_s)
        replies = self.workers.collect("flushing its KV disk writes")
        self._faults(replies)
        return own and all(ok for ok, _ in replies)

    def save(self, entries: list[tuple[bool, int, bytes, int]]) -> list[bool]:
        """The workers' drain save of (host?, block or slot, hash, mtime_ns): for each, whether
        some worker wrote its file."""
        if not entries or not self.disk.enabled:
            return [False] * len(entries)
        self.workers.send(torch.tensor([OP_DISK_SAVE], dtype=torch.int64))
        self.workers.reply(entries)
        replies = self.workers.collect("saving KV blocks to disk")
        self._faults(replies)
        return [any(column) for column in zip(*(written for written, _ in replies), strict=True)]

    def _faults(self, replies: list[tuple[object, tuple[str, str] | None]]) -> None:
        """Stop the tier for the first fault a worker's (answer, fault) reply carries (``DiskTier.fail``)."""
        for rank, (_, fault) in enumerate(replies, start=1):
            if fault is not None:
                op, reason = fault
                self.disk.fail(op, f"tensor-parallel rank {rank}: {reason}")
