"""The replicas' routing-stats reports as the request router takes them in: load and rank.

Job: keep each live replica's latest report (its queue, KV usage, queued prefill tokens
and Serve rank, from replica/entrypoints/serve/deployment.py ``record_routing_stats``,
every ``stats_period_s``, reaching every router as ``RunningReplica.routing_stats``),
hand on the KV event payloads they carry, and give the load a candidate view shows.

Reports are stale by up to a period (plus the controller's push); the router's own
in-flight count is fresh but sees only its own requests. The candidate view
(:class:`ServeReplicaView`) combines them with one rule: the replica's load is its
report corrected by the router's own change since the report arrived (``own_now -
own_at_report``: requests sent since are added as waiting, requests completed since are
taken off waiting first, then running), never below 0; ``in_flight`` stays the router's
own count. A report older than ``max_age_s`` is ignored.

Pure Python: Ray only for type checking.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.router.policies import ReplicaLoad
from prefixserve.router.serve.ring_members import reported_rank

if TYPE_CHECKING:
    from ray.serve.request_router import ReplicaID


class ReportingReplica(Protocol):
    """What the intake reads of a RunningReplica (or a test double)."""

    @property
    def replica_id(self) -> ReplicaID: ...

    @property
    def routing_stats(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class ServeReplicaView:
    """A RunningReplica seen through router/policies/base.py's ReplicaView, with its reported load."""

    replica: Any  # RunningReplica (or a test double with the same attributes)
    name: str
    in_flight: int
    load: ReplicaLoad | None = None


@dataclass(frozen=True)
class Report:
    """A replica's routing-stats report as this router received it."""

    seq: Any
    load: ReplicaLoad
    own_at_report: int  # this router's own in-flight count on the replica when the report arrived
    arrived: float  # time.monotonic()


def parse_load(stats: Mapping[str, Any]) -> ReplicaLoad | None:
    """The ReplicaLoad of a routing-stats dict (None when it has no valid load fields)."""
    adapters = stats.get("lora_adapters", ())
    capacity = stats.get("lora_capacity", 0)
    try:
        return ReplicaLoad(
            num_waiting=int(stats["num_waiting"]),
            num_running=int(stats["num_running"]),
            kv_usage=min(1.0, max(0.0, float(stats.get("kv_usage", 0.0)))),
            queued_prefill_tokens=int(stats.get("queued_prefill_tokens", 0)),
            adapters=frozenset(a for a in adapters if isinstance(a, str))
            if isinstance(adapters, list)
            else frozenset(),
            adapter_capacity=max(0, int(capacity)),
            kv_capacity_tokens=max(0, int(stats.get("kv_capacity_tokens", 0))),
        )
    except (KeyError, TypeError, ValueError):
        return None


def corrected_load(report: Report, own_now: int) -> ReplicaLoad:
    """The report corrected by this router's own change since it arrived (the module docstring's rule)."""
    return report.load.corrected(report.own_at_report, own_now)


@dataclass
class Intake:
    """What one pass over the reports found: whether a replica's rank changed, and the KV event payloads."""

    renamed: bool = False
    kv_events: list[tuple[ReplicaID, Any]] = field(default_factory=list)


class ReplicaReports:
    """The latest report and rank of each live replica."""

    def __init__(self, max_age_s: float) -> None:
        self._max_age_s = float(max_age_s)
        self._reports: dict[ReplicaID, Report] = {}
        self.ranks: dict[ReplicaID, int] = {}  # the last rank each live replica reported

    def take(self, replicas: Iterable[ReportingReplica], own: Mapping[ReplicaID, int], now: float) -> Intake:
        """Take in every new report of ``replicas`` (a report repeating the last one's ``seq`` is not new).

        ``own``: the router's own in-flight count per replica (the base of the load correction).
        """
        intake = Intake()
        for r in replicas:
            stats = r.routing_stats
            if not isinstance(stats, Mapping) or not stats:
                continue
            rid = r.replica_id
            seq = stats.get("seq")
            old = self._reports.get(rid)
            if old is not None and seq is not None and old.seq == seq:
                continue
            load = parse_load(stats)
            if load is not None:
                self._reports[rid] = Report(seq, load, own.get(rid, 0), now)
            rank = reported_rank(stats)
            if rank != self.ranks.get(rid):
                intake.renamed = True
                if rank is None:
                    del self.ranks[rid]
                else:
                    self.ranks[rid] = rank
            events = stats.get("kv_events")
            if events is not None:
                intake.kv_events.append((rid, events))
        return intake

    def load(self, replica_id: ReplicaID, own_now: int, now: float) -> ReplicaLoad | None:
        """The replica's reported load corrected by the router's own change since (None: no recent report)."""
        report = self._reports.get(replica_id)
        if report is None or now - report.arrived > self._max_age_s:
            return None
        return corrected_load(report, own_now)

    def forget(self, live: set[ReplicaID]) -> None:
        """Drop the reports and ranks of replicas not in ``live``."""
        for rid in [r for r in self._reports if r not in live]:
            del self._reports[rid]
        for rid in [r for r in self.ranks if r not in live]:
            del self.ranks[rid]
