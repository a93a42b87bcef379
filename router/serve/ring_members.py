"""The request router's ring membership: which name each live replica takes on the ring.

Job: name the live replicas (by their reported Serve rank, else their full id), keep the
name -> replica table and the ring version, publish the ring gauges, and say which names
left or passed to another replica (whatever the router knew of such a name is no longer
trusted).

A replica is placed by its rank's name (replica/contract/routing.py ``ring_name``:
``app#deployment#rank-N``); a replacement gets its predecessor's rank from Serve, so it
takes the same ring points and its predecessor's keys. Until a replica has reported a
rank, or while two live replicas report the same one (a reassignment in flight), it is
placed by its full replica id (``SERVE_REPLICA::app#deployment#id``).

Pure Python: Ray only for type checking.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prefixserve.replica.contract.routing import ring_name
from prefixserve.router.serve.metrics import RouterMetrics

if TYPE_CHECKING:
    from ray.serve.request_router import ReplicaID


def replica_name(replica_id: ReplicaID) -> str:
    """A Serve replica's full id, stable for the replica's life: its ring name while it has no rank."""
    name: str = replica_id.to_full_id_str()
    return name


def reported_rank(stats: Mapping[str, Any]) -> int | None:
    """The Serve rank a routing-stats report carries (None: none, or not a rank)."""
    rank = stats.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None


def member_names(replicas: Sequence[ReplicaID], ranks: Mapping[ReplicaID, int]) -> dict[ReplicaID, str]:
    """Each live replica's ring name: its rank's name when no other live replica reports that rank, else its id."""
    holders: defaultdict[int, int] = defaultdict(int)
    for rid in replicas:
        if rid in ranks:
            holders[ranks[rid]] += 1
    names = {}
    for rid in replicas:
        rank = ranks.get(rid)
        if rank is not None and holders[rank] == 1:
            names[rid] = ring_name(rid.deployment_id.app_name, rid.deployment_id.name, rank)
        else:
            names[rid] = replica_name(rid)
    return names


class RingMembership:
    """The ring's members by name, its version (bumped when the set of names changes) and its gauges."""

    def __init__(self, metrics: RouterMetrics, deployment: str) -> None:
        self._metrics = metrics
        self._deployment = deployment
        self._names: dict[ReplicaID, str] = {}  # each live replica's ring name (member_names)
        self._members: dict[str, ReplicaID] = {}  # the ring: name -> the replica holding it
        self._version = -1  # the first membership becomes version 0

    def name_of(self, replica_id: ReplicaID) -> str:
        """The replica's ring name: by its reported rank, else its full id."""
        return self._names.get(replica_id) or replica_name(replica_id)

    def update(
        self, live: Sequence[ReplicaID], ranks: Mapping[ReplicaID, int], in_flight: Mapping[ReplicaID, int]
    ) -> list[str]:
        """Bring the members up to ``live`` and return the names that left or passed to another replica.

        ``in_flight``: the router's own count per replica, restated on the gauge of a name that joins.
        """
        self._names = member_names(live, ranks)
        members = {name: rid for rid, name in self._names.items()}
        departed = [name for name, rid in self._members.items() if members.get(name) != rid]
        for name in departed:
            for gauge in (self._metrics.ring_member, self._metrics.in_flight):
                try:
                    gauge.remove(self._deployment, name)
                except KeyError:
                    pass
        for name, rid in members.items():
            if self._members.get(name) != rid:
                self._metrics.ring_member.labels(self._deployment, name).set(1)
                if rid in in_flight:
                    self._metrics.in_flight.labels(self._deployment, name).set(in_flight[rid])
        if set(members) != set(self._members) or self._version < 0:
            self._version += 1
            self._metrics.ring_version.labels(self._deployment).set(self._version)
        self._members = members
        self._metrics.ring_size.labels(self._deployment).set(len(live))
        return departed
