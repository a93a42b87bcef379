"""Flow control at a front end: tenants' quotas, then a fair queue for the cluster's slots.

Job: :class:`FlowController` decides, for each request, whether it runs now, waits, or is
refused. In order:

1. **Tenant** (:meth:`FlowController.tenant_of`): by API key or tenant header
   (router/flow_control/tenants.py); neither names a tenant: 403 ``unknown_tenant``.
2. **Priority band** (:meth:`FlowController.band_of`): the request's priority (vLLM's, lower
   first) when it asks one, else its tenant's default; outside the tenant's range: 400.
3. **Quota** (in :meth:`FlowController.admit`): the tenant's requests and tokens per minute
   (router/flow_control/quota.py), charged on arrival; over: 429 ``tenant_rate_limit_exceeded``
   with the bucket's Retry-After. A refused request costs the tenant nothing (one refused while
   waiting is refunded).
4. **Slot**: at most ``max_in_flight`` requests run at once (the replicas' in-flight caps), the
   last ``reserved_slots`` of them for the best band alone; past that a request waits in the fair
   queue (router/flow_control/fair_queue.py: bands, then weighted fair queuing over tenants,
   costed by estimated tokens), at most ``queue_budget_s`` (then 503 ``queue_timeout``) and
   behind at most ``max_queued`` others (else 503 ``queue_full``).

An admitted request holds a :class:`Lease` until it ends; :meth:`Lease.release` frees its slot
(the next waiter goes), settles its tokens against the quota and records them for the fairness
index. What flow control saw goes to a :class:`FlowObserver` (the front end's metrics).

No HTTP, no Ray: asyncio only (waiters are futures on the running loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prefixserve.router.flow_control.errors import (
    PriorityNotAllowedError,
    QueueRefusal,
    TenantRateLimitError,
    UnknownTenantError,
)
from prefixserve.router.flow_control.fair_queue import FairQueue
from prefixserve.router.flow_control.fairness import FairnessWindow
from prefixserve.router.flow_control.quota import TenantQuota
from prefixserve.router.flow_control.tenants import TenantSpec, TenantTable

# Retry-After of a queue refusal: about how long a slot takes to free up, unknown here.
QUEUE_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class FlowConfig:
    """The knobs of flow control (the tenants come apart, in a TenantTable)."""

    # Requests running at once through this front end (the replicas' in-flight caps together).
    max_in_flight: int = 64
    # The longest a request waits for a slot before a 503.
    queue_budget_s: float = 30.0
    # Requests waiting at once; one more is refused (503).
    max_queued: int = 1024
    # The window of the fairness index.
    fairness_window_s: float = 60.0
    # The part of each tenant's quota this front end enforces (1 / the front ends sharing the traffic).
    quota_share: float = 1.0
    # Slots only the best band (the lowest priority any tenant defaults to) may take: a request of
    # another band waits while no more than these are free, so the best band seldom waits at all.
    reserved_slots: int = 0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if not self.queue_budget_s > 0:
            raise ValueError(f"queue_budget_s must be > 0, got {self.queue_budget_s}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not self.fairness_window_s > 0:
            raise ValueError(f"fairness_window_s must be > 0, got {self.fairness_window_s}")
        if not 0 < self.quota_share <= 1:
            raise ValueError(f"quota_share must be in (0, 1], got {self.quota_share}")
        if not 0 <= self.reserved_slots < self.max_in_flight:
            raise ValueError(
                f"reserved_slots must be in [0, max_in_flight = {self.max_in_flight}), got {self.reserved_slots}"
            )


class FlowObserver(Protocol):
    """What flow control reports (a front end's metrics); every method is called on the loop."""

    def queued(self, band: int, tenant: str, size: int) -> None: ...
    def waited(self, band: int, tenant: str, seconds: float) -> None: ...
    def rejected(self, tenant: str, reason: str) -> None: ...
    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int, fairness: float | None) -> None: ...


