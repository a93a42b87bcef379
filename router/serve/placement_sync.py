"""The request router's side of the placement agreement between ingress routers (``placed``).

Job: what the ingress (router/serve/ingress.py) exchanges every ``placement_sync_s``:
the requests and uncached prompt tokens per key this router counted since the last
exchange, and the tokens of a key's static prefix when it learnt them (``take_counts``),
merged into the leader's placement (``merge_counts``); the leader's
``placement_snapshot``, which followers adopt (``apply_placement``); and which of the two
this router is (``set_leader``). The ingress also reports each finished
request's prefill work here (``observe``). Does nothing when the policy is not ``placed``.

Pure Python: no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.policy_slot import PolicySlot, SlotPart


class PlacementSync(SlotPart):
    """This router's placement counts since the last exchange, and the leader / follower switch."""

    def __init__(self, slot: PolicySlot, metrics: RouterMetrics, deployment: str) -> None:
        super().__init__(slot, metrics, deployment)
        # Requests and prefill work routed here since the last take_counts (key -> [n, tokens]), and
        # the key's KV footprint in tokens as a third entry once observe learnt it.
        self._counts: dict[str, list[int]] = {}

    def count_request(self, key: str) -> None:
        """A request of ``key`` was counted in the placement. The caller holds the slot's lock."""
        self._counts.setdefault(key, [0, 0])[0] += 1

    def snapshot(self) -> dict[str, Any] | None:
        """The policy's placement snapshot (JSON-serializable), None when the policy is not ``placed``."""
        placed = self._slot.placed
        if placed is None:
            return None
        with self._slot.lock:
            return placed.placement_snapshot()

    @property
    def is_leader(self) -> bool:
        placed = self._slot.placed
        return placed is not None and bool(placed.options.leader)

    def set_leader(self, leader: bool) -> None:
        """Make this router the placement leader (rebalances) or a follower (applies snapshots)."""
        placed = self._slot.placed
        if placed is not None and placed.options.leader != leader:
            with self._slot.lock:
                placed.options = replace(placed.options, leader=leader)

    def apply(self, snapshot: Mapping[str, Any]) -> None:
        """Adopt the leader's snapshot (a follower)."""
        placed = self._slot.placed
        if placed is not None:
            with self._slot.lock:
                placed.apply_snapshot(snapshot)

    def take_counts(self) -> dict[str, list[int]]:
        """The requests and uncached prompt tokens per key routed since the last call (and reset), and
        the tokens of the key's static prefix as a third entry when known."""
        with self._slot.lock:
            counts, self._counts = self._counts, {}
        return counts

    def merge_counts(self, counts: Mapping[str, Any]) -> None:
        """Count another router's requests in this (leader's) placement: ``{key: [requests, tokens]}``,
        or ``[requests, tokens, static prefix tokens]`` (requests below 0: refused ones it had counted in
        an earlier exchange, taken back)."""
        placed = self._slot.placed
        if placed is None:
            return
        with self._slot.lock:
            now = time.monotonic()  # the policy's clock (its default)
            for key, (n, tokens, *footprint) in counts.items():
                for _ in range(max(0, int(n))):
                    placed.table.record(str(key), now)
                for _ in range(max(0, -int(n))):
                    placed.table.unrecord(str(key), now)
                if int(tokens) > 0:
                    placed.table.observe(str(key), int(tokens), now)
                if footprint:
                    placed.table.set_footprint(str(key), int(footprint[0]))

    def refused(self, key: str) -> None:
        """A request of ``key`` its replica refused as a client error: its count taken back, here and
        in what the next exchange hands the leader."""
        placed = self._slot.placed
        if placed is None:
            return
        with self._slot.lock:
            placed.refused(key)
            entry = self._counts.setdefault(key, [0, 0])
            entry[0] -= 1  # below 0 when the exchange already handed the leader its count
            if entry == [0, 0]:
                del self._counts[key]

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The prefill work of a finished request of ``key`` (the ingress reports it from the usage)."""
        placed = self._slot.placed
        if placed is None:
            return
        if prompt_tokens > 0:
            self._metrics.reported_cached_fraction.labels(self._deployment).observe(
                min(1.0, (cached_tokens or 0) / prompt_tokens)
            )
        with self._slot.lock:
            static_tokens = placed.observe(key, prompt_tokens, cached_tokens)
            entry = self._counts.setdefault(key, [0, 0])
            entry[1] += max(0, prompt_tokens - (cached_tokens or 0))
            if static_tokens:
                if len(entry) == 2:
                    entry.append(static_tokens)
                else:
                    entry[2] = max(entry[2], static_tokens)
