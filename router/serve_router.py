"""Ray Serve request router that runs a prefixserve routing policy on the engine deployment.

Job: adapt Ray Serve's ``RequestRouter`` (ray.serve.request_router, Serve 2.60)
to the pure policies of router/policies.py. The ingress computes the routing
key (router/prefix.py) and passes it as ``routing_key`` on the first positional
argument of the engine call (replica/deployment.py's EngineRequest); this router
reads it, ranks the live replicas with the configured policy and returns one
tier per replica, best first. The base class tries the tiers in order: a
replica that is full (its queue length reaches ``max_ongoing_requests``) or
rejects the request moves it to the key's next ring successor.

Invariants:

* Ring membership is exactly the candidate set Serve hands to
  ``choose_replicas``: the base class keeps it equal to the controller's live
  replicas (``update_replicas``) minus those found dead
  (``on_replica_actor_died``), so a dead replica leaves the ring at the next
  decision and its keys move to their ring successors; no other key moves.
* A replica is placed on the ring by its full replica id
  (``SERVE_REPLICA::app#deployment#id``), the name replica/deployment.py reports
  back to clients (``X-Prefixserve-Replica``).
* In-flight counts are this router's own bookkeeping: requests it routed to a
  replica (``on_request_routed``) that have not completed
  (``on_request_completed``). Not Serve's queue-length cache: its entries mix
  in queue-length probes that can land after the completion they predate, and
  leave an idle replica looking busy for up to the cache timeout, which made
  bounded_load spill keys with nothing in flight. With several ingress
  replicas each router bounds its own share of every replica's load; Serve's
  ``max_ongoing_requests`` (with replica-side rejection) stays the hard limit.
* The router never blocks its event loop: ranking is pure Python, metrics are
  in-process counters.

Configuration (``RequestRouterConfig.request_router_kwargs``, passed to
``initialize_state``): ``policy`` (router/policies.py name, default
``bounded_load``) and that policy's options as its ``Options`` declares them
(e.g. ``epsilon``, ``seed``, ``weights``); any other key is refused.

Imports Ray Serve (this is the adapter); the policy logic stays in router/policies.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from prefixserve.replica.tracing import build_tracer, route_span
from prefixserve.router.metrics import (
    KIND_FALLBACK,
    KIND_NO_KEY,
    KIND_NO_RING,
    KIND_OWNER,
    KIND_SPILL,
    RouterMetrics,
    router_metrics,
)
from prefixserve.router.policies import DEFAULT_POLICY, Policy, make_policy

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# Import path of this router for RequestRouterConfig(request_router_class=...).
ROUTER_CLASS_PATH = "prefixserve.router.serve_router:PrefixRouter"
# Ray Serve LLM's prefix-tree router (the comparison point of the cluster benchmark).
RAY_LLM_PREFIX_ROUTER_PATH = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)
# Remembered decisions (key owner per request) waiting for their routing outcome;
# bounded so that requests cancelled before routing cannot grow it without end.
_MAX_PENDING_DECISIONS = 10_000


def replica_name(replica_id: ReplicaID) -> str:
    """The ring name of a Serve replica: its full id, stable for the replica's life."""
    return replica_id.to_full_id_str()


def is_generation(pending_request: PendingRequest | None) -> bool:
    """True for a generation request (an EngineRequest-like first argument), not a control call."""
    return pending_request is not None and bool(pending_request.args) and hasattr(
        pending_request.args[0], "routing_key"
    )


def request_routing_key(pending_request: PendingRequest | None) -> str | None:
    """The routing key carried by the request's first positional argument (None: no affinity)."""
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "routing_key", None)
    return key if isinstance(key, str) and key else None


@dataclass(frozen=True)
class Choice:
    """What the policy decided for one request: the key's ring owner and its own first choice."""

    keyed: bool
    owner: str | None
    first: str | None


def decision_kind(choice: Choice | None, landed: str) -> str:
    """The decision kind of a request that landed on ``landed`` (router/metrics.py's KIND_*)."""
    if choice is None or not choice.keyed:
        return KIND_NO_KEY
    if choice.owner is not None and landed == choice.owner:
        return KIND_OWNER
    if choice.first is not None and landed != choice.first:
        return KIND_FALLBACK
    return KIND_SPILL if choice.owner is not None else KIND_NO_RING


@dataclass(frozen=True)
class ReplicaLoad:
    """A RunningReplica seen through router/policies.py's ReplicaView."""

    replica: Any  # RunningReplica (or a test double with the same attributes)
    name: str
    in_flight: int


