"""Jain's fairness index of what each tenant was served over a sliding window.

Job: :class:`FairnessWindow` records the tokens served per tenant and answers Jain's index,
``(sum x)^2 / (n * sum x^2)`` over the tenants served in the window, each ``x`` a tenant's
tokens divided by its weight: 1 when every tenant got its weighted share, ``1/n`` when one
tenant got everything.

Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class FairnessWindow:
    """Tokens served per tenant over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._served: deque[tuple[float, str, float]] = deque()
        self._totals: dict[str, float] = {}

    def record(self, tenant: str, tokens: float, now: float) -> None:
        self._served.append((now, tenant, tokens))
        self._totals[tenant] = self._totals.get(tenant, 0.0) + tokens
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._served and self._served[0][0] < now - self.window_s:
            _, tenant, tokens = self._served.popleft()
            left = self._totals[tenant] - tokens
            if left <= 1e-9:
                del self._totals[tenant]
            else:
                self._totals[tenant] = left

    def shares(self, now: float) -> dict[str, float]:
        """Tokens served per tenant within the window."""
        self._expire(now)
        return dict(self._totals)

    def index(self, now: float, weights: Mapping[str, float] | None = None) -> float | None:
        """Jain's index of the weighted shares; None when no tenant was served in the window."""
        return jain_index([v / (weights or {}).get(t, 1.0) for t, v in self.shares(now).items()])


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index of ``values`` (None for none, 1 when all are 0)."""
    if not values:
        return None
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)
