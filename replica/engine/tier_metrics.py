"""Prometheus series of the KV tiers (host memory, shared disk), on the engine's registry.

vLLM's names where vLLM has them: ``vllm:external_prefix_cache_queries`` / ``_hits``
(tokens queried from / served by the tiers behind the device pool, as vLLM counts its
KV connector's), beside ``vllm:prefix_cache_*`` (the device pool alone). Ours, under
``prefixserve:kv_tier_*`` with a ``tier`` label (``host`` | ``disk``, the media of
``replica/kv/tiers.py``): hit tokens, blocks stored and loaded, usage, the copy time and
bytes on the engine loop; and the disk's faults.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixserve.common.metric_series import LabeledSeries

TIERS = ("host", "disk")
# Copies the engine loop does for the tiers: device -> host (offload) and host -> device
# (copy-back), each with that step's swap copies; disk payloads into host slots; blocks
# read for the disk's write queue.
COPY_OPS = ("offload", "copy_back", "disk_fill", "disk_store")
DISK_ERROR_OPS = ("read", "write")


@dataclass(frozen=True)
class TierTotals:
    """Cumulative tier counters of an engine since start (the engine sums them over resets)."""

    queries: int = 0  # prompt tokens of admitted requests while a tier is on
    host_hit_tokens: int = 0  # served from the host tier (disk reads included)
    disk_hit_tokens: int = 0  # of which read from disk first
    host_stored_blocks: int = 0  # device -> host offloads
    host_loaded_blocks: int = 0  # host -> device copy-backs
    disk_stored_blocks: int = 0
    disk_loaded_blocks: int = 0
    disk_invalid_files: int = 0
    disk_dropped_writes: int = 0
    disk_read_errors: int = 0
    disk_write_errors: int = 0
    offload_seconds: float = 0.0
    offload_bytes: int = 0
    copy_back_seconds: float = 0.0
    copy_back_bytes: int = 0
    disk_fill_seconds: float = 0.0
    disk_fill_bytes: int = 0
    disk_store_seconds: float = 0.0
    disk_store_bytes: int = 0


class TierMetrics:
    """The tier series; ``observe`` turns cumulative totals into counter increments."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0") -> None:
        series = LabeledSeries(registry, ["model_name", "engine"], (model_name, engine))
        c = series.counter
        # The counters per tier, and per copy op.
        by_tier = partial(series.each, Counter, label="tier", keys=TIERS)
        by_op = partial(series.each, Counter, label="op", keys=COPY_OPS)
        self.queries = c(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from the KV tiers (host, disk), in terms of number of queried tokens.",
        )
        self.hits = c(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from the KV tiers (host, disk), in terms of number of cached tokens.",
        )
        self.hit_tokens = by_tier(
            "prefixserve:kv_tier_hit_tokens",
            "Prompt tokens whose KV came back from a tier (disk: read from disk, then through the host tier).",
        )
        self.stored = by_tier("prefixserve:kv_tier_stored_blocks", "KV blocks written to a tier.")
        self.loaded = by_tier("prefixserve:kv_tier_loaded_blocks", "KV blocks read back from a tier.")
        self.copy_seconds = by_op(
            "prefixserve:kv_tier_copy_seconds", "Seconds the engine loop spent on tier copies, by op."
        )
        self.copy_bytes = by_op("prefixserve:kv_tier_copy_bytes", "Bytes of tier copies, by op.")
        self.disk_errors = series.each(
            Counter,
            "prefixserve:kv_disk_errors",
            "Disk tier faults (full, read-only, vanished); the first one stops the disk tier.",
            "op",
            DISK_ERROR_OPS,
        )
        self.disk_invalid = c(
            "prefixserve:kv_disk_invalid_files",
            "Disk tier files that were truncated, corrupt or written for another model (a miss; deleted).",
        )
        self.disk_dropped = c(
            "prefixserve:kv_disk_dropped_writes",
            "Blocks not written to disk: the write queue was full or the tier stopped.",
        )
        self.drain_saved = c(
            "prefixserve:kv_drain_saved_blocks",
            "KV blocks a drain wrote to the disk tier before the engine stopped (the most reused first).",
        )
        self.usage = series.family(
            Gauge,
            "prefixserve:kv_tier_usage",
            "Fraction of a tier holding cached KV blocks (host: its slots; disk: this replica's estimate).",
            "tier",
        )
        self.usage_by_tier = {t: series.child(self.usage, t) for t in TIERS}
        self.disk_enabled = series.gauge(
            "prefixserve:kv_disk_enabled", "1 while the disk tier serves, 0 after a fault stopped it."
        )
        self._last = TierTotals()

    def observe(self, t: TierTotals, *, host_usage: float, disk_usage: float | None) -> None:
        """Record the tiers' state; ``t`` is cumulative."""
        last = self._last
        self.queries.inc(t.queries - last.queries)
        self.hits.inc(t.host_hit_tokens - last.host_hit_tokens)
        self.hit_tokens["host"].inc(t.host_hit_tokens - last.host_hit_tokens)
        self.hit_tokens["disk"].inc(t.disk_hit_tokens - last.disk_hit_tokens)
        self.stored["host"].inc(t.host_stored_blocks - last.host_stored_blocks)
        self.loaded["host"].inc(t.host_loaded_blocks - last.host_loaded_blocks)
        self.stored["disk"].inc(t.disk_stored_blocks - last.disk_stored_blocks)
        self.loaded["disk"].inc(t.disk_loaded_blocks - last.disk_loaded_blocks)
        self.disk_invalid.inc(t.disk_invalid_files - last.disk_invalid_files)
        self.disk_dropped.inc(t.disk_dropped_writes - last.disk_dropped_writes)
        self.disk_errors["read"].inc(t.disk_read_errors - last.disk_read_errors)
        self.disk_errors["write"].inc(t.disk_write_errors - last.disk_write_errors)
        for op in COPY_OPS:
            self.copy_seconds[op].inc(getattr(t, f"{op}_seconds") - getattr(last, f"{op}_seconds"))
            self.copy_bytes[op].inc(getattr(t, f"{op}_bytes") - getattr(last, f"{op}_bytes"))
        self.usage_by_tier["host"].set(host_usage)
        if disk_usage is not None:
            self.usage_by_tier["disk"].set(disk_usage)
            self.disk_enabled.set(1.0 if t.disk_write_errors + t.disk_read_errors == 0 else 0.0)
        self._last = t
