"""FlowController: quotas, slots, the fair queue's order, and that no slot leaks."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.router.flow_control.controller import FlowConfig, FlowController
from prefixserve.router.flow_control.errors import (
    REASON_HEADER,
    PriorityNotAllowedError,
    QueueRefusal,
    TenantRateLimitError,
    UnknownTenantError,
)
from prefixserve.router.flow_control.tenants import parse_tenants

TENANTS = """\
tenant_header: x-tenant
tenants:
  - {name: live, api_key: k-live, priorities: [0, 0]}
  - {name: batch, api_key: k-batch, priorities: [10, 20]}
  - {name: noisy, header_value: noisy, requests_per_minute: 6}
"""


class Recorder:
    def __init__(self) -> None:
        self.rejections: list[tuple[str, str]] = []
        self.served_tokens: dict[str, int] = {}
        self.fairness: float | None = None
        self.waits: list[tuple[int, str]] = []

    def queued(self, band: int, tenant: str, size: int) -> None:
        pass

    def waited(self, band: int, tenant: str, seconds: float) -> None:
        self.waits.append((band, tenant))

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.append((tenant, reason))

    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int, fairness: float | None) -> None:
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + prompt_tokens + completion_tokens
        self.fairness = fairness


def _controller(**config: float) -> tuple[FlowController, Recorder]:
    recorder = Recorder()
    return FlowController(parse_tenants(TENANTS), FlowConfig(**config), recorder), recorder  # type: ignore[arg-type]


def test_tenant_and_band() -> None:
    flow, recorder = _controller()
    live = flow.tenant_of("k-live", {})
    assert live.name == "live" and flow.tenant_of(None, {"x-tenant": "noisy"}).name == "noisy"
    with pytest.raises(UnknownTenantError) as unknown:
        flow.tenant_of("k-other", {"x-tenant": "nobody"})
    assert unknown.value.status_code == 403 and unknown.value.headers()[REASON_HEADER] == "unknown_tenant"
    batch = flow.tenant_of("k-batch", {})
    assert flow.band_of(batch, None) == 10 and flow.band_of(batch, 20) == 20
    with pytest.raises(PriorityNotAllowedError) as outside:
        flow.band_of(batch, 0)
    assert outside.value.status_code == 400 and outside.value.param == "priority"
    assert recorder.rejections == [("-", "unknown_tenant"), ("batch", "priority_not_allowed")]


async def test_slots_pass_to_waiters_in_band_order() -> None:
    flow, recorder = _controller(max_in_flight=1)
    live, batch = flow.tenant_of("k-live", {}), flow.tenant_of("k-batch", {})
    running = await flow.admit(batch, 10, 100)
    order: list[str] = []

    async def wait(tenant, band):  # type: ignore[no-untyped-def]
        lease = await flow.admit(tenant, band, 100)
        order.append(tenant.name)
        return lease

    later_batch = asyncio.create_task(wait(batch, 10))
    await asyncio.sleep(0)
    later_live = asyncio.create_task(wait(live, 0))
    await asyncio.sleep(0)
    assert flow.queued == 2 and flow.in_flight == 1
    running.release(50, 10)
    lease = await later_live
    assert order == ["live"] and flow.in_flight == 1
    lease.release(5, 5)
    (await later_batch).release()
    assert order == ["live", "batch"] and flow.in_flight == 0 and flow.queued == 0
    assert recorder.served_tokens == {"batch": 60, "live": 10}
    assert recorder.waits == [(0, "live"), (10, "batch")]


async def test_a_wait_past_the_budget_is_a_503_and_leaves_no_trace() -> None:
    flow, recorder = _controller(max_in_flight=1, queue_budget_s=0.01)
    live = flow.tenant_of("k-live", {})
    running = await flow.admit(live, 0, 1)
    with pytest.raises(QueueRefusal) as info:
        await flow.admit(live, 0, 1)
    err = info.value
    assert (err.status_code, err.code, err.headers()[REASON_HEADER]) == (503, "queue_timeout", "queue_timeout")
    assert "Retry-After" in err.headers()
    assert flow.queued == 0 and flow.in_flight == 1
    running.release()
    running.release()  # a second release frees nothing more
    assert flow.in_flight == 0
    assert ("live", "queue_timeout") in recorder.rejections


async def test_a_full_queue_refuses_at_once() -> None:
    flow, _ = _controller(max_in_flight=1, max_queued=0)
    live = flow.tenant_of("k-live", {})
    await flow.admit(live, 0, 1)
    with pytest.raises(QueueRefusal) as info:
        await flow.admit(live, 0, 1)
    assert info.value.code == "queue_full"


async def test_a_waiter_whose_client_left_gives_its_place_back() -> None:
    flow, _ = _controller(max_in_flight=1)
    live = flow.tenant_of("k-live", {})
    running = await flow.admit(live, 0, 1)
    waiter = asyncio.create_task(flow.admit(live, 0, 1))
    await asyncio.sleep(0)
    assert flow.queued == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flow.queued == 0
    running.release()
    assert flow.in_flight == 0  # the slot did not go to the departed waiter


async def test_over_quota_is_a_429_with_the_buckets_retry_after() -> None:
    flow, recorder = _controller()
    noisy = flow.tenant_of(None, {"x-tenant": "noisy"})
    for _ in range(2):  # its two banked requests
        (await flow.admit(noisy, 0, 1)).release(1, 1)
    with pytest.raises(TenantRateLimitError) as info:
        await flow.admit(noisy, 0, 1)
    err = info.value
    assert (err.status_code, err.code) == (429, "tenant_rate_limit_exceeded")
    assert err.headers()[REASON_HEADER] == "requests_per_minute" and int(err.headers()["Retry-After"]) >= 1
    assert flow.in_flight == 0 and recorder.rejections == [("noisy", "requests_per_minute")]
    # The other tenants are not held by it.
    (await flow.admit(flow.tenant_of("k-live", {}), 0, 1)).release()


async def test_a_front_end_holds_its_share_of_each_quota() -> None:
    clock = [0.0]
    table = parse_tenants("tenants:\n  - {name: t, api_key: k, requests_per_minute: 120}\n")
    flow = FlowController(table, FlowConfig(quota_share=0.5), clock=lambda: clock[0])  # 60 a minute here
    tenant = flow.tenant_of("k", {})
    admitted = 0
    for step in range(600):  # one attempt every 0.1 s for a minute
        clock[0] = step * 0.1
        try:
            (await flow.admit(tenant, 0, 1)).release()
            admitted += 1
        except TenantRateLimitError:
            pass
    assert 60 <= admitted <= 62  # the rate for a minute, plus the 2 s burst it started with


async def test_waiting_requests_count_against_the_quota_and_a_refused_one_is_refunded() -> None:
    clock = [0.0]
    table = parse_tenants("tenants:\n  - {name: t, api_key: k, requests_per_minute: 60}\n")  # 2 banked
    flow = FlowController(table, FlowConfig(max_in_flight=1, queue_budget_s=0.01), clock=lambda: clock[0])
    tenant = flow.tenant_of("k", {})
    running = await flow.admit(tenant, 0, 1)
    waiting = asyncio.create_task(flow.admit(tenant, 0, 1))
    await asyncio.sleep(0)
    # The waiter holds the second request of the bucket: a third is over the quota at once.
    with pytest.raises(TenantRateLimitError):
        await flow.admit(tenant, 0, 1)
    with pytest.raises(QueueRefusal):
        await waiting  # its wait ran out: refunded
    running.release()
    (await flow.admit(tenant, 0, 1)).release()  # so this one fits the quota again


async def test_reserved_slots_are_the_best_bands_alone() -> None:
    flow, _ = _controller(max_in_flight=3, reserved_slots=1)
    live, batch = flow.tenant_of("k-live", {}), flow.tenant_of("k-batch", {})
    first, second = await flow.admit(batch, 10, 1), await flow.admit(batch, 10, 1)
    third = asyncio.create_task(flow.admit(batch, 10, 1))
    await asyncio.sleep(0)
    assert flow.queued == 1 and flow.in_flight == 2  # a slot is free, but it is the live band's
    interactive = await flow.admit(live, 0, 1)  # takes it at once, the batch waiter notwithstanding
    assert flow.in_flight == 3
    first.release()
    await asyncio.sleep(0)
    assert flow.queued == 1 and flow.in_flight == 2  # still only the reserved slot free
    interactive.release()
    late_batch = await third  # two slots free now: the batch may take one
    assert flow.in_flight == 2 and flow.queued == 0
    for lease in (second, late_batch):
        lease.release()
    assert flow.in_flight == 0


def test_reserved_slots_must_leave_one() -> None:
    with pytest.raises(ValueError, match="reserved_slots"):
        FlowConfig(max_in_flight=2, reserved_slots=2)


def test_peek_is_what_pop_hands_out() -> None:
    from prefixserve.router.flow_control.fair_queue import FairQueue

    queue = FairQueue()
    assert queue.peek() is None and not queue.waiting_at_or_before(0)
    queue.push("a", 10, 1, 1)
    b = queue.push("b", 5, 1, 1)
    assert queue.peek() is b and queue.pop() is b
    assert queue.waiting_at_or_before(10) and not queue.waiting_at_or_before(9)