class PrefixRouter(RequestRouter):
    """Routes each request to its routing key's replica with a prefixserve policy."""

    def initialize_state(
        self,
        policy: str = DEFAULT_POLICY,
        metrics: RouterMetrics | None = None,
        otlp_traces_endpoint: str | None = None,
        tracer: Tracer | None = None,
        **options: Any,
    ) -> None:
        """``options`` go to the policy as declared by its ``Options`` (router/policies.py).

        ``otlp_traces_endpoint`` (or, in tests, ``tracer``): record a ``route`` span per
        decision and make it the parent of the engine's spans (replica/tracing.py).
        """
        self._policy: Policy = make_policy(policy, **options)
        if tracer is None and otlp_traces_endpoint is not None:
            tracer = build_tracer("prefixserve-router", otlp_traces_endpoint)
        self._tracer = tracer
        self._metrics = metrics if metrics is not None else router_metrics()
        self._deployment = self._deployment_id.name
        # Per request: the decision (owner, first choice), for the spill and decision-kind metrics.
        self._choices: OrderedDict[str, Choice] = OrderedDict()
        # Requests this router routed and that have not completed: id -> replica.
        self._routed: dict[str, ReplicaID] = {}
        self._own_in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._ring_names: set[str] = set()
        self._ring_version = -1  # the first membership becomes version 0

    @property
    def policy(self) -> Policy:
        return self._policy

    # -- the decision -----------------------------------------------------------------
    def in_flight(self, replica: RunningReplica) -> int:
        """Requests this router sent to ``replica`` that have not completed."""
        return self._own_in_flight.get(replica.replica_id, 0)

    def rank(
        self, candidate_replicas: list[RunningReplica], key: str | None
    ) -> tuple[list[RunningReplica], str | None]:
        """The candidates best first and the key's ring owner (None without a key or ring)."""
        views = [ReplicaLoad(r, replica_name(r.replica_id), self.in_flight(r)) for r in candidate_replicas]
        start = time.perf_counter()
        decision = self._policy.rank(views, key)
        self._metrics.decision_seconds.labels(self._deployment, self._policy.name).observe(
            time.perf_counter() - start
        )
        return [v.replica for v in decision.ranking], decision.owner

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = request_routing_key(pending_request)
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        parent = getattr(request, "trace_headers", None)
        with route_span(self._tracer, parent, {"prefixserve.policy": self._policy.name,
                                               "prefixserve.routing_key": key or ""}) as (span, headers):
            ranking, owner = self.rank(candidate_replicas, key)
            if span is not None:
                span.set_attributes({"prefixserve.owner": owner or "",
                                     "prefixserve.chosen": replica_name(ranking[0].replica_id) if ranking else ""})
                if hasattr(request, "trace_headers"):
                    request.trace_headers = headers  # the engine's spans hang under this decision
        if pending_request is not None:
            # Every tier is on offer, so when all are full the base class should back
            # off before asking again rather than spin.
            pending_request.routing_context.should_backoff = True
            first = replica_name(ranking[0].replica_id) if ranking else None
            self._remember(pending_request.metadata.internal_request_id, Choice(key is not None, owner, first))
        return [[r] for r in ranking]

    def _remember(self, request_id: str, choice: Choice) -> None:
        self._choices[request_id] = choice
        self._choices.move_to_end(request_id)
        while len(self._choices) > _MAX_PENDING_DECISIONS:
            self._choices.popitem(last=False)

    # -- lifecycle hooks --------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        name = replica_name(replica_id)
        choice = self._choices.pop(request_id, None)
        owner = choice.owner if choice is not None else None
        if is_generation(pending_request):  # control calls (model_info, ...) are not counted
            self._metrics.requests.labels(self._deployment, self._policy.name, name).inc()
            self._metrics.decisions.labels(self._deployment, self._policy.name, name,
                                           decision_kind(choice, name)).inc()
            if owner is not None and owner != name:
                self._metrics.spills.labels(self._deployment, self._policy.name).inc()
            if request_routing_key(pending_request) is None:
                self._metrics.unkeyed_requests.labels(self._deployment, self._policy.name).inc()
        if request_id not in self._routed:
            self._routed[request_id] = replica_id
            self._own_in_flight[replica_id] += 1
            self._metrics.in_flight.labels(self._deployment, name).set(self._own_in_flight[replica_id])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed_to = self._routed.pop(internal_request_id, None)
        if routed_to is None:
            return  # a rejected attempt: it was never counted
        count = max(0, self._own_in_flight.get(routed_to, 0) - 1)
        if routed_to in self._own_in_flight:
            self._own_in_flight[routed_to] = count
            self._metrics.in_flight.labels(self._deployment, replica_name(routed_to)).set(count)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_departed()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_departed()

    def _forget_departed(self) -> None:
        live = set(self.curr_replicas)
        for rid in [r for r in self._own_in_flight if r not in live]:
            del self._own_in_flight[rid]
            try:
                self._metrics.in_flight.remove(self._deployment, replica_name(rid))
            except KeyError:
                pass
        names = {replica_name(r) for r in live}
        for name in self._ring_names - names:
            try:
                self._metrics.ring_member.remove(self._deployment, name)
            except KeyError:
                pass
        for name in names - self._ring_names:
            self._metrics.ring_member.labels(self._deployment, name).set(1)
        if names != self._ring_names or self._ring_version < 0:
            self._ring_version += 1
            self._metrics.ring_version.labels(self._deployment).set(self._ring_version)
        self._ring_names = names
        self._metrics.ring_size.labels(self._deployment).set(len(live))
