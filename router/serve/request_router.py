"""Ray Serve request router that runs a prefixserve routing policy on the engine deployment.

Job: adapt Ray Serve's ``RequestRouter`` (ray.serve.request_router, Serve 2.60) to the
pure policies of router/policies/. The ingress computes the routing key
(router/routing_key.py) and sets it on the EngineRequest it sends
(router/serve/routing_hints.py reads it); this router ranks the live replicas with the
configured policy and returns one tier per replica, best first. The base class tries the
tiers in order: a replica that is full (its queue length reaches ``max_ongoing_requests``)
or rejects the request moves it to the key's next ring successor.

The adapter composes small parts, each free of Ray:

* router/serve/ring_members.py: each live replica's ring name (its reported rank's, else
  its full id) and the ring gauges;
* router/serve/replica_reports.py: the replicas' routing-stats reports (load, rank) and
  the candidate view's load rule;
* router/serve/event_intake.py: the KV events those reports carry, fed to the policy;
* router/serve/history_feed.py: ``placed``'s conversation index (prompt hashes, history);
* router/serve/placement_sync.py: the placement agreement between ingress routers;
* router/serve/ranking.py: one ranking by the policy, and its metrics;
* router/serve/decisions.py: decisions until routed, and this router's own in-flight counts.

Invariants:

* Ring membership is exactly the candidate set Serve hands to ``choose_replicas``: the
  base class keeps it equal to the controller's live replicas (``update_replicas``) minus
  those found dead (``on_replica_actor_died``), so a dead replica leaves the ring at the
  next decision and its keys move to their ring successors; no other key moves. A
  replacement gets its predecessor's rank from Serve, so it takes the same ring points and
  its predecessor's keys come back to it. The ring name is what
  replica/entrypoints/serve/deployment.py reports back to clients (``X-Prefixserve-Replica``).
  Whatever this router knows of a name (KV events, history, metrics) is dropped when the
  name leaves the ring or passes to another replica.
* Load: the policy sees per candidate this router's own in-flight count and the replica's
  reported load corrected by this router's change since (router/serve/replica_reports.py),
  and takes the larger of the two (router/policies/ ``effective_in_flight``), so with
  several ingress replicas every router sees the whole cluster's queue, and its own
  requests without delay.
* ``placed`` placements agree across routers through the ingress (router/serve/ingress.py):
  the leader router rebalances and publishes ``placement_snapshot``; followers
  ``apply_placement``. A request is counted in the placement once (``count=False`` when
  Serve asks again for the same request), and the counts a follower routed since the last
  sync are handed to the leader (``take_counts`` / ``merge_counts``).
* Thread safety: Ray runs the router on its own event-loop thread and the ingress's
  methods on another; every use of the policy holds one lock (router/serve/policy_slot.py).
* The router never blocks its event loop: ranking is pure Python, metrics are in-process
  counters.

Configuration (``RequestRouterConfig.request_router_kwargs``, passed to
``initialize_state``): ``policy`` (a router/policies/ name, default ``placed``),
``stats_max_age_s``, and that policy's options as its ``Options`` declares them (e.g.
``epsilon``, ``seed``, ``weights``); any other key is refused.

Imports Ray Serve (this is the adapter). Serve ships this module to the router's process
by value (a cloudpickle of it); the parts above are imported there by reference.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from prefixserve.common.tracing import build_tracer, route_span
from prefixserve.replica.contract.prompt_blocks import PromptBlocks
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.retention import RETENTION_24H
from prefixserve.router.cluster_config import DEFAULT_STATS_MAX_AGE_S
from prefixserve.router.policies import DEFAULT_POLICY, KIND_FALLBACK, Placed, Policy, ReplicaLoad, make_policy
from prefixserve.router.serve import registry
from prefixserve.router.serve.decisions import Choice, OwnRequests, PendingDecisions, decision_kind
from prefixserve.router.serve.event_intake import KVEventIntake
from prefixserve.router.serve.history_feed import HistoryFeed
from prefixserve.router.serve.metrics import RouterMetrics, router_metrics
from prefixserve.router.serve.placement_sync import PlacementSync
from prefixserve.router.serve.policy_slot import PolicySlot
from prefixserve.router.serve.ranking import Ranker
from prefixserve.router.serve.replica_reports import ReplicaReports, ServeReplicaView
from prefixserve.router.serve.ring_members import RingMembership, replica_name
from prefixserve.router.serve.routing_hints import is_generation, request_routing_key, routing_hints

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# Public names other code imports from here (router/cluster_config.py's ROUTER_CLASS_PATH names PrefixRouter).
__all__ = [
    "PrefixRouter",
    "ServeReplicaView",
    "is_generation",
    "replica_name",
    "request_routing_key",
    "router_for",
]


def router_for(app_name: str, deployment: str) -> PrefixRouter | None:
    """The PrefixRouter this process runs for ``app_name``'s ``deployment`` (None before its first request).

    Kept in router/serve/registry.py: Serve ships this module to the process by value,
    so a table here would be a private copy.
    """
    router = registry.router_for(app_name, deployment)
    return router if hasattr(router, "placement_snapshot") else None


class PrefixRouter(RequestRouter):
    """Routes each request to its routing key's replica with a prefixserve policy."""

    def initialize_state(
        self,
        policy: str = DEFAULT_POLICY,
        metrics: RouterMetrics | None = None,
        otlp_traces_endpoint: str | None = None,
        tracer: Tracer | None = None,
        stats_max_age_s: float = DEFAULT_STATS_MAX_AGE_S,
        **options: Any,
    ) -> None:
        """``options`` go to the policy as declared by its ``Options`` (router/policies/).

        ``otlp_traces_endpoint`` (or, in tests, ``tracer``): record a ``route`` span per
        decision and make it the parent of the engine's spans (common/tracing.py).
        ``stats_max_age_s``: replica reports older than this are not used.
        """
        self._slot = PolicySlot(make_policy(policy, **options))
        self._lock = self._slot.lock
        if tracer is None and otlp_traces_endpoint is not None:
            tracer = build_tracer("prefixserve-router", otlp_traces_endpoint)
        self._tracer = tracer
        self._metrics = metrics if metrics is not None else router_metrics()
        self._deployment = self._deployment_id.name
        self._ring = RingMembership(self._metrics, self._deployment)
        self._reports = ReplicaReports(stats_max_age_s)
        self._own = OwnRequests()
        self._pending_choices = PendingDecisions()
        self._history = HistoryFeed(self._slot, self._metrics, self._deployment)
        self._kv_intake = KVEventIntake(self._slot, self._history, self._metrics, self._deployment)
        self._placement = PlacementSync(self._slot, self._metrics, self._deployment)
        self._ranker = Ranker(self._slot, self._placement, self._metrics, self._deployment)
        registry.register(self._deployment_id.app_name, self._deployment, self)

    @property
    def _policy(self) -> Policy:
        return self._slot.policy

    @_policy.setter
    def _policy(self, policy: Policy) -> None:
        # A subclass runs another policy by assigning it (loadtest/peers/serve_adapter.py).
        self._slot.policy = policy

    @property
    def policy(self) -> Policy:
        return self._slot.policy

    @property
    def placed(self) -> Placed | None:
        """The policy when it is ``placed`` (placements, snapshots, precise hook), else None."""
        return self._slot.placed

    # -- replica reports --------------------------------------------------------------
    def name_of(self, replica_id: ReplicaID) -> str:
        """The replica's ring name (router/serve/ring_members.py): by its reported rank, else its full id."""
        return self._ring.name_of(replica_id)

    def refresh_reports(self, replicas: list[RunningReplica]) -> None:
        """Take in every new routing-stats report of ``replicas`` (rank, load, KV events)."""
        intake = self._reports.take(replicas, self._own.counts, time.monotonic())
        if intake.renamed:
            self._forget_departed()
        for rid, events in intake.kv_events:  # under the names the reports just gave
            self._take_kv_events(self.name_of(rid), events)

    def _take_kv_events(self, name: str, payload: Any) -> None:
        self._kv_intake.take(name, payload)

    def kv_held(self) -> dict[str, list[str]]:
        """Per routing key, the replicas this router's KV events say hold its prefix."""
        return self._kv_intake.held()

    @property
    def kv_event_gaps(self) -> int:
        """KV-event diffs applied after a gap (missed reports; router/serve/metrics.py kv_event_gaps)."""
        return self._kv_intake.gaps

    def replica_load(self, replica: RunningReplica) -> ReplicaLoad | None:
        """The replica's reported load corrected by this router's own change since (None: no recent report)."""
        return self._reports.load(replica.replica_id, self.in_flight(replica), time.monotonic())

    def view(self, replica: RunningReplica) -> ServeReplicaView:
        return ServeReplicaView(
            replica, self.name_of(replica.replica_id), self.in_flight(replica), self.replica_load(replica)
        )

    # -- placement agreement (placed) -------------------------------------------------
    def placement_snapshot(self) -> dict[str, Any] | None:
        """The policy's placement snapshot (JSON-serializable), None when the policy is not ``placed``."""
        return self._placement.snapshot()

    @property
    def is_leader(self) -> bool:
        return self._placement.is_leader

    def set_leader(self, leader: bool) -> None:
        """Make this router the placement leader (rebalances) or a follower (applies snapshots)."""
        self._placement.set_leader(leader)

    def apply_placement(self, snapshot: Mapping[str, Any]) -> None:
        """Adopt the leader's snapshot (a follower)."""
        self._placement.apply(snapshot)

    def take_counts(self) -> dict[str, list[int]]:
        """The requests and uncached prompt tokens per key routed since the last call (and reset)."""
        return self._placement.take_counts()

    def merge_counts(self, counts: Mapping[str, Any]) -> None:
        """Count another router's requests in this (leader's) placement: ``{key: [requests, tokens]}``."""
        self._placement.merge_counts(counts)

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The prefill work of a finished request of ``key`` (the ingress reports it from the usage)."""
        self._placement.observe(key, prompt_tokens, cached_tokens)

    def refused(self, key: str) -> None:
        """A request of ``key`` its replica refused as a client error (the ingress reports it): the
        placement keeps no key of refused requests."""
        self._placement.refused(key)

    # -- the decision -----------------------------------------------------------------
    def in_flight(self, replica: RunningReplica) -> int:
        """Requests this router sent to ``replica`` that have not completed."""
        return self._own.count(replica.replica_id)

    def rank(
        self,
        candidate_replicas: list[RunningReplica],
        key: str | None,
        count: bool = True,
        blocks: PromptBlocks | None = None,
        retained: bool = False,
        adapter: str | None = None,
    ) -> tuple[list[RunningReplica], str | None]:
        """The candidates best first and the key's ring owner (None without a key or ring).

        ``count=False``: Serve asks again for a request already ranked (``placed`` counts it once).
        ``blocks``: the prompt's history hashes (router/serve/history_feed.py), for ``placed``.
        ``retained``: the request asks for prompt_cache_retention; ``placed`` keeps its key where it is.
        ``adapter``: the request's LoRA adapter; ``placed`` prefers replicas reporting it loaded.
        """
        self.refresh_reports(candidate_replicas)
        views = [self.view(r) for r in candidate_replicas]
        decision = self._ranker.rank(views, key, count, blocks, retained, adapter)
        return [v.replica for v in decision.ranking], decision.owner

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hints = routing_hints(pending_request)
        key = hints.key if hints is not None else None
        request: EngineRequest | None = hints.request if hints is not None else None
        parent = request.trace_headers if request is not None else None
        with route_span(
            self._tracer, parent, {"prefixserve.policy": self._policy.name, "prefixserve.routing_key": key or ""}
        ) as (span, headers):
            seen = pending_request is not None and pending_request.metadata.internal_request_id in self._pending_choices
            blocks = self._history.blocks(request) if not seen else None
            retained = request is not None and request.cache_retention == RETENTION_24H
            adapter = request.lora_name if request is not None else None
            ranking, owner = self.rank(
                candidate_replicas, key, count=not seen, blocks=blocks, retained=retained, adapter=adapter
            )
            if request is not None and request.home_replica is not None:
                ranking = self._home_first(ranking, request.home_replica)
            if request is not None and request.avoid_replicas:
                ranking = self._avoided_last(ranking, request.avoid_replicas)
            if span is not None:
                span.set_attributes(
                    {
                        "prefixserve.owner": owner or "",
                        "prefixserve.chosen": self.name_of(ranking[0].replica_id) if ranking else "",
                    }
                )
                if request is not None:
                    request.trace_headers = headers  # the engine's spans hang under this decision
        if pending_request is not None:
            # Every tier is on offer, so when all are full the base class should back
            # off before asking again rather than spin.
            pending_request.routing_context.should_backoff = True
            first = self.name_of(ranking[0].replica_id) if ranking else None
            request_id = pending_request.metadata.internal_request_id
            old = self._pending_choices.get(request_id)
            counted = old.key if old is not None else (key if self.placed is not None and key is not None else None)
            choice = Choice(
                key is not None, owner, first, counted, blocks if blocks is not None else old.blocks if old else None
            )
            for dropped in self._pending_choices.remember(request_id, choice):
                self._done(dropped.key)  # never routed (cancelled): its key's in-flight count ends here
        return [[r] for r in ranking]

    def _home_first(self, ranking: list[RunningReplica], home: str) -> list[RunningReplica]:
        """``ranking`` with the replica named ``home`` first when it is a candidate: the conversation a
        request continues is cached there. Gone, the ranking stands (its history decides)."""
        at = next((i for i, r in enumerate(ranking) if self.name_of(r.replica_id) == home), None)
        if not at:
            return ranking
        return [ranking[at], *ranking[:at], *ranking[at + 1 :]]

    def _avoided_last(self, ranking: list[RunningReplica], avoid: tuple[str, ...]) -> list[RunningReplica]:
        """``ranking`` with the replicas named in ``avoid`` (those that failed this request already)
        moved to the end, in their order: tried only when no other replica takes the request."""
        kept = [r for r in ranking if self.name_of(r.replica_id) not in avoid]
        return kept + [r for r in ranking if self.name_of(r.replica_id) in avoid]

    def _done(self, key: str | None) -> None:
        placed = self.placed
        if placed is not None and key is not None:
            with self._lock:
                placed.done(key)

    # -- lifecycle hooks --------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        name = self.name_of(replica_id)
        choice = self._pending_choices.pop(request_id)
        hints = routing_hints(pending_request)
        if hints is not None:  # control calls (model_info, ...) are not counted
            self._count_routed(choice, name, hints.key)
        count = self._own.routed(request_id, replica_id, choice.key if choice is not None else None)
        if count is not None:
            self._metrics.in_flight.labels(self._deployment, name).set(count)

    def _count_routed(self, choice: Choice | None, name: str, key: str | None) -> None:
        """The metrics of a generation request that landed on ``name``, and its history there on a fallback."""
        policy = self._policy.name
        self._metrics.requests.labels(self._deployment, policy, name).inc()
        kind = decision_kind(choice, name)
        self._metrics.decisions.labels(self._deployment, policy, name, kind).inc()
        if self.placed is not None and kind == KIND_FALLBACK:
            self._metrics.placed_branches.labels(self._deployment, KIND_FALLBACK).inc()
            if choice is not None and choice.blocks is not None:
                self._history.record(name, choice.blocks)  # it went here, not to the one ranked first
        if choice is not None and choice.owner is not None and choice.owner != name:
            self._metrics.spills.labels(self._deployment, policy).inc()
        if key is None:
            self._metrics.unkeyed_requests.labels(self._deployment, policy).inc()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        completed = self._own.completed(internal_request_id)
        if completed is None:
            return  # a rejected attempt: it was never counted
        routed_to, key, count = completed
        self._done(key)
        if count is not None:
            self._metrics.in_flight.labels(self._deployment, self.name_of(routed_to)).set(count)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_departed()
        if hasattr(self, "_reports"):  # new routing stats arrive with replica updates too
            self.refresh_reports(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_departed()

    def _forget_departed(self) -> None:
        """Bring the ring's membership (names) up to the live replicas and drop what departed names held."""
        live = list(self.curr_replicas)
        live_set = set(live)
        self._reports.forget(live_set)
        self._own.forget(live_set)
        for name in self._ring.update(live, self._reports.ranks, self._own.counts):
            # Gone, or passed to another replica: nothing known of the name is trusted.
            self._kv_intake.forget(name)
            self._history.forget(name)
