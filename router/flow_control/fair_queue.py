"""Weighted fair queuing of waiting requests, within priority bands.

Job: :class:`FairQueue` holds the requests that wait for a slot; :meth:`FairQueue.pop` hands out
the next one. Bands first: every request of a lower priority value (vLLM's order: lower runs
first) goes before any of a higher one. Within a band, start-time fair queuing (Goyal et al.,
SFQ) over the tenants' FIFO queues: a request's start tag is the later of the band's virtual
time and its tenant's last finish tag, its finish tag adds ``cost / weight``; the head with the
smallest start tag goes next, and the band's virtual time becomes that tag. A tenant that sends
twice the tokens of another at equal weight thus waits twice as long in a backlog, and a tenant
that was idle comes back at the band's virtual time, with no credit banked.

Pure: no asyncio, no clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class QueuedItem:
    """One waiting request (``payload``: whatever the caller hands back on pop)."""

    tenant: str
    band: int
    cost: float
    start_tag: float
    finish_tag: float
    seq: int
    payload: Any = None
    queued: bool = field(default=True, repr=False)


class FairQueue:
    """Per-band, per-tenant queues served by weighted fair queuing (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[int, dict[str, deque[QueuedItem]]] = {}
        self._virtual_time: dict[int, float] = {}
        self._last_finish: dict[tuple[int, str], float] = {}
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, tenant: str, band: int, cost: float, weight: float, payload: Any = None) -> QueuedItem:
        """Queue a request of ``tenant`` in ``band``, weighing ``cost`` (> 0) at ``weight`` (> 0)."""
        if not cost > 0 or not weight > 0:
            raise ValueError(f"cost and weight must be > 0, got {cost}, {weight}")
        start = max(self._virtual_time.get(band, 0.0), self._last_finish.get((band, tenant), 0.0))
        item = QueuedItem(tenant, band, cost, start, start + cost / weight, next(self._seq), payload)
        self._last_finish[band, tenant] = item.finish_tag
        self._queues.setdefault(band, {}).setdefault(tenant, deque()).append(item)
        self._size += 1
        return item

    def peek(self) -> QueuedItem | None:
        """The request :meth:`pop` would hand out, left in the queue (None when none waits)."""
        if not self._queues:
            return None
        tenants = self._queues[min(self._queues)]
        return min((q[0] for q in tenants.values()), key=lambda item: (item.start_tag, item.seq))

    def pop(self) -> QueuedItem | None:
        """The next request to serve (removed from the queue), or None when none waits."""
        item = self.peek()
        if item is None:
            return None
        self._queues[item.band][item.tenant].popleft()
        self._virtual_time[item.band] = max(self._virtual_time.get(item.band, 0.0), item.start_tag)
        self._drop_empty(item.band, item.tenant)
        item.queued = False
        self._size -= 1
        return item

    def waiting_at_or_before(self, band: int) -> bool:
        """Whether a request of ``band`` or of a band served before it waits."""
        return any(b <= band for b in self._queues)

    def remove(self, item: QueuedItem) -> bool:
        """Take ``item`` out before its turn (its wait ran out, its client left); False if it was not queued."""
        if not item.queued:
            return False
        queue = self._queues[item.band][item.tenant]
        queue.remove(item)
        if not queue and self._last_finish.get((item.band, item.tenant)) == item.finish_tag:
            # It was the tenant's last: the next request starts from the virtual time, not after it.
            self._last_finish[item.band, item.tenant] = item.start_tag
        self._drop_empty(item.band, item.tenant)
        item.queued = False
        self._size -= 1
        return True

    def _drop_empty(self, band: int, tenant: str) -> None:
        tenants = self._queues[band]
        if not tenants[tenant]:
            del tenants[tenant]
            if not tenants:
                del self._queues[band]

    def sizes(self) -> dict[tuple[int, str], int]:
        """Waiting requests per (band, tenant)."""
        return {(band, t): len(q) for band, tenants in self._queues.items() for t, q in tenants.items()}
