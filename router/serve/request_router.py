"""Ray Serve request router that runs a prefixserve routing policy on the engine deployment.

Job: adapt Ray Serve's ``RequestRouter`` (ray.serve.request_router, Serve 2.60)
to the pure policies of router/policies/. The ingress computes the routing
key (router/routing_key.py) and passes it as ``routing_key`` on the first positional
argument of the engine call (replica/entrypoints/serve/deployment.py's EngineRequest); this router
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
* A replica is placed on the ring by its rank's name
  (replica/contract/routing.py ``ring_name``: ``app#deployment#rank-N``), from the ``rank``
  its routing stats report; a replacement gets its predecessor's rank from Serve, so it
  takes the same ring points and its predecessor's keys come back to it. Until a replica
  has reported a rank, or while two live replicas report the same one (a reassignment in
  flight), it is placed by its full replica id (``SERVE_REPLICA::app#deployment#id``).
  Either is the name replica/entrypoints/serve/deployment.py reports back to clients
  (``X-Prefixserve-Replica``). Whatever this router knows of a name (KV events, history,
  metrics) is dropped when the name leaves the ring or passes to another replica.
* In-flight counts: this router's own bookkeeping of requests it routed to a
  replica (``on_request_routed``) that have not completed
  (``on_request_completed``) is fresh but sees only this router's requests.
  Not Serve's queue-length cache: its entries mix in queue-length probes that
  can land after the completion they predate, and leave an idle replica
  looking busy for up to the cache timeout, which made bounded_load spill keys
  with nothing in flight.
* Replica-reported load: each engine replica reports its queue (waiting,
  running), KV usage and queued prefill tokens in Serve's routing stats
  (replica/entrypoints/serve/deployment.py ``record_routing_stats``, every ``stats_period_s``),
  which reach every router as ``RunningReplica.routing_stats``. Reports are
  stale by up to a period (plus the controller's push), own counts are fresh,
  so the candidate view (:class:`ServeReplicaView`) combines them with one
  rule: the replica's load is its report corrected by this router's own
  change since the report arrived (``own_now - own_at_report``: requests sent
  since are added as waiting, requests completed since are taken off waiting
  first, then running), never below 0; ``in_flight`` stays the router's own
  count. The policy takes the larger of the two (router/policies/
  ``effective_in_flight``), so with several ingress replicas every router sees
  the whole cluster's queue, and its own requests without delay. A report
  older than ``stats_max_age_s`` is ignored.
* KV events: the routing stats also carry the replica's KV event payload
  (replica/contract/kv_events.py); a :class:`KVEventConsumer` applies each newer one
  (after missed ones too: their summaries are absolute) and feeds the policy's precise hook
  (``set_cached``) when the policy has one. With KV tiers, a block in a replica's host tier
  or in its shared disk directory counts at ``placed``'s ``kv_host_weight`` /
  ``kv_disk_weight`` of a device block, and a directory's blocks count for every replica
  reporting it (their facts come with the reporter's payload). The payload's history events
  (replica/contract/history_events.py) go to ``placed``'s history index (``report``): the
  replica's cached conversation blocks, by the text-block hashes this router computes.
* ``placed`` placements agree across routers through the ingress
  (router/serve/ingress.py): the leader router rebalances and publishes
  ``placement_snapshot``; followers ``apply_placement``. A request is counted
  in the placement once (``count=False`` when Serve asks again for the same
  request), and the counts a follower routed since the last sync are handed to
  the leader (``take_counts`` / ``merge_counts``).
* Thread safety: Ray runs the router on its own event-loop thread and the
  ingress's methods on another; every use of the policy holds one lock.
* The router never blocks its event loop: ranking is pure Python, metrics are
  in-process counters.

Configuration (``RequestRouterConfig.request_router_kwargs``, passed to
``initialize_state``): ``policy`` (a router/policies/ name, default
``placed``), ``stats_max_age_s``, and that policy's options as its ``Options`` declares them
(e.g. ``epsilon``, ``seed``, ``weights``); any other key is refused.

Imports Ray Serve (this is the adapter); the policy logic stays in router/policies/.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from prefixserve.common.tracing import build_tracer, route_span
from prefixserve.replica.contract.kv_events import KVEventConsumer, TierWeights
from prefixserve.replica.contract.prompt_blocks import PromptBlocks, PromptHasher, UnhashablePrompt
from prefixserve.replica.contract.routing import ring_name
from prefixserve.router.cluster_config import DEFAULT_STATS_MAX_AGE_S
from prefixserve.router.policies import (
    DEFAULT_POLICY,
    KIND_FALLBACK,
    KIND_NO_KEY,
    Placed,
    Policy,
    ReplicaLoad,
    landed_kind,
    make_policy,
)
from prefixserve.router.serve import registry
from prefixserve.router.serve.metrics import RouterMetrics, router_metrics

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# Remembered decisions (key owner per request) waiting for their routing outcome;
# bounded so that requests cancelled before routing cannot grow it without end.
_MAX_PENDING_DECISIONS = 10_000


def router_for(app_name: str, deployment: str) -> PrefixRouter | None:
    """The PrefixRouter this process runs for ``app_name``'s ``deployment`` (None before its first request).

    Kept in router/serve/registry.py: Serve ships this module to the process by value,
    so a table here would be a private copy.
    """
    router = registry.router_for(app_name, deployment)
    return router if hasattr(router, "placement_snapshot") else None


def replica_name(replica_id: ReplicaID) -> str:
    """A Serve replica's full id, stable for the replica's life: its ring name while it has no rank."""
    return replica_id.to_full_id_str()


def reported_rank(stats: Mapping[str, Any]) -> int | None:
    """The Serve rank a routing-stats report carries (None: none, or not a rank)."""
    rank = stats.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None


def member_names(replicas: list[ReplicaID], ranks: Mapping[ReplicaID, int]) -> dict[ReplicaID, str]:
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


def is_generation(pending_request: PendingRequest | None) -> bool:
    """True for a generation request (an EngineRequest-like first argument), not a control call."""
    return (
        pending_request is not None and bool(pending_request.args) and hasattr(pending_request.args[0], "routing_key")
    )


def request_routing_key(pending_request: PendingRequest | None) -> str | None:
    """The routing key carried by the request's first positional argument (None: no affinity)."""
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "routing_key", None)
    return key if isinstance(key, str) and key else None