class Lease:
    """An admitted request's slot; :meth:`release` once it ends (again: nothing)."""

    def __init__(self, controller: FlowController, tenant: TenantSpec, estimate: int) -> None:
        self._controller = controller
        self.tenant = tenant
        self.estimate = estimate
        self.released = False

    def release(self, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Free the slot and settle the tokens the request used (0, 0: it used none, e.g. it failed)."""
        if self.released:
            return
        self.released = True
        self._controller._release(self, prompt_tokens, completion_tokens)

    def release_as_estimated(self) -> None:
        """Free the slot of a request that ran but whose usage is unknown: its estimate stays charged."""
        if self.released:
            return
        self.released = True
        self._controller._release(self, None, None)


class FlowController:
    """Quotas and the fair queue of one front end (see the module docstring)."""

    def __init__(
        self,
        table: TenantTable,
        config: FlowConfig | None = None,
        observer: FlowObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.config = config or FlowConfig()
        self._observer = observer
        self._clock = clock
        share = self.config.quota_share
        self._quotas = {
            t.name: TenantQuota(
                t.requests_per_minute * share if t.requests_per_minute else None,
                t.tokens_per_minute * share if t.tokens_per_minute else None,
            )
            for t in table.tenants
        }
        self._weights = {t.name: t.weight for t in table.tenants}
        self._best_band = min(t.default_priority for t in table.tenants)
        self._queue = FairQueue()
        self._fairness = FairnessWindow(self.config.fairness_window_s)
        self.in_flight = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    def tenant_of(self, api_key: str | None, headers: Mapping[str, str]) -> TenantSpec:
        """The request's tenant; UnknownTenantError (403) when neither key nor header names one."""
        tenant = self.table.identify(api_key, headers)
        if tenant is None:
            how = "API key" + (f" or {self.table.tenant_header} header" if self.table.tenant_header else "")
            self._report_rejected("-", "unknown_tenant")
            raise UnknownTenantError(f"the request's {how} names no tenant of this server", reason="unknown_tenant")
        return tenant

    def band_of(self, tenant: TenantSpec, priority: int | None) -> int:
        """The request's band: its priority if it asks one (within the tenant's range), else the tenant's default."""
        if priority is None:
            return tenant.default_priority
        if not tenant.allows(priority):
            self._report_rejected(tenant.name, "priority_not_allowed")
            raise PriorityNotAllowedError(
                f"priority {priority} is outside tenant {tenant.name!r}'s range "
                f"[{tenant.priorities[0]}, {tenant.priorities[1]}]",
                reason="priority_not_allowed",
                param="priority",
            )
        return priority

    async def admit(self, tenant: TenantSpec, band: int, estimated_tokens: int) -> Lease:
        """Wait for the request's slot (see the module docstring); its Lease, or a FlowRefusal."""
        now = self._clock()
        quota = self._quotas[tenant.name]
        refusal = quota.check(now)
        if refusal is not None:
            reason = f"{refusal.kind}_per_minute"
            self._report_rejected(tenant.name, reason)
            raise TenantRateLimitError(
                f"tenant {tenant.name!r} is over its {refusal.kind} per minute; retry after {refusal.retry_after_s} s",
                reason=reason,
                retry_after_s=refusal.retry_after_s,
            )
        estimate = max(1, estimated_tokens)
        # Charged now, not once a slot is free: the requests waiting count against the quota too.
        quota.reserve(estimate, now)
        if self._may_start(band) and not self._queue.waiting_at_or_before(band):
            self.in_flight += 1
        else:
            try:
                await self._wait(tenant, band, estimate, now)
            except BaseException:
                quota.refund(estimate, self._clock())  # refused or abandoned: it cost nothing
                raise
        return Lease(self, tenant, estimate)

    async def _wait(self, tenant: TenantSpec, band: int, estimate: int, since: float) -> None:
        if len(self._queue) >= self.config.max_queued:
            self._report_rejected(tenant.name, "queue_full")
            raise QueueRefusal(
                f"{len(self._queue)} requests are waiting already; retry later",
                reason="queue_full",
                code="queue_full",
                retry_after_s=QUEUE_RETRY_AFTER_S,
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = self._queue.push(tenant.name, band, float(estimate), tenant.weight, slot)
        self._report_queue(band, tenant.name)
        try:
            done, _ = await asyncio.wait({slot}, timeout=self.config.queue_budget_s)
        except asyncio.CancelledError:
            # The client left while waiting: its place, or the slot it was just handed, goes on.
            if not self._queue.remove(item) and slot.done():
                self._release_slot()
            else:
                self._dispatch()  # the waiter ahead of others is gone: those behind may start
            self._report_queue(band, tenant.name)
            raise
        if not done and (self._queue.remove(item) or not slot.done()):
            self._dispatch()
            self._report_queue(band, tenant.name)
            self._report_rejected(tenant.name, "queue_timeout")
            raise QueueRefusal(
                f"no slot freed within the queue budget ({self.config.queue_budget_s:g} s); retry later",
                reason="queue_timeout",
                retry_after_s=QUEUE_RETRY_AFTER_S,
            )
        if self._observer is not None:
            self._observer.waited(band, tenant.name, self._clock() - since)

    def _release(self, lease: Lease, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """Settle (None: usage unknown, the estimate stands and no tokens are counted) and free the slot."""
        now = self._clock()
        used = (
            lease.estimate if prompt_tokens is None or completion_tokens is None else prompt_tokens + completion_tokens
        )
        self._quotas[lease.tenant.name].settle(lease.estimate, used, now)
        self._fairness.record(lease.tenant.name, float(used), now)
        if self._observer is not None:
            fairness = self._fairness.index(now, self._weights)
            self._observer.served(lease.tenant.name, prompt_tokens or 0, completion_tokens or 0, fairness)
        self._release_slot()

    def _may_start(self, band: int) -> bool:
        """Whether a request of ``band`` may take a free slot now (the best band may take the reserved ones)."""
        reserved = self.config.reserved_slots if band > self._best_band else 0
        return self.in_flight < self.config.max_in_flight - reserved

    def _release_slot(self) -> None:
        """A slot is free: the waiters that may start now take it."""
        self.in_flight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the waiters in the fair queue's order while the next one may start."""
        while (item := self._queue.peek()) is not None and self._may_start(item.band):
            self._queue.pop()
            self._report_queue(item.band, item.tenant)
            slot: asyncio.Future[None] = item.payload
            if not slot.done():
                self.in_flight += 1
                slot.set_result(None)

    def fairness_index(self) -> float | None:
        """Jain's index of the weighted tokens served over the window (None: nothing served)."""
        return self._fairness.index(self._clock(), self._weights)

    def _report_queue(self, band: int, tenant: str) -> None:
        if self._observer is not None:
            self._observer.queued(band, tenant, self._queue.sizes().get((band, tenant), 0))

    def _report_rejected(self, tenant: str, reason: str) -> None:
        if self._observer is not None:
            self._observer.rejected(tenant, reason)
