"""The router's Prometheus metrics (``prefixserve_router_*``) and /metrics aggregation.

Job: one registry per process holding what the Serve request router decides
(requests per replica and policy, decisions by kind, decision latency, spills
past the ring owner, ring size and version), and a helper that merges several
Prometheus texts into one exposition with a source label. The ingress's /metrics
merges every ingress replica's router registry (label ``ingress``) and every
engine replica's registry (label ``replica``), so a scrape through the Serve
proxy shows the whole cluster whichever ingress replica answers it, and each
counter series stays monotonic.

The registry is process-global on purpose: Ray Serve builds the request router
inside the ingress process (on its own event-loop thread), and the ingress's
/metrics endpoint reads the same registry. prometheus_client metrics are
thread-safe.

Imports prometheus_client only: no Ray, no HTTP framework, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.common.metric_series import LabeledSeries
from prefixserve.router.flow_control.metrics import FlowMetricFamilies

# Decisions are pure-Python ring walks: tens of microseconds normally, more under
# a big ring or a stalled loop.
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
# Fractions of a prompt cached (predicted or reported): 0 to 1.
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class RouterMetrics:
    """The router's metrics, registered in their own CollectorRegistry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Every series is per deployment, the first of its labels.
        series = LabeledSeries(self.registry, ["deployment"]).family
        self.requests = series(
            Counter,
            "prefixserve_router_requests",
            "Requests the router sent to each replica (accepted attempts), by policy.",
            "policy",
            "replica",
        )
        self.unkeyed_requests = series(
            Counter,
            "prefixserve_router_unkeyed_requests",
            "Requests without a routing key (no static prefix): routed by load alone.",
            "policy",
        )
        self.decisions = series(
            Counter,
            "prefixserve_router_decisions",
            "Requests routed, by policy, replica and decision kind "
            "(owner, spill, fallback, no_key, no_ring: router/policies/base.py's KIND_*).",
            "policy",
            "replica",
            "kind",
        )
        self.decision_seconds = series(
            Histogram,
            "prefixserve_router_decision_seconds",
            "Time the policy took to rank the candidate replicas of one request.",
            "policy",
            buckets=_DECISION_BUCKETS,
        )
        self.stream_migrations = series(
            Counter,
            "prefixserve_router_stream_migrations",
            "Streams whose engine replica stopped serving them mid-stream, by why (replica_died, "
            "replica_stopping) and what came of it (migrated: continued on another replica; else why "
            "not: disabled, several_sequences, limit, draining, refused), per move.",
            "reason",
            "result",
        )
        self.spills = series(
            Counter,
            "prefixserve_router_spills",
            "Keyed requests served by a replica other than their ring owner "
            "(bounded load spilled them, or the owner was full).",
            "policy",
        )
        self.ring_size = series(
            Gauge, "prefixserve_router_ring_size", "Replicas on the router's ring (the live replicas it routes over)."
        )
        self.ring_version = series(
            Gauge,
            "prefixserve_router_ring_version",
            "Changes of the ring's membership this router has seen (0: the first ring).",
        )
        self.ring_member = series(
            Gauge,
            "prefixserve_router_ring_member",
            "1 for each replica on the router's ring (its full Serve replica id).",
            "replica",
        )
        self.in_flight = series(
            Gauge,
            "prefixserve_router_in_flight",
            "Requests this router has in flight on each replica (its own bookkeeping).",
            "replica",
        )
        self.kv_events = series(
            Counter,
            "prefixserve_router_kv_events",
            "KV events (BlockStored / BlockRemoved) received from each replica's routing stats.",
            "replica",
            "type",
        )
        self.kv_event_gaps = series(
            Counter,
            "prefixserve_router_kv_event_gaps",
            "KV-event payloads applied after a gap in a replica's sequence (reports this router never saw).",
            "replica",
        )

        self.placed_branches = series(
            Counter,
            "prefixserve_router_placed_branches",
            "placed's decisions by branch: history, new_conversation, owner, placed, replicated, spill, "
            "no_key (router/policies/base.py's KIND_*), and fallback (the request landed elsewhere than ranked first).",
            "branch",
        )
        self.predicted_cached_fraction = series(
            Histogram,
            "prefixserve_router_predicted_cached_fraction",
            "Per decision with a history: the fraction of the prompt's blocks the router's index says are "
            "cached on the chosen replica (which=chosen) and on the best replica anywhere (which=best).",
            "which",
            buckets=_FRACTION_BUCKETS,
        )
        self.reported_cached_fraction = series(
            Histogram,
            "prefixserve_router_reported_cached_fraction",
            "Per request: the fraction of its prompt tokens the engine reported cached (usage).",
            buckets=_FRACTION_BUCKETS,
        )
        self.history_index_entries = series(
            Gauge,
            "prefixserve_router_history_index_entries",
            "Block hashes in the router's history index (bounded; least recently used evicted).",
        )
        self.ignored_request_fields = series(
            Counter,
            "prefixserve_router_ignored_request_fields",
            "Request fields the ingress does not know, ignored as vLLM ignores them, by field name "
            "(one per request that sent it; ingress.strict_request_fields refuses them instead).",
            "field",
        )
        self.history_unhashable = series(
            Counter,
            "prefixserve_router_history_unhashable",
            "Requests whose prompt the router could not hash: routed by their static key, then load.",
        )

        self.response_store_entries = series(
            Gauge,
            "prefixserve_router_response_store_entries",
            "Responses the ingress replica holds for /v1/responses' previous_response_id and GET (bounded).",
        )
        self.response_store_bytes = series(
            Gauge,
            "prefixserve_router_response_store_bytes",
            "Bytes of the responses and conversations the ingress replica holds for /v1/responses (bounded).",
        )

        # Flow control's (router/flow_control/metrics.py), filled when the ingress has tenants.
        self.flow = FlowMetricFamilies(self.registry, ["deployment"])

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


_PROCESS_METRICS: RouterMetrics | None = None


def router_metrics() -> RouterMetrics:
    """The process-wide RouterMetrics (created on first use)."""
    global _PROCESS_METRICS
    if _PROCESS_METRICS is None:
        _PROCESS_METRICS = RouterMetrics()
    return _PROCESS_METRICS


class _Families:
    """A prometheus_client collector yielding already-built metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_expositions(texts: Mapping[str, str], label: str = "replica") -> bytes:
    """Merge several Prometheus text expositions into one, tagging each sample.

    ``texts`` maps a source name (an engine replica's ring name) to its
    exposition; every sample gets ``label=<name>``. Families of the same name
    from different sources are merged into one family (Prometheus refuses a
    family declared twice).
    """
    merged: dict[str, Metric] = {}
    for source, text in texts.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = target
            for sample in family.samples:
                labels = dict(sample.labels)
                labels[label] = source
                target.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))
    return generate_latest(registry)


def sum_samples(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` in an exposition whose labels include ``labels``.

    Used by the demo and benchmarks to read counters such as
    ``vllm:prefix_cache_hits_total`` out of a replica's /metrics text.
    """
    want = dict(labels or {})
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                total += sample.value
    return total
