"""One ranking of the candidate replicas by the request router's policy.

Job: run the policy over the candidate views for one request (``placed`` with the
prompt's history hashes, counting the request once for the placement), and record the
decision's metrics: its latency, ``placed``'s branch, the history index's size and the
predicted cached fraction. Ranking is pure Python under the policy's lock: it never
blocks the router's event loop.

Pure Python: no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

from prefixserve.replica.contract.prompt_blocks import PromptBlocks
from prefixserve.router.policies import Decision, ReplicaView
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.placement_sync import PlacementSync
from prefixserve.router.serve.policy_slot import PolicySlot, SlotPart

V = TypeVar("V", bound=ReplicaView)


class Ranker(SlotPart):
    """Ranks candidates with the slot's policy and records each decision's metrics."""

    def __init__(self, slot: PolicySlot, placement: PlacementSync, metrics: RouterMetrics, deployment: str) -> None:
        super().__init__(slot, metrics, deployment)
        self._placement = placement

    def rank(
        self,
        views: Sequence[V],
        key: str | None,
        count: bool = True,
        blocks: PromptBlocks | None = None,
        retained: bool = False,
        adapter: str | None = None,
    ) -> Decision[V]:
        """The policy's decision over ``views`` for a request of ``key`` (None: no key).

        ``count=False``: Serve asks again for a request already ranked (``placed`` counts it once).
        ``blocks``: the prompt's history hashes, for ``placed``.
        ``retained``: the request asks its replica to pin its prefix; ``placed`` keeps its key where it is.
        ``adapter``: the LoRA adapter the request runs with; ``placed`` prefers replicas holding it.
        """
        policy = self._slot.policy
        placed = self._slot.placed
        entries = 0
        start = time.perf_counter()
        with self._slot.lock:
            if placed is not None:
                decision = placed.rank_prompt(views, key, blocks, count=count, adapter=adapter)
                if count and key is not None:
                    self._placement.count_request(key)
                    if retained:
                        placed.retain(key)
                entries = len(placed.history) if placed.history is not None else 0
            else:
                decision = policy.rank(views, key)
        self._metrics.decision_seconds.labels(self._deployment, policy.name).observe(time.perf_counter() - start)
        if placed is not None:
            self._record_placed(decision, count, blocks, entries)
        return decision

    def _record_placed(self, decision: Decision[V], count: bool, blocks: PromptBlocks | None, entries: int) -> None:
        self._metrics.history_index_entries.labels(self._deployment).set(entries)
        if count and decision.kind is not None:
            self._metrics.placed_branches.labels(self._deployment, decision.kind).inc()
        if blocks is not None and blocks.hashes and decision.best_blocks is not None:
            n = len(blocks.hashes)
            self._metrics.predicted_cached_fraction.labels(self._deployment, "chosen").observe(
                (decision.predicted_blocks or 0) / n
            )
            self._metrics.predicted_cached_fraction.labels(self._deployment, "best").observe(decision.best_blocks / n)
