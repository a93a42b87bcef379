"""The Serve request router's Ray-free parts (router/serve/*.py beside request_router.py), without Serve.

Each part is driven directly, with plain replica views and Serve's ReplicaID value
type; tests/router/serve/test_serve_router.py runs them composed under Serve's base class.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from prefixserve.replica.contract.kv_events import KVEventPublisher
from prefixserve.replica.contract.prompt_blocks import PromptBlocks
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.routing import ring_name
from prefixserve.router.policies import KIND_FALLBACK, KIND_NO_KEY, KIND_OWNER, Replica, ReplicaLoad, make_policy
from prefixserve.router.serve.decisions import Choice, OwnRequests, PendingDecisions, decision_kind
from prefixserve.router.serve.event_intake import KVEventIntake
from prefixserve.router.serve.history_feed import HistoryFeed
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.placement_sync import PlacementSync
from prefixserve.router.serve.policy_slot import PolicySlot
from prefixserve.router.serve.ranking import Ranker
from prefixserve.router.serve.replica_reports import ReplicaReports, parse_load
from prefixserve.router.serve.ring_members import RingMembership, replica_name
from prefixserve.router.serve.routing_hints import RoutingHints, is_generation, request_routing_key, routing_hints

DEPLOYMENT = DeploymentID(name="Engine", app_name="prefixserve")


def rid(unique: str) -> ReplicaID:
    return ReplicaID(unique, DEPLOYMENT)


def pending(*args: Any) -> PendingRequest:
    return PendingRequest(args=list(args), kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def gauge(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"deployment": "Engine", **labels})


# -- routing_hints ----------------------------------------------------------------------------


async def test_hints_are_read_off_an_engine_request_only():
    # async: a PendingRequest makes an asyncio.Future, which needs a running loop (a sync test has none once
    # another async test in the same process has closed its loop).
    request = EngineRequest(prompt="hi", routing_key="k")
    assert routing_hints(pending(request)) == RoutingHints("k", request)
    assert request_routing_key(pending(EngineRequest(prompt="hi", routing_key=""))) is None
    # Something else with a routing_key attribute is not a generation request.
    assert routing_hints(pending(SimpleNamespace(routing_key="k"))) is None
    assert not is_generation(pending()) and not is_generation(None)
    assert is_generation(pending(EngineRequest(prompt="hi")))


# -- ring_members -----------------------------------------------------------------------------


def test_ring_names_follow_unique_ranks_and_departed_names_are_reported():
    metrics = RouterMetrics()
    ring = RingMembership(metrics, "Engine")
    a, b, c = rid("a"), rid("b"), rid("c")
    assert ring.update([a, b, c], {a: 0, b: 1, c: 1}, {a: 2}) == []
    assert ring.name_of(a) == ring_name("prefixserve", "Engine", 0)
    assert ring.name_of(b) == replica_name(b) and ring.name_of(c) == replica_name(c)  # rank 1 claimed twice
    assert gauge(metrics, "prefixserve_router_ring_version") == 0
    assert gauge(metrics, "prefixserve_router_in_flight", replica=ring.name_of(a)) == 2
    # c settles on rank 2; b takes rank 1's name: b's and c's id-names leave the ring.
    departed = ring.update([a, b, c], {a: 0, b: 1, c: 2}, {})
    assert sorted(departed) == sorted([replica_name(b), replica_name(c)])
    assert gauge(metrics, "prefixserve_router_ring_version") == 1
    assert ring.update([a, b, c], {a: 0, b: 1, c: 2}, {}) == []  # the same members: the same version
    assert gauge(metrics, "prefixserve_router_ring_version") == 1
    assert gauge(metrics, "prefixserve_router_ring_member", replica=replica_name(b)) is None


# -- replica_reports --------------------------------------------------------------------------


def test_reports_are_taken_once_per_seq_expire_and_carry_ranks_and_kv_events():
    a = SimpleNamespace(replica_id=rid("a"), routing_stats={"seq": 1, "num_waiting": 3, "num_running": 1})
    b = SimpleNamespace(replica_id=rid("b"), routing_stats={"seq": 1, "rank": 4, "kv_events": {"seq": 1}})
    reports = ReplicaReports(max_age_s=10.0)
    intake = reports.take([a, b], {a.replica_id: 2}, now=100.0)
    assert intake.renamed and intake.kv_events == [(b.replica_id, {"seq": 1})]
    assert reports.ranks == {b.replica_id: 4}
    assert reports.load(a.replica_id, own_now=2, now=105.0) == ReplicaLoad(3, 1)
    assert reports.load(a.replica_id, own_now=4, now=105.0) == ReplicaLoad(5, 1)  # two sent since
    assert reports.load(a.replica_id, own_now=2, now=110.5) is None  # too old
    assert reports.load(b.replica_id, own_now=0, now=100.0) is None  # no load fields
    again = reports.take([a, b], {}, now=101.0)
    assert not again.renamed and again.kv_events == [(b.replica_id, {"seq": 1})]  # b had no load: no seq kept
    reports.forget({a.replica_id})
    assert reports.ranks == {}


def test_a_report_names_the_adapters_its_replica_holds():
    stats = {"seq": 1, "num_waiting": 0, "num_running": 2, "lora_adapters": ["a", "b", 3], "lora_capacity": 4}
    assert parse_load(stats) == ReplicaLoad(0, 2, adapters=frozenset({"a", "b"}), adapter_capacity=4)
    assert parse_load({**stats, "lora_adapters": "a"}) == ReplicaLoad(0, 2, adapter_capacity=4)  # not a list


# -- decisions --------------------------------------------------------------------------------


def test_pending_decisions_are_bounded_oldest_first():
    pending_choices = PendingDecisions(limit=2)
    first, second, third = (Choice(True, None, None, key=k) for k in "xyz")
    assert pending_choices.remember("1", first) == []
    assert pending_choices.remember("2", second) == []
    assert pending_choices.remember("1", first) == []  # asked again: now the newest
    assert pending_choices.remember("3", third) == [second]
    assert "2" not in pending_choices and pending_choices.pop("1") is first and pending_choices.get("1") is None


def test_decision_kinds():
    assert decision_kind(None, "a") == KIND_NO_KEY
    assert decision_kind(Choice(True, "a", "a"), "a") == KIND_OWNER
    assert decision_kind(Choice(True, "a", "b"), "c") == KIND_FALLBACK


def test_own_requests_count_each_request_once_per_live_replica():
    own = OwnRequests()
    a = rid("a")
    assert own.routed("1", a, "k") == 1 and own.routed("1", a, "k") is None and own.routed("2", a, None) == 2
    assert own.completed("never") is None
    assert own.completed("1") == (a, "k", 1) and own.count(a) == 1
    own.forget(set())
    assert own.completed("2") == (a, None, None) and own.count(a) == 0


# -- placement_sync, ranking, history_feed, event_intake --------------------------------------


def placed_slot(**options: Any) -> PolicySlot:
    return PolicySlot(make_policy("placed", **options))


def test_a_ranked_request_is_counted_once_and_its_prefill_work_is_handed_over():
    slot, metrics = placed_slot(), RouterMetrics()
    sync = PlacementSync(slot, metrics, "Engine")
    ranker = Ranker(slot, sync, metrics, "Engine")
    views = [Replica("a"), Replica("b")]
    decision = ranker.rank(views, "k")
    ranker.rank(views, "k", count=False)  # Serve asks again
    assert decision.ranking[0] in views
    sync.observe("k", prompt_tokens=100, cached_tokens=30)
    assert sync.take_counts() == {"k": [1, 70]} and sync.take_counts() == {}
    assert sync.snapshot() is not None and sync.is_leader
    sync.set_leader(False)
    assert not sync.is_leader


def test_a_keys_static_prefix_tokens_and_the_replicas_kv_capacity_reach_the_leaders_placement():
    slot, metrics = placed_slot(), RouterMetrics()
    sync = PlacementSync(slot, metrics, "Engine")
    views = [Replica("a"), Replica("b")]
    blocks = PromptBlocks([f"h{i}".encode() for i in range(12)], static_blocks=9)
    Ranker(slot, sync, metrics, "Engine").rank(views, "k", blocks=blocks)
    sync.observe("k", prompt_tokens=120, cached_tokens=0)
    handed = sync.take_counts()
    assert handed == {"k": [1, 120, 90]}  # 9 of the prompt's 12 blocks are its static prefix
    leader_slot = placed_slot()
    leader = PlacementSync(leader_slot, metrics, "Engine")
    Ranker(leader_slot, leader, metrics, "Engine").rank(views, "other")
    leader.merge_counts(handed)
    assert leader_slot.placed is not None
    assert leader_slot.placed.table.snapshot(0.0)["keys"]["k"]["foot"] == 90.0
    stats = {"seq": 1, "num_waiting": 0, "num_running": 0, "kv_capacity_tokens": 8192}
    assert parse_load(stats) == ReplicaLoad(kv_capacity_tokens=8192)


def test_a_refused_request_leaves_no_key_here_nor_at_the_leader():
    slot, metrics = placed_slot(), RouterMetrics()
    sync = PlacementSync(slot, metrics, "Engine")
    ranker = Ranker(slot, sync, metrics, "Engine")
    views = [Replica("a"), Replica("b")]
    ranker.rank(views, "early")
    sync.refused("early")  # refused before the exchange: nothing to hand over
    ranker.rank(views, "late")
    handed = sync.take_counts()
    sync.refused("late")  # refused after it: the next exchange takes the count back
    assert handed == {"late": [1, 0]} and sync.take_counts() == {"late": [-1, 0]}
    placed = slot.placed
    assert placed is not None and "early" not in placed.table and "late" not in placed.table
    leader_slot = placed_slot()
    leader = PlacementSync(leader_slot, metrics, "Engine")
    Ranker(leader_slot, leader, metrics, "Engine").rank(views, "other")  # members known
    leader.merge_counts(handed)
    leader.merge_counts({"late": [-1, 0]})
    assert leader_slot.placed is not None and "late" not in leader_slot.placed.table


def test_a_request_asking_for_retention_keeps_its_key_where_it_is_placed():
    slot, metrics = placed_slot(), RouterMetrics()
    ranker = Ranker(slot, PlacementSync(slot, metrics, "Engine"), metrics, "Engine")
    views = [Replica("a"), Replica("b")]
    ranker.rank(views, "plain")
    ranker.rank(views, "kept", retained=True)
    placed = slot.placed
    assert placed is not None
    assert placed.table.retained("kept") and not placed.table.retained("plain")


def test_a_policy_without_placement_ranks_and_syncs_nothing():
    slot, metrics = PolicySlot(make_policy("round_robin")), RouterMetrics()
    sync = PlacementSync(slot, metrics, "Engine")
    ranker = Ranker(slot, sync, metrics, "Engine")
    assert len(ranker.rank([Replica("a"), Replica("b")], "k").ranking) == 2
    sync.observe("k", 100, 0)
    sync.merge_counts({"k": [3, 10]})
    assert sync.take_counts() == {} and sync.snapshot() is None and not sync.is_leader
    assert HistoryFeed(slot, metrics, "Engine").blocks(EngineRequest(prompt="hi " * 200)) is None


def test_an_unhashable_prompt_is_counted():
    metrics = RouterMetrics()
    feed = HistoryFeed(placed_slot(), metrics, "Engine")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert feed.blocks(EngineRequest(messages=image)) is None
    assert metrics.registry.get_sample_value("prefixserve_router_history_unhashable_total", {"deployment": "Engine"})


def test_kv_events_reach_the_precise_hook_and_a_forgotten_replica_is_dropped():
    slot, metrics = placed_slot(precise=True), RouterMetrics()
    intake = KVEventIntake(slot, HistoryFeed(slot, metrics, "Engine"), metrics, "Engine")
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("tenant", [b"\x01" * 16])
    intake.take("a", pub.publish({b"\x01" * 16}.__contains__))
    placed = slot.placed
    assert placed is not None and placed.table.holds("tenant", "a") is True
    assert intake.held() == {"tenant": ["a"]} and intake.gaps == 0
    intake.forget("a")
    assert intake.held() == {}


@pytest.mark.parametrize("policy", ["placed", "bounded_load"])
def test_the_slot_reads_the_current_policy(policy: str):
    slot = PolicySlot(make_policy(policy))
    assert (slot.placed is not None) == (policy == "placed")
    slot.policy = make_policy("round_robin")
    assert slot.placed is None
