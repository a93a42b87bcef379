"""The request router's feed of ``placed``'s conversation index (router/policies/history.py).

Job: everything the router tells the history index, and the index's metrics: a
request's prompt hashed into text blocks (replica/contract/prompt_blocks.py, the hashes
the replicas' history events use too), the blocks a request took to a replica other
than the one ranked first, the replicas' history reports (replica/contract/history_events.py,
arriving with their KV events), and the replicas that left the ring. Does nothing when
the policy is not ``placed`` or runs without a history.

Pure Python: no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixserve.replica.contract.history_events import HistoryReport
from prefixserve.replica.contract.prompt_blocks import PromptBlocks, PromptHasher, UnhashablePrompt
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.policy_slot import PolicySlot, SlotPart


class HistoryFeed(SlotPart):
    """Hashes prompts for ``placed``'s history and applies what the router learns of where they are."""

    def __init__(self, slot: PolicySlot, metrics: RouterMetrics, deployment: str) -> None:
        super().__init__(slot, metrics, deployment)
        self.hasher = PromptHasher()  # remembers earlier turns' message hashes

    def blocks(self, request: EngineRequest | None) -> PromptBlocks | None:
        """The request's history hashes for ``placed``; None when not used.

        A prompt the router cannot hash is counted and routes without a history
        (by its static key, then load).
        """
        placed = self._slot.placed
        if placed is None or placed.history is None or request is None:
            return None
        try:
            return self.hasher.blocks(request)
        except (UnhashablePrompt, TypeError, ValueError):
            self._metrics.history_unhashable.labels(self._deployment).inc()
            return None

    def record(self, replica: str, blocks: PromptBlocks) -> None:
        """The prompt went to ``replica`` (not the one ranked first): the index counts it held there."""
        placed = self._slot.placed
        if placed is not None and placed.history is not None:
            with self._slot.lock:
                placed.history.record(replica, blocks.hashes)

    def report(self, reports: Sequence[HistoryReport]) -> None:
        """Apply the replicas' history reports and publish the index's size."""
        placed = self._slot.placed
        if not reports or placed is None or placed.history is None:
            return
        with self._slot.lock:
            for report in reports:
                placed.history.report(report.replica, report.stored, report.removed, report.reset)
            entries = len(placed.history)
        self._metrics.history_index_entries.labels(self._deployment).set(entries)

    def forget(self, replica: str) -> None:
        """``replica`` left the ring, or its name passed to another replica: nothing the index says of it holds."""
        placed = self._slot.placed
        if placed is not None and placed.history is not None:
            with self._slot.lock:
                placed.history.forget(replica)
