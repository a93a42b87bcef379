"""Token buckets: a tenant's requests and tokens per minute, and how long to wait when over.

Job: :class:`TokenBucket` (a level refilled at a steady rate up to a capacity) and
:class:`TenantQuota` (a tenant's request and token buckets). Token costs are only known once a
request ends, so tokens are reserved then settled (the reserve/settle model of SGLang's gateway):
admission reserves an estimate and needs the bucket out of debt, the end of the request settles
the estimate against the prompt and completion tokens it really used. A tenant therefore never
runs more than one request's worth past its quota, whatever its concurrency.

Pure: time is passed in (seconds, any monotonic clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A bucket holds this many seconds of its rate, and at least MIN_BURST units: the burst a tenant may
# send after being idle. Two units, not one: a bucket that holds one request wastes its refill while
# it waits full for the next arrival, and admits well under the rate of a tenant sending at random.
BURST_S = 2.0
MIN_BURST = 2.0


@dataclass
class TokenBucket:
    """``rate`` units per second, at most ``capacity`` banked; the level may go below 0 (debt)."""

    rate: float
    capacity: float
    level: float = field(init=False)
    _at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.capacity > 0:
            raise ValueError(f"a token bucket needs rate and capacity > 0, got {self.rate}, {self.capacity}")
        self.level = self.capacity

    @classmethod
    def per_minute(cls, amount: float, min_capacity: float = MIN_BURST) -> TokenBucket:
        """``amount`` a minute, bursting up to BURST_S seconds' worth (at least ``min_capacity``)."""
        rate = amount / 60.0
        return cls(rate, max(min_capacity, rate * BURST_S))

    def refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the level reaches ``amount`` (0 when it has)."""
        self.refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` (the level may go into debt: callers check ``wait_s`` first)."""
        self.refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class QuotaRefusal:
    """Why a request is over its tenant's quota, and the Retry-After (whole seconds, at least 1)."""

    kind: str  # "requests" or "tokens"
    retry_after_s: int


class TenantQuota:
    """One tenant's request and token buckets (either absent: no quota of that kind)."""

    def __init__(self, requests_per_minute: float | None, tokens_per_minute: float | None) -> None:
        self.requests = TokenBucket.per_minute(requests_per_minute) if requests_per_minute else None
        self.tokens = TokenBucket.per_minute(tokens_per_minute) if tokens_per_minute else None

    def check(self, now: float) -> QuotaRefusal | None:
        """None when a request may start now, else which bucket is short and for how long."""
        if self.requests is not None and (wait := self.requests.wait_s(1.0, now)) > 0:
            return QuotaRefusal("requests", max(1, math.ceil(wait)))
        # Tokens: admitted while out of debt (a reserve may then take the level below 0).
        if self.tokens is not None and (wait := self.tokens.wait_s(0.0, now)) > 0:
            return QuotaRefusal("tokens", max(1, math.ceil(wait)))
        return None

    def reserve(self, estimated_tokens: int, now: float) -> None:
        """Charge an admitted request: one request, and its estimated tokens until it settles."""
        if self.requests is not None:
            self.requests.take(1.0, now)
        if self.tokens is not None:
            self.tokens.take(float(estimated_tokens), now)

    def refund(self, estimated_tokens: int, now: float) -> None:
        """Undo a reserve: the request did not run."""
        if self.requests is not None:
            self.requests.give_back(1.0, now)
        if self.tokens is not None:
            self.tokens.give_back(float(estimated_tokens), now)

    def settle(self, estimated_tokens: int, used_tokens: int, now: float) -> None:
        """Replace a request's reserved estimate with the tokens it used."""
        if self.tokens is None:
            return
        if used_tokens >= estimated_tokens:
            self.tokens.take(float(used_tokens - estimated_tokens), now)
        else:
            self.tokens.give_back(float(estimated_tokens - used_tokens), now)
