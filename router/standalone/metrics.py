"""The standalone router's own Prometheus metrics (``GET /metrics`` on the router).

One registry per router (not the process-wide default), so several routers in one
process, tests among them, count apart. Names share the Ray router's
``prefixserve_router_`` prefix; the label ``replica`` is a replica's ring name
(``host:port``) and ``kind`` a decision kind (router/policies/base.py KIND_*).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixserve.router.flow_control.metrics import FlowMetricFamilies


class StandaloneMetrics:
    """Counters and gauges of one standalone router."""

    def __init__(self, policy: str, replicas: list[str], flow: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Flow control's series, when the router has tenants.
        self.flow = FlowMetricFamilies(r) if flow else None
        self.requests = Counter(
            "prefixserve_router_requests",
            "Requests answered by a replica, by the replica and the decision kind that sent them there.",
            ["policy", "replica", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "prefixserve_router_retries",
            "Attempts moved to the next replica before the first byte, by the replica left and why "
            "(connect, 429, 503).",
            ["replica", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "prefixserve_router_ejections",
            "Replicas taken out of routing (failed health probes, or a failure under a request).",
            ["replica", "reason"],
            registry=r,
        )
        self.readmissions = Counter(
            "prefixserve_router_readmissions",
            "Ejected replicas admitted again after good probes.",
            ["replica"],
            registry=r,
        )
        self.stream_errors = Counter(
            "prefixserve_router_upstream_broken",
            "Answers a replica broke off after their first byte (the client got an in-band error).",
            ["replica"],
            registry=r,
        )
        self.stream_migrations = Counter(
            "prefixserve_router_stream_migrations",
            "Streams whose replica died or stopped mid-stream, by why (replica_died, replica_stopping) and "
            "what came of it (migrated: continued on another replica; else why not), per move.",
            ["reason", "result"],
            registry=r,
        )
        self.no_replica = Counter(
            "prefixserve_router_unrouted",
            "Requests no replica answered (every attempt refused or failed before its first byte).",
            registry=r,
        )
        self.in_flight = Gauge(
            "prefixserve_router_in_flight", "Requests this router has open on each replica.", ["replica"], registry=r
        )
        self.admitted = Gauge(
            "prefixserve_router_replica_admitted",
            "1 while a replica takes new requests, 0 while ejected.",
            ["replica"],
            registry=r,
        )
        self.kv_event_blocks = Gauge(
            "prefixserve_router_kv_event_blocks",
            "KV blocks the replicas' KV events say each replica holds (the router's index; --kv-events).",
            ["replica"],
            registry=r,
        )
        self.kv_event_matches = Counter(
            "prefixserve_router_kv_event_matches",
            "Requests of which the KV events said some admitted replica held leading blocks.",
            registry=r,
        )
        self.policy = policy
        for name in replicas:
            self.admitted.labels(name).set(1)