@dataclass(frozen=True)
class Choice:
    """What the policy decided for one request: the key's ring owner and its own first choice.

    key: the routing key ``placed`` counted the request under (None: not counted);
    blocks: the prompt's history hashes, recorded on the replica it lands on.
    """

    keyed: bool
    owner: str | None
    first: str | None
    key: str | None = None
    blocks: PromptBlocks | None = None


def decision_kind(choice: Choice | None, landed: str) -> str:
    """The decision kind of a request that landed on ``landed`` (router/policies/base.py's KIND_*)."""
    if choice is None:
        return KIND_NO_KEY
    return landed_kind(choice.keyed, choice.owner, choice.first, landed)


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
    try:
        return ReplicaLoad(
            num_waiting=int(stats["num_waiting"]),
            num_running=int(stats["num_running"]),
            kv_usage=min(1.0, max(0.0, float(stats.get("kv_usage", 0.0)))),
            queued_prefill_tokens=int(stats.get("queued_prefill_tokens", 0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def corrected_load(report: Report, own_now: int) -> ReplicaLoad:
    """The report corrected by this router's own change since it arrived (the module docstring's rule)."""
    load = report.load
    waiting, running = load.num_waiting, load.num_running
    delta = own_now - report.own_at_report
    if delta > 0:
        waiting += delta
    elif delta < 0:
        done = -delta
        taken = min(waiting, done)
        waiting -= taken
        running = max(0, running - (done - taken))
    return replace(load, num_waiting=waiting, num_running=running)


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
        self._policy: Policy = make_policy(policy, **options)
        self._lock = threading.Lock()
        self._stats_max_age_s = float(stats_max_age_s)
        self._reports: dict[ReplicaID, Report] = {}
        placed = self.placed
        weights = TierWeights(placed.options.kv_host_weight, placed.options.kv_disk_weight) if placed else None
        self._kv_events = KVEventConsumer(weights)
        # placed: requests and prefill work routed here since the last take_counts (key -> [n, tokens]).
        self._counts: dict[str, list[int]] = {}
        if tracer is None and otlp_traces_endpoint is not None:
            tracer = build_tracer("prefixserve-router", otlp_traces_endpoint)
        self._tracer = tracer
        self._metrics = metrics if metrics is not None else router_metrics()
        self._deployment = self._deployment_id.name
        # Per request: the decision (owner, first choice), for the spill and decision-kind metrics.
        self._choices: OrderedDict[str, Choice] = OrderedDict()
        # Requests this router routed and that have not completed: id -> (replica, key placed counted).
        self._routed: dict[str, tuple[ReplicaID, str | None]] = {}
        self._prompt_hasher = PromptHasher()
        self._own_in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._ranks: dict[ReplicaID, int] = {}  # the last rank each live replica reported
        self._names: dict[ReplicaID, str] = {}  # each live replica's ring name (member_names)
        self._members: dict[str, ReplicaID] = {}  # the ring: name -> the replica holding it
        self._ring_version = -1  # the first membership becomes version 0
        registry.register(self._deployment_id.app_name, self._deployment, self)

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def placed(self) -> Placed | None:
        """The policy when it is ``placed`` (placements, snapshots, precise hook), else None."""
        return self._policy if isinstance(self._policy, Placed) else None

    # -- replica reports --------------------------------------------------------------
    def name_of(self, replica_id: ReplicaID) -> str:
        """The replica's ring name (the module docstring): by its reported rank, else its full id."""
        return self._names.get(replica_id) or replica_name(replica_id)

    def refresh_reports(self, replicas: list[RunningReplica]) -> None:
        """Take in every new routing-stats report of ``replicas`` (rank, load, KV events)."""
        now = time.monotonic()
        events_of: list[tuple[ReplicaID, Any]] = []
        renamed = False
        for r in replicas:
            stats = getattr(r, "routing_stats", None)
            if not isinstance(stats, Mapping) or not stats:
                continue
            seq = stats.get("seq")
            old = self._reports.get(r.replica_id)
            if old is not None and seq is not None and old.seq == seq:
                continue
            load = parse_load(stats)
            if load is not None:
                self._reports[r.replica_id] = Report(seq, load, self.in_flight(r), now)
            rank = reported_rank(stats)
            if rank != self._ranks.get(r.replica_id):
                renamed = True
                if rank is None:
                    del self._ranks[r.replica_id]
                else:
                    self._ranks[r.replica_id] = rank
            events = stats.get("kv_events")
            if events is not None:
                events_of.append((r.replica_id, events))
        if renamed:
            self._forget_departed()
        for rid, events in events_of:  # under the names the reports just gave
            self._take_kv_events(self.name_of(rid), events)

    def _take_kv_events(self, name: str, payload: Any) -> None:
        gaps = self._kv_events.gaps
        facts = self._kv_events.apply(name, payload)
        if self._kv_events.gaps != gaps:
            self._metrics.kv_event_gaps.labels(self._deployment, name).inc()
        history = self._kv_events.take_history()
        if (facts or history) and isinstance(payload, Mapping):
            for event in [*(payload.get("events") or ()), *(payload.get("history_events") or ())]:
                self._metrics.kv_events.labels(self._deployment, name, str(event.get("type"))).inc(
                    len(event.get("block_hashes") or ())
                )
        shared = self._kv_events.take_shared_facts()  # disk blocks: every replica of the directory
        placed = self.placed
        if placed is not None and (facts or shared or history):
            with self._lock:
                for key, holds in facts:
                    placed.set_cached(name, key, holds)
                for other, key, holds in shared:
                    placed.set_cached(other, key, holds)
                if placed.history is not None:
                    for report in history:
                        placed.history.report(report.replica, report.stored, report.removed, report.reset)
                    entries = len(placed.history)
            if history and placed.history is not None:
                self._metrics.history_index_entries.labels(self._deployment).set(entries)

    def kv_held(self) -> dict[str, list[str]]:
        """Per routing key, the replicas this router's KV events say hold its prefix."""
        return self._kv_events.held()

    def replica_load(self, replica: RunningReplica) -> ReplicaLoad | None:
        """The replica's reported load corrected by this router's own change since (None: no recent report)."""
        report = self._reports.get(replica.replica_id)
        if report is None or time.monotonic() - report.arrived > self._stats_max_age_s:
            return None
        return corrected_load(report, self.in_flight(replica))

    def view(self, replica: RunningReplica) -> ServeReplicaView:
        return ServeReplicaView(
            replica, self.name_of(replica.replica_id), self.in_flight(replica), self.replica_load(replica)
        )

    @property
    def kv_event_gaps(self) -> int:
        """KV-event diffs applied after a gap (missed reports; router/serve/metrics.py kv_event_gaps)."""
        return self._kv_events.gaps

    # -- placement agreement (placed) -------------------------------------------------
    def placement_snapshot(self) -> dict[str, Any] | None:
        """The policy's placement snapshot (JSON-serializable), None when the policy is not ``placed``."""
        placed = self.placed
        if placed is None:
            return None
        with self._lock:
            return placed.placement_snapshot()

    @property
    def is_leader(self) -> bool:
        placed = self.placed
        return placed is not None and bool(placed.options.leader)

    def set_leader(self, leader: bool) -> None:
        """Make this router the placement leader (rebalances) or a follower (applies snapshots)."""
        placed = self.placed
        if placed is not None and placed.options.leader != leader:
            with self._lock:
                placed.options = replace(placed.options, leader=leader)

    def apply_placement(self, snapshot: Mapping[str, Any]) -> None:
        """Adopt the leader's snapshot (a follower)."""
        placed = self.placed
        if placed is not None:
            with self._lock:
                placed.apply_snapshot(snapshot)

    def take_counts(self) -> dict[str, list[int]]:
        """The requests and uncached prompt tokens per key routed since the last call (and reset)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts

    def merge_counts(self, counts: Mapping[str, Any]) -> None:
        """Count another router's requests in this (leader's) placement: ``{key: [requests, tokens]}``."""
        placed = self.placed
        if placed is None:
            return
        with self._lock:
            now = time.monotonic()  # the policy's clock (its default)
            for key, (n, tokens) in counts.items():
                for _ in range(max(0, int(n))):
                    placed.table.record(str(key), now)
                if int(tokens) > 0:
                    placed.table.observe(str(key), int(tokens), now)

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The prefill work of a finished request of ``key`` (the ingress reports it from the usage)."""
        placed = self.placed
        if placed is None:
            return
        if prompt_tokens > 0:
            self._metrics.reported_cached_fraction.labels(self._deployment).observe(
                min(1.0, (cached_tokens or 0) / prompt_tokens)
            )
        with self._lock:
            placed.observe(key, prompt_tokens, cached_tokens)
            entry = self._counts.setdefault(key, [0, 0])
            entry[1] += max(0, prompt_tokens - (cached_tokens or 0))

    # -- the decision -----------------------------------------------------------------
    def in_flight(self, replica: RunningReplica) -> int:
        """Requests this router sent to ``replica`` that have not completed."""
        return self._own_in_flight.get(replica.replica_id, 0)

    def prompt_blocks(self, request: Any) -> PromptBlocks | None:
        """The request's history hashes for ``placed`` (replica/contract/prompt_blocks.py); None when not used.

        A prompt the router cannot hash is counted and routes without a history
        (by its static key, then load).
        """
        placed = self.placed
        if placed is None or placed.history is None or request is None or not hasattr(request, "routing_key"):
            return None
        try:
            return self._prompt_hasher.blocks(request)
        except (UnhashablePrompt, TypeError, ValueError):
            self._metrics.history_unhashable.labels(self._deployment).inc()
            return None

    def rank(
        self,
        candidate_replicas: list[RunningReplica],
        key: str | None,
        count: bool = True,
        blocks: PromptBlocks | None = None,
    ) -> tuple[list[RunningReplica], str | None]:
        """The candidates best first and the key's ring owner (None without a key or ring).

        ``count=False``: Serve asks again for a request already ranked (``placed`` counts it once).
        ``blocks``: the prompt's history hashes (``prompt_blocks``), for ``placed``.
        """
        self.refresh_reports(candidate_replicas)
        views = [self.view(r) for r in candidate_replicas]
        placed = self.placed
        start = time.perf_counter()
        with self._lock:
            if placed is not None:
                history = blocks.hashes if blocks is not None else None
                decision = placed.rank(
                    views,
                    key,
                    count=count,
                    history=history,
                    static_blocks=blocks.static_blocks if blocks is not None else 0,
                )
                if count and key is not None:
                    self._counts.setdefault(key, [0, 0])[0] += 1
                entries = len(placed.history) if placed.history is not None else 0
            else:
                decision = self._policy.rank(views, key)
        self._metrics.decision_seconds.labels(self._deployment, self._policy.name).observe(time.perf_counter() - start)
        if placed is not None:
            self._metrics.history_index_entries.labels(self._deployment).set(entries)
            if count and decision.kind is not None:
                self._metrics.placed_branches.labels(self._deployment, decision.kind).inc()
            if blocks is not None and blocks.hashes and decision.best_blocks is not None:
                n = len(blocks.hashes)
                self._metrics.predicted_cached_fraction.labels(self._deployment, "chosen").observe(
                    (decision.predicted_blocks or 0) / n
                )
                self._metrics.predicted_cached_fraction.labels(self._deployment, "best").observe(
                    decision.best_blocks / n
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
        with route_span(
            self._tracer, parent, {"prefixserve.policy": self._policy.name, "prefixserve.routing_key": key or ""}
        ) as (span, headers):
            seen = pending_request is not None and pending_request.metadata.internal_request_id in self._choices
            blocks = self.prompt_blocks(request) if not seen else None
            ranking, owner = self.rank(candidate_replicas, key, count=not seen, blocks=blocks)
            if span is not None:
                span.set_attributes(
                    {
                        "prefixserve.owner": owner or "",
                        "prefixserve.chosen": self.name_of(ranking[0].replica_id) if ranking else "",
                    }
                )
                if hasattr(request, "trace_headers"):
                    request.trace_headers = headers  # the engine's spans hang under this decision
        if pending_request is not None:
            # Every tier is on offer, so when all are full the base class should back
            # off before asking again rather than spin.
            pending_request.routing_context.should_backoff = True
            first = self.name_of(ranking[0].replica_id) if ranking else None
            request_id = pending_request.metadata.internal_request_id
            old = self._choices.get(request_id)
            counted = old.key if old is not None else (key if self.placed is not None and key is not None else None)
            self._remember(
                request_id,
                Choice(
                    key is not None,
                    owner,
                    first,
                    counted,
                    blocks if blocks is not None else old.blocks if old else None,
                ),
            )
        return [[r] for r in ranking]

    def _remember(self, request_id: str, choice: Choice) -> None:
        self._choices[request_id] = choice
        self._choices.move_to_end(request_id)
        while len(self._choices) > _MAX_PENDING_DECISIONS:
            _, dropped = self._choices.popitem(last=False)
            self._done(dropped.key)  # never routed (cancelled): its key's in-flight count ends here

    def _done(self, key: str | None) -> None:
        placed = self.placed
        if placed is not None and key is not None:
            with self._lock:
                placed.done(key)

    # -- lifecycle hooks --------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        name = self.name_of(replica_id)
        choice = self._choices.pop(request_id, None)
        owner = choice.owner if choice is not None else None
        if is_generation(pending_request):  # control calls (model_info, ...) are not counted
            self._metrics.requests.labels(self._deployment, self._policy.name, name).inc()
            kind = decision_kind(choice, name)
            self._metrics.decisions.labels(self._deployment, self._policy.name, name, kind).inc()
            placed = self.placed
            if placed is not None and kind == KIND_FALLBACK:
                self._metrics.placed_branches.labels(self._deployment, KIND_FALLBACK).inc()
                if choice is not None and choice.blocks is not None and placed.history is not None:
                    with self._lock:  # the prompt went to this replica, not the one ranked first
                        placed.history.record(name, choice.blocks.hashes)
            if owner is not None and owner != name:
                self._metrics.spills.labels(self._deployment, self._policy.name).inc()
            if request_routing_key(pending_request) is None:
                self._metrics.unkeyed_requests.labels(self._deployment, self._policy.name).inc()
        if request_id not in self._routed:
            self._routed[request_id] = (replica_id, choice.key if choice is not None else None)
            self._own_in_flight[replica_id] += 1
            self._metrics.in_flight.labels(self._deployment, name).set(self._own_in_flight[replica_id])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is None:
            return  # a rejected attempt: it was never counted
        routed_to, key = routed
        self._done(key)
        count = max(0, self._own_in_flight.get(routed_to, 0) - 1)
        if routed_to in self._own_in_flight:
            self._own_in_flight[routed_to] = count
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
        for rid in [r for r in self._reports if r not in live_set]:
            del self._reports[rid]
        for rid in [r for r in self._ranks if r not in live_set]:
            del self._ranks[rid]
        for rid in [r for r in self._own_in_flight if r not in live_set]:
            del self._own_in_flight[rid]
        self._names = member_names(live, self._ranks)
        members = {name: rid for rid, name in self._names.items()}
        placed = self.placed
        for name, rid in self._members.items():
            if members.get(name) == rid:
                continue
            # Gone, or passed to another replica: nothing known of the name is trusted.
            self._kv_events.forget(name)
            if placed is not None and placed.history is not None:
                with self._lock:
                    placed.history.forget(name)
            for gauge in (self._metrics.ring_member, self._metrics.in_flight):
                try:
                    gauge.remove(self._deployment, name)
                except KeyError:
                    pass
        for name, rid in members.items():
            if self._members.get(name) != rid:
                self._metrics.ring_member.labels(self._deployment, name).set(1)
                if rid in self._own_in_flight:
                    self._metrics.in_flight.labels(self._deployment, name).set(self._own_in_flight[rid])
        if set(members) != set(self._members) or self._ring_version < 0:
            self._ring_version += 1
            self._metrics.ring_version.labels(self._deployment).set(self._ring_version)
        self._members = members
        self._metrics.ring_size.labels(self._deployment).set(len(live))
