"""Weighted fair queuing within priority bands."""

from __future__ import annotations

from collections import Counter

from prefixserve.router.flow_control.fair_queue import FairQueue
from prefixserve.router.flow_control.fairness import FairnessWindow, jain_index
from prefixserve.router.flow_control.quota import TenantQuota, TokenBucket


def _drain(queue: FairQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        item = queue.pop()
        assert item is not None
        out.append(item.tenant)
    return out


def test_lower_band_first_whatever_the_arrival() -> None:
    queue = FairQueue()
    queue.push("batch", 10, 1, 1)
    queue.push("batch", 10, 1, 1)
    queue.push("live", 0, 1, 1)
    assert _drain(queue, 3) == ["live", "batch", "batch"]
    assert queue.pop() is None


def test_equal_weights_alternate_against_a_flood() -> None:
    queue = FairQueue()
    for _ in range(50):
        queue.push("flood", 0, 100, 1)
    for _ in range(5):
        queue.push("light", 0, 100, 1)
    first = _drain(queue, 10)
    assert Counter(first) == {"flood": 5, "light": 5}  # FIFO would serve the flood's 50 first


def test_weights_share_in_proportion() -> None:
    queue = FairQueue()
    for _ in range(300):
        queue.push("heavy", 0, 10, 3)
        queue.push("light", 0, 10, 1)
    served = Counter(_drain(queue, 200))
    assert abs(served["heavy"] / served["light"] - 3) < 0.1


def test_costs_count_not_requests() -> None:
    queue = FairQueue()
    for _ in range(100):
        queue.push("long", 0, 400, 1)
        queue.push("short", 0, 100, 1)
    served = Counter(_drain(queue, 100))
    assert served["short"] > 3 * served["long"]


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = FairQueue()
    for _ in range(20):
        queue.push("busy", 0, 1, 1)
    _drain(queue, 10)
    for _ in range(10):
        queue.push("late", 0, 1, 1)
    # The newcomer starts at the band's virtual time: it alternates, it does not go ten in a row.
    assert Counter(_drain(queue, 10)) == {"busy": 5, "late": 5}


def test_remove_takes_a_waiter_out_once() -> None:
    queue = FairQueue()
    a = queue.push("a", 0, 1, 1)
    b = queue.push("b", 0, 1, 1)
    assert queue.remove(a) and not queue.remove(a)
    assert len(queue) == 1 and queue.sizes() == {(0, "b"): 1}
    assert queue.pop() is b and not queue.remove(b) and len(queue) == 0


def test_token_bucket_refills_to_capacity_and_tells_the_wait() -> None:
    bucket = TokenBucket.per_minute(60)  # 1 a second, 2 s of it banked
    assert bucket.capacity == 2
    bucket.take(2, now=0.0)
    assert bucket.wait_s(1, now=0.0) == 1.0
    assert bucket.wait_s(1, now=0.5) == 0.5
    assert bucket.wait_s(1, now=100.0) == 0.0 and bucket.level == 2


def test_tenant_quota_reserves_then_settles_tokens() -> None:
    quota = TenantQuota(requests_per_minute=None, tokens_per_minute=600)  # 10 a second, 20 banked
    assert quota.check(0.0) is None
    quota.reserve(70, 0.0)  # admitted out of debt; now 50 in debt
    refusal = quota.check(0.0)
    assert refusal is not None and refusal.kind == "tokens" and refusal.retry_after_s == 5
    quota.settle(70, 30, 0.0)  # it used 30: the level is back to -10
    assert quota.tokens is not None and quota.tokens.level == -10
    assert quota.check(1.0) is None  # a second of refill


def test_request_quota_refuses_with_retry_after() -> None:
    quota = TenantQuota(requests_per_minute=6, tokens_per_minute=None)  # one per 10 s, two banked
    quota.reserve(0, 0.0)
    quota.reserve(0, 0.0)
    refusal = quota.check(1.0)
    assert refusal is not None and refusal.kind == "requests" and refusal.retry_after_s == 9
    assert quota.check(10.0) is None


def test_jain_index() -> None:
    assert jain_index([]) is None
    assert jain_index([5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    window = FairnessWindow(window_s=10)
    window.record("a", 100, now=0.0)
    window.record("b", 100, now=5.0)
    assert window.index(now=5.0) == 1.0
    assert window.index(now=12.0) == 1.0  # a's share left the window: one tenant alone
    window.record("a", 300, now=12.0)
    assert window.index(now=12.0, weights={"a": 3.0}) == 1.0  # three times the tokens at three times the weight
