"""The engine's KV tiers: the disk store, the tier copies around a step, their metrics.

``LLMEngine`` holds one ``EngineTiers`` when the host tier is on (``kv_offloading_size``);
the KV manager decides what moves (``replica/kv/manager.py``, "Host tier"), this object
applies the disk copies on rank 0 (``replica/worker/tier_io.py``) and, under tensor
parallelism, sends the workers theirs (``replica/executor/tp_disk.py``: each rank its own
shard files, rank 0 deciding), times the host copies the step's swap carries, and publishes
``replica/engine/tier_metrics.py``'s series. Its disk store
and counters outlive ``LLMEngine.reset`` (a fresh KV manager starts with an empty host
tier; the files stay valid).

A drain ends with :meth:`EngineTiers.save_hot_blocks`: the write-behind queue is flushed,
then the replica's cached blocks, most reused first (``KVCacheManager.hot_blocks``), go to
the disk where it lacks them (a write the queue dropped, a file the shared size bound
deleted), and every one's file gets a fresh mtime in that order, so the size bound keeps
the departing replica's hot prefixes longest; all of it within ``kv_drain_save_timeout_s``.
Under tensor parallelism a block is there when every rank's file is, and the save writes
every rank's file of it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from prometheus_client import CollectorRegistry

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.tier_metrics import TierMetrics, TierTotals
from prefixserve.replica.executor.model_runner import ModelRunner
from prefixserve.replica.executor.tp_disk import ShardedDiskTier
from prefixserve.replica.kv.disk_tier import DiskTier
from prefixserve.replica.kv.manager import KVCacheManager, KVCacheStats
from prefixserve.replica.kv.tiers import MEDIUM_HOST, TierOps, TierStats
from prefixserve.replica.worker.tier_io import TierIO, disk_key, read_blocks

log = logging.getLogger(__name__)

# Blocks read from the cache per copy during a drain's save (the time bound is checked between).
SAVE_BATCH_BLOCKS = 32


class EngineTiers:
    """The host and disk tiers of one engine (module docstring)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, registry: CollectorRegistry, model_name: str) -> None:
        self.config = config
        self.runner = runner
        self.block_bytes = runner.kv_bytes_per_block
        self.disk: DiskTier | None = None
        self.io: TierIO | None = None
        # Under tensor parallelism: the workers' shard files, and the KV manager's store.
        self.sharded: ShardedDiskTier | None = None
        if config.kv_disk_path is not None:
            size, key = int(config.kv_disk_size_gb * 1024**3), disk_key(runner.shard)
            if runner.workers is None:
                self.disk = DiskTier(config.kv_disk_path, size, key)
            else:
                self.sharded = ShardedDiskTier.open(config.kv_disk_path, size, key, runner.workers)
                self.disk = self.sharded.disk
            self.disk.full_backoff_s = config.kv_disk_full_backoff_s
            self.io = TierIO(runner.shard, self.disk)
        self.metrics = TierMetrics(registry, model_name)
        self._carried = TierStats()
        self._carried_queries = 0
        self._offload = [0.0, 0]  # seconds, bytes
        self._copy_back = [0.0, 0]

    def manager_kwargs(self) -> dict[str, object]:
        """The KVCacheManager arguments of the tiers."""
        return {
            "host_tier": True,
            "max_load_blocks_per_step": self.config.kv_load_max_blocks_per_step,
            "disk": self.sharded if self.sharded is not None else self.disk,
        }

    def swap(self, ops: TierOps, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """A step's tier and swap copies, in ``TierOps``' order (the forward pass comes next)."""
        if self.io is not None and ops:
            self.io.before_swap(ops)
            if self.sharded is not None:
                self.sharded.before_swap(ops)
        if swap_out:
            t0 = time.perf_counter()
            self.runner.swap(swap_out, [])
            self._offload[0] += time.perf_counter() - t0
            self._offload[1] += len(swap_out) * self.block_bytes
        if swap_in:
            t0 = time.perf_counter()
            self.runner.swap([], swap_in)
            self._copy_back[0] += time.perf_counter() - t0
            self._copy_back[1] += len(swap_in) * self.block_bytes

    def after_forward(self, ops: TierOps) -> None:
        if self.io is not None and ops.device_stores:
            self.io.after_forward(ops)
            if self.sharded is not None:
                self.sharded.after_forward(ops)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every rank's queued disk writes are done; False on a timeout (True without a disk)."""
        if self.sharded is not None:
            return self.sharded.flush(timeout_s)
        return self.disk is None or self.disk.flush(timeout_s)

    def carry(self, stats: KVCacheStats) -> None:
        """Keep a KV manager's counters before ``LLMEngine.reset`` replaces it."""
        mine, theirs = asdict(self._carried), asdict(stats.tiers)
        self._carried = TierStats(**{k: mine[k] + theirs[k] for k in mine if k != "num_host_cached_blocks"})
        self._carried_queries += stats.prefix_query_tokens

    def totals(self, stats: KVCacheStats) -> TierTotals:
        t, c = stats.tiers, self._carried
        d = self.disk.stats if self.disk is not None else None
        io = self.io.times if self.io is not None else None
        return TierTotals(
            queries=self._carried_queries + stats.prefix_query_tokens,
            host_hit_tokens=c.host_hit_tokens + t.host_hit_tokens,
            disk_hit_tokens=c.disk_hit_tokens + t.disk_hit_tokens,
            host_stored_blocks=c.host_offloaded_blocks + t.host_offloaded_blocks,
            host_loaded_blocks=c.host_loaded_blocks + t.host_loaded_blocks,
            disk_stored_blocks=d.stored_blocks if d else 0,
            disk_loaded_blocks=d.loaded_blocks if d else 0,
            disk_invalid_files=d.invalid_files if d else 0,
            disk_dropped_writes=d.dropped_writes if d else 0,
            disk_read_errors=d.errors.get("read", 0) if d else 0,
            disk_write_errors=d.errors.get("write", 0) if d else 0,
            offload_seconds=self._offload[0],
            offload_bytes=int(self._offload[1]),
            copy_back_seconds=self._copy_back[0],
            copy_back_bytes=int(self._copy_back[1]),
            disk_fill_seconds=io.fill_seconds if io else 0.0,
            disk_fill_bytes=io.fill_bytes if io else 0,
            disk_store_seconds=io.store_seconds if io else 0.0,
            disk_store_bytes=d.stored_bytes if d else 0,
        )

    def observe(self, stats: KVCacheStats) -> None:
        host = stats.tiers.num_host_cached_blocks / stats.num_host_blocks if stats.num_host_blocks else 0.0
        disk = None
        if self.disk is not None:
            disk = min(1.0, self.disk.used_bytes / self.disk.size_bytes)
        self.metrics.observe(self.totals(stats), host_usage=host, disk_usage=disk)

    def save_hot_blocks(self, manager: KVCacheManager, timeout_s: float) -> int:
        """A drain's save (the module docstring), for at most ``timeout_s``; the blocks it wrote.

        Call with the engine loop stopped (nothing else reads or writes the cache). Logs what
        it did and counts the writes in ``prefixserve:kv_drain_saved_blocks``.
        """
        disk = self.disk
        if disk is None or self.io is None or timeout_s <= 0 or not disk.enabled:
            return 0
        start = time.monotonic()
        deadline = start + timeout_s
        if not self.flush(timeout_s):
            log.warning("drain: the KV disk write queue did not empty within %g s; no hot block saved", timeout_s)
            return 0
        hot, seen = [], set()
        for medium, index, h in manager.hot_blocks():
            if h not in seen:
                seen.add(h)
                hot.append((medium == MEDIUM_HOST, index, h))
        newest_ns = time.time_ns()
        written = kept = done = 0
        while done < len(hot) and disk.enabled and time.monotonic() < deadline:
            batch = hot[done : done + SAVE_BATCH_BLOCKS]
            # mtimes fall along the hot order: the size bound deletes the least reused first.
            mtimes = [newest_ns - done - i for i in range(len(batch))]
            missing = [i for i, (_, _, h) in enumerate(batch) if not disk.touch(h, mtimes[i])]
            kept += len(batch) - len(missing)
            saved: dict[int, bool] = {}  # rank 0's saves: whether each wrote its file
            for host in (False, True):
                part = [i for i in missing if batch[i][0] == host]
                for i, payload in zip(part, read_blocks(self.io.shard, [batch[i][1] for i in part], host=host)):
                    if time.monotonic() >= deadline:
                        break
                    saved[i] = disk.save(batch[i][2], payload, mtimes[i])
            if self.sharded is not None:  # the other ranks' files of the blocks rank 0 saved
                others = self.sharded.save([(*batch[i], mtimes[i]) for i in saved])
                saved = {i: mine or theirs for (i, mine), theirs in zip(saved.items(), others, strict=True)}
            written += sum(saved.values())
            done += len(batch)
        self.metrics.drain_saved.inc(written)
        log.info(
            "drain: saved %d KV blocks to the disk tier (%d of %d cached blocks were there already) in %.2f s%s",
            written,
            kept,
            len(hot),
            time.monotonic() - start,
            "" if time.monotonic() < deadline else f" (the {timeout_s:g} s bound, kv_drain_save_timeout_s, cut it)",
        )
        return written

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
