"""Flow control's Prometheus series, for whichever registry a front end keeps.

Job: :class:`FlowMetricFamilies` declares the series once (names, help, labels, buckets) in a
registry, behind any labels the front end puts first (the Ray ingress: ``deployment``; the
standalone router: none); :class:`FlowMetrics` is the controller's FlowObserver over them.

Imports prometheus_client only.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Waits in the queue: from a freed slot's hand-over to a whole queue budget.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FlowMetricFamilies:
    """The flow-control series in ``registry``, each with ``shared`` labels first."""

    def __init__(self, registry: CollectorRegistry, shared: Sequence[str] = ()) -> None:
        first = list(shared)
        self.queue_size = Gauge(
            "prefixserve_router_flow_queue_size",
            "Requests waiting in flow control's fair queue for a slot, by priority band and tenant.",
            [*first, "band", "tenant"],
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "prefixserve_router_flow_queue_wait_seconds",
            "How long requests that waited for a slot waited, by priority band and tenant.",
            [*first, "band", "tenant"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "prefixserve_router_flow_tokens",
            "Tokens each tenant's finished requests used, by kind (prompt, completion).",
            [*first, "tenant", "kind"],
            registry=registry,
        )
        self.rejections = Counter(
            "prefixserve_router_flow_rejections",
            "Requests flow control refused, by tenant ('-': none named) and reason "
            "(requests_per_minute, tokens_per_minute, queue_timeout, queue_full, unknown_tenant, "
            "priority_not_allowed).",
            [*first, "tenant", "reason"],
            registry=registry,
        )
        self.fairness_index = Gauge(
            "prefixserve_router_flow_fairness_index",
            "Jain's fairness index of the tenants' weighted token shares over the last minute "
            "(1: every tenant served its weighted share).",
            first,
            registry=registry,
        )


class FlowMetrics:
    """Flow control's observer (controller.py's FlowObserver) over ``families``, for the ``shared`` label values."""

    def __init__(self, families: FlowMetricFamilies, *shared: str) -> None:
        self._f = families
        self._shared = shared

    def queued(self, band: int, tenant: str, size: int) -> None:
        self._f.queue_size.labels(*self._shared, str(band), tenant).set(size)

    def waited(self, band: int, tenant: str, seconds: float) -> None:
        self._f.queue_wait_seconds.labels(*self._shared, str(band), tenant).observe(seconds)

    def rejected(self, tenant: str, reason: str) -> None:
        self._f.rejections.labels(*self._shared, tenant, reason).inc()

    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int, fairness: float | None) -> None:
        self._f.tokens.labels(*self._shared, tenant, "prompt").inc(prompt_tokens)
        self._f.tokens.labels(*self._shared, tenant, "completion").inc(completion_tokens)
        if fairness is not None:
            if self._shared:
                self._f.fairness_index.labels(*self._shared).set(fairness)
            else:
                self._f.fairness_index.set(fairness)
