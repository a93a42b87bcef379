"""The request router's intake of the replicas' KV events (precise mode).

Job: apply each replica's KV event payload (replica/contract/kv_events.py, carried in its
routing stats) through a :class:`KVEventConsumer` and hand what it learned to the policy:
per key whether the replica holds its prefix (``placed``'s precise hook ``set_cached``),
and the history events to the conversation index (router/serve/history_feed.py); count
the events and the gaps in the metrics.

The consumer applies every payload newer than the last one of its replica; after missed
ones (the controller pushes only the latest stats) it still applies the next diff, whose
``held`` summaries are absolute, and a diff of a new epoch (a restarted replica) waits for
its snapshot. With KV tiers, a block in a replica's host tier or in its shared disk
directory counts at ``placed``'s ``kv_host_weight`` / ``kv_disk_weight`` of a device block,
and a directory's blocks count for every replica reporting it (their facts come with the
reporter's payload).

Pure Python: no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixserve.replica.contract.kv_events import KVEventConsumer, TierWeights
from prefixserve.router.serve.history_feed import HistoryFeed
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.policy_slot import PolicySlot, SlotPart


class KVEventIntake(SlotPart):
    """Applies KV event payloads by replica name and feeds the policy what they say."""

    def __init__(self, slot: PolicySlot, history: HistoryFeed, metrics: RouterMetrics, deployment: str) -> None:
        super().__init__(slot, metrics, deployment)
        self._history = history
        placed = slot.placed
        weights = TierWeights(placed.options.kv_host_weight, placed.options.kv_disk_weight) if placed else None
        self._consumer = KVEventConsumer(weights)

    def take(self, name: str, payload: Any) -> None:
        """Apply the payload the replica ``name`` reported."""
        gaps = self._consumer.gaps
        facts = self._consumer.apply(name, payload)
        if self._consumer.gaps != gaps:
            self._metrics.kv_event_gaps.labels(self._deployment, name).inc()
        history = self._consumer.take_history()
        if (facts or history) and isinstance(payload, Mapping):
            for event in [*(payload.get("events") or ()), *(payload.get("history_events") or ())]:
                self._metrics.kv_events.labels(self._deployment, name, str(event.get("type"))).inc(
                    len(event.get("block_hashes") or ())
                )
        shared = self._consumer.take_shared_facts()  # disk blocks: every replica of the directory
        placed = self._slot.placed
        if placed is None:
            return
        if facts or shared:
            with self._slot.lock:
                for key, holds in facts:
                    placed.set_cached(name, key, holds)
                for other, key, holds in shared:
                    placed.set_cached(other, key, holds)
        self._history.report(history)

    def held(self) -> dict[str, list[str]]:
        """Per routing key, the replicas the KV events say hold its prefix."""
        return self._consumer.held()

    @property
    def gaps(self) -> int:
        """Diffs applied after a gap (missed reports; router/serve/metrics.py kv_event_gaps)."""
        return self._consumer.gaps

    def forget(self, name: str) -> None:
        """The replica ``name`` left the ring, or its name passed to another replica: drop what it reported."""
        self._consumer.forget(name)
