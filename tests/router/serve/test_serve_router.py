"""router/serve/request_router.py against Ray Serve's real RequestRouter base class, with fake replicas.

No Ray cluster: the replicas are test doubles with RunningReplica's routing
surface (replica_id, max_ongoing_requests, get_queue_len, ...), and requests
go through the base class's own routing loop (tiers, queue-length probes,
fallback), so what is tested is what Serve runs.
"""

from __future__ import annotations

import random
import uuid

import pytest
from ray.serve._private.common import DeploymentHandleSource, RequestMetadata
from ray.serve.request_router import PendingRequest
from serve_router_helpers import DEPLOYMENT, FakeReplica, make_router, pending, random_keys, replicas, route  # noqa: F401

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.routing import ring_name
from prefixserve.router.policies import ReplicaLoad, effective_in_flight
from prefixserve.router.ring import HashRing
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.request_router import PrefixRouter, request_routing_key


def counter(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def decisions(metrics: RouterMetrics, policy: str, replica: str, kind: str) -> float:
    """The deployment's routing-decision counter for one policy, replica and kind."""
    return counter(
        metrics,
        "prefixserve_router_decisions_total",
        deployment="Engine",
        policy=policy,
        replica=replica,
        kind=kind,
    )


def started(
    seed: int, n: int, max_ongoing_requests: int | None = None, **options
) -> tuple[random.Random, PrefixRouter, list[FakeReplica]]:
    """A seeded rng, a router made with ``options`` and ``n`` replicas it already knows."""
    rng = random.Random(seed)
    router = make_router(**options)
    extra = {} if max_ongoing_requests is None else {"max_ongoing_requests": max_ongoing_requests}
    reps = replicas(rng, n, **extra)
    router.update_replicas(reps)
    return rng, router, reps


async def test_key_is_read_from_the_first_argument():
    assert request_routing_key(pending("abc")) == "abc"
    assert request_routing_key(pending(None)) is None
    assert request_routing_key(None) is None
    empty = pending("x")
    empty.args = []
    assert request_routing_key(empty) is None


async def test_tiers_are_the_keys_ring_successors_one_replica_each():
    rng, router, reps = started(11, 4)
    ring = HashRing(sorted(r.name for r in reps))
    for key in random_keys(rng, 200):
        tiers = await router.choose_replicas(list(reversed(reps)), pending(key))
        assert all(len(t) == 1 for t in tiers)
        assert [t[0].name for t in tiers] == ring.successors(key)


async def test_same_key_same_replica_and_keys_spread():
    rng, router, reps = started(12, 3)
    keys = random_keys(rng, 60)
    first = {k: (await route(router, pending(k))).name for k in keys}
    again = {k: (await route(router, pending(k))).name for k in keys}
    assert first == again
    ring = HashRing(sorted(r.name for r in reps))
    assert first == {k: ring.owner(k) for k in keys}
    assert len(set(first.values())) == 3


async def test_full_owner_falls_back_to_the_next_ring_replica():
    rng = random.Random(13)
    router = make_router(policy="consistent_hash")
    reps = replicas(rng, 3, max_ongoing_requests=2)
    by_name = {r.name: r for r in reps}
    router.update_replicas(reps)
    key = random_keys(rng, 1)[0]
    order = HashRing(sorted(by_name)).successors(key)
    by_name[order[0]].queue_len = 2  # at max_ongoing_requests: Serve will not send to it
    router.replica_queue_len_cache.update(by_name[order[0]].replica_id, 2)
    request = pending(key)
    chosen = await route(router, request)
    assert chosen.name == order[1]
    router.on_request_routed(request, chosen.replica_id, result=None)
    # The policy put the owner first; Serve moved on because it was full: a fallback, not a spill.
    assert decisions(router._metrics, "consistent_hash", order[1], "fallback") == 1
    assert decisions(router._metrics, "consistent_hash", order[1], "spill") == 0


def load(router: PrefixRouter, replica: FakeReplica, n: int) -> list[PendingRequest]:
    """Put ``n`` routed, unfinished requests on ``replica`` in the router's bookkeeping."""
    requests = [pending(None) for _ in range(n)]
    for request in requests:
        router.on_request_routed(request, replica.replica_id, result=None)
    return requests


async def test_bounded_load_spills_a_hot_key_and_counts_it():
    rng, router, reps = started(14, 4, max_ongoing_requests=100, epsilon=0.25)
    by_name = {r.name: r for r in reps}
    key = random_keys(rng, 1)[0]
    order = HashRing(sorted(by_name)).successors(key)
    # The owner holds 10 of 10 in flight: capacity is ceil(1.25 * 11 / 4) = 4.
    hot = load(router, by_name[order[0]], 10)
    request = pending(key)
    chosen = await route(router, request)
    assert chosen.name == order[1]
    router.on_request_routed(request, chosen.replica_id, result=None)
    metrics = router._metrics
    assert counter(metrics, "prefixserve_router_spills_total", deployment="Engine", policy="bounded_load") == 1
    assert (
        counter(
            metrics, "prefixserve_router_requests_total", deployment="Engine", policy="bounded_load", replica=order[1]
        )
        == 1
    )
    assert decisions(metrics, "bounded_load", order[1], "spill") == 1
    assert decisions(metrics, "bounded_load", order[0], "no_key") == 10  # load() routes unkeyed requests
    # Once the owner's requests complete, the key returns to it and nothing spills.
    for r in [*hot, request]:
        router.on_request_completed(by_name[order[0]].replica_id, r.metadata.internal_request_id)
    request = pending(key)
    chosen = await route(router, request)
    router.on_request_routed(request, chosen.replica_id, result=None)
    assert chosen.name == order[0]
    assert counter(metrics, "prefixserve_router_spills_total", deployment="Engine", policy="bounded_load") == 1
    assert decisions(metrics, "bounded_load", order[0], "owner") == 1


async def test_dead_replica_leaves_the_ring_and_no_surviving_key_moves():
    rng, router, reps = started(15, 4)
    keys = random_keys(rng, 2000)
    before = {k: (await router.choose_replicas(reps, pending(k)))[0][0].name for k in keys}
    dead = reps[1]
    router.on_replica_actor_died(dead.replica_id)
    live = [r for r in reps if r is not dead]
    assert set(router.curr_replicas) == {r.replica_id for r in live}
    after = {k: (await router.choose_replicas(router._replicas_list, pending(k)))[0][0].name for k in keys}
    ring = HashRing(sorted(r.name for r in reps))
    for k in keys:
        if before[k] == dead.name:
            assert after[k] == ring.successors(k)[1]  # its next ring replica
        else:
            assert after[k] == before[k]
    assert counter(router._metrics, "prefixserve_router_ring_size", deployment="Engine") == 3
    assert counter(router._metrics, "prefixserve_router_ring_version", deployment="Engine") == 1


async def test_added_replica_moves_at_most_its_share_of_keys():
    rng, router, reps = started(16, 4)
    keys = random_keys(rng, 10_000)
    before = {k: (await router.choose_replicas(router._replicas_list, pending(k)))[0][0].name for k in keys}
    newcomer = replicas(rng, 1)[0]
    router.update_replicas([*reps, newcomer])
    after = {k: (await router.choose_replicas(router._replicas_list, pending(k)))[0][0].name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == newcomer.name for k in moved)
    assert len(moved) / len(keys) <= 1 / 5 + 0.05
    assert counter(router._metrics, "prefixserve_router_ring_size", deployment="Engine") == 5
    assert counter(router._metrics, "prefixserve_router_ring_version", deployment="Engine") == 1
    router.update_replicas([*reps, newcomer])  # the same members: the same version
    assert counter(router._metrics, "prefixserve_router_ring_version", deployment="Engine") == 1


async def test_unkeyed_requests_go_to_the_least_loaded():
    rng, router, reps = started(17, 3)
    for n, r in zip((5, 1, 3), reps):
        load(router, r, n)
    tiers = await router.choose_replicas(reps, pending(None))
    assert [t[0] for t in tiers] == [reps[1], reps[2], reps[0]]


async def test_in_flight_is_routed_minus_completed_and_ignores_stale_probes():
    rng, router, reps = started(18, 2)
    requests = load(router, reps[0], 3)
    # A late queue-length probe must not make an idle replica look busy or a busy one idle.
    router.replica_queue_len_cache.update(reps[1].replica_id, 7)
    router.replica_queue_len_cache.update(reps[0].replica_id, 0)
    assert router.in_flight(reps[0]) == 3
    assert router.in_flight(reps[1]) == 0
    rid = requests[0].metadata.internal_request_id
    router.on_request_completed(reps[0].replica_id, rid)
    router.on_request_completed(reps[0].replica_id, rid)  # twice: counted once
    router.on_request_completed(reps[0].replica_id, "never-routed")  # a rejected attempt
    assert router.in_flight(reps[0]) == 2
    router.on_replica_actor_died(reps[0].replica_id)
    assert router.in_flight(reps[0]) == 0


async def test_round_robin_alternates_over_live_replicas():
    rng, router, reps = started(19, 2, policy="round_robin")
    key = random_keys(rng, 1)[0]
    chosen = []
    for _ in range(6):
        request = pending(key)
        replica = await route(router, request)
        router.on_request_routed(request, replica.replica_id, result=None)
        chosen.append(replica.name)
    assert chosen[0::2] == [chosen[0]] * 3 and chosen[1::2] == [chosen[1]] * 3
    assert chosen[0] != chosen[1]
    # A keyed request under a policy without a ring.
    assert decisions(router._metrics, "round_robin", chosen[0], "no_ring") == 3


def test_initialize_state_rejects_options_of_other_policies():
    router = PrefixRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA)
    with pytest.raises(ValueError, match=r"round_robin policy option keys \['epsilon'\]; known keys: none"):
        router.initialize_state(policy="round_robin", epsilon=0.5)
    with pytest.raises(ValueError, match="unknown routing policy"):
        router.initialize_state(policy="nearest")
    with pytest.raises(ValueError, match=r"\['seed'\]; known keys: \['epsilon', 'weights'\]"):
        router.initialize_state(policy="bounded_load", seed=3)


def test_initialize_state_passes_every_declared_option_through():
    router = make_router(policy="consistent_hash", weights={"x": 3})
    assert router.policy.options.weights == {"x": 3}
    router = make_router(policy="power_of_two", seed=4)
    assert router.policy.options.seed == 4


# -- replica-reported load, KV events and placed ------------------------------------------


def stats(seq: int, waiting: int, running: int, **extra) -> dict:
    return {
        "seq": seq,
        "num_waiting": waiting,
        "num_running": running,
        "kv_usage": 0.5,
        "queued_prefill_tokens": 100,
        **extra,
    }


def test_reported_load_is_corrected_by_the_routers_own_change_since_the_report():
    from prefixserve.router.serve.replica_reports import Report, corrected_load

    report = Report(seq=1, load=ReplicaLoad(num_waiting=2, num_running=3, kv_usage=0.5), own_at_report=4, arrived=0.0)
    assert corrected_load(report, 4) == ReplicaLoad(2, 3, 0.5)  # nothing changed
    assert corrected_load(report, 6) == ReplicaLoad(4, 3, 0.5)  # two sent since: queued
    assert corrected_load(report, 1) == ReplicaLoad(0, 2, 0.5)  # three done: waiting first, then running
    assert corrected_load(report, 0) == ReplicaLoad(0, 1, 0.5)


async def test_views_carry_the_reported_load_and_every_router_sees_other_routers_requests():
    rng, router, reps = started(20, 2, policy="placed")
    a, b = reps
    a.routing_stats = stats(1, waiting=5, running=2)  # another ingress's requests: this router sent none
    router.refresh_reports(reps)
    view = router.view(a)
    assert view.in_flight == 0 and view.load == ReplicaLoad(5, 2, 0.5, 100)
    assert router.view(b).load is None  # no report
    assert effective_in_flight(view) == 7
    load(router, a, 2)  # two of this router's own since the report
    assert router.view(a).load == ReplicaLoad(7, 2, 0.5, 100)
    a.routing_stats = stats(1, waiting=0, running=0)  # the same seq: not a new report
    router.refresh_reports(reps)
    assert router.view(a).load == ReplicaLoad(7, 2, 0.5, 100)
    a.routing_stats = stats(2, waiting=0, running=2)  # now it counts this router's two
    router.refresh_reports(reps)
    assert effective_in_flight(router.view(a)) == 2


async def test_placed_routes_away_from_a_replica_other_routers_fill():
    """The key's placed replica is over the in-flight cap only in the reports (other routers' requests)."""
    rng, router, reps = started(21, 3, policy="placed")
    key = random_keys(rng, 1)[0]
    owner = HashRing(sorted(r.name for r in reps)).owner(key)
    first = await route(router, pending(key))
    assert first.name == owner
    by_name = {r.name: r for r in reps}
    by_name[owner].routing_stats = stats(1, waiting=30, running=2)
    chosen = await route(router, pending(key))
    assert chosen.name != owner


async def test_placed_counts_a_request_once_and_the_leader_merges_a_followers_counts():
    rng = random.Random(22)
    leader, follower = make_router(policy="placed"), make_router(policy="placed")
    reps = replicas(rng, 2)
    for r in (leader, follower):
        r.update_replicas(reps)
    key = random_keys(rng, 1)[0]
    request = pending(key)
    await follower.choose_replicas(reps, request)
    await follower.choose_replicas(reps, request)  # Serve asks again (all full): counted once
    follower.observe(key, prompt_tokens=100, cached_tokens=40)
    counts = follower.take_counts()
    assert counts == {key: [1, 60]} and follower.take_counts() == {}
    await route(leader, pending(key))
    leader.merge_counts(counts)
    rate, work = leader.placed.table.stats(key)
    assert rate == pytest.approx(2.0, rel=1e-3) and work == pytest.approx(60.0, rel=1e-3)
    follower.set_leader(False)
    assert not follower.is_leader and leader.is_leader
    snapshot = leader.placement_snapshot()
    follower.apply_placement(snapshot)
    assert follower.placed.placement(key) == leader.placed.placement(key)
    assert make_router(policy="bounded_load").placement_snapshot() is None


async def test_kv_events_in_routing_stats_reach_the_placed_policys_precise_hook():
    from prefixserve.replica.contract.kv_events import KVEventPublisher

    rng, router, reps = started(23, 2, policy="placed", precise=True)
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("tenant", [b"\x01" * 16, b"\x02" * 16])
    pool = {b"\x01" * 16, b"\x02" * 16}
    reps[0].routing_stats = stats(1, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)  # reports arrive with replica updates
    assert router.placed.table.holds("tenant", reps[0].name) is True
    pool.clear()
    reps[0].routing_stats = stats(2, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    assert router.placed.table.holds("tenant", reps[0].name) is False
    pub.publish(pool.__contains__)  # seq 3 never reaches the router
    pool.add(b"\x01" * 16)
    pool.add(b"\x02" * 16)
    reps[0].routing_stats = stats(4, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    # A gap (seq 3 missed): the diff after it still states the key's presence, absolutely.
    assert router.kv_event_gaps == 1 and router.placed.table.holds("tenant", reps[0].name) is True


def chat(key: str, messages: list) -> PendingRequest:
    request = EngineRequest(messages=messages, routing_key=key)
    rid = uuid.uuid4().hex
    return PendingRequest(
        args=[request], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid, is_streaming=True)
    )


SYSTEM = {"role": "system", "content": "You are the support bot of one app. " * 30}


def history(user: int, turns: int) -> list[dict[str, str]]:
    out = [SYSTEM]
    for t in range(turns):
        out.append({"role": "user", "content": f"user {user} asks question {t} " * 12})
        if t + 1 < turns:
            out.append({"role": "assistant", "content": f"answer {t} for user {user} " * 12})
    return out


async def send(router: PrefixRouter, request: PendingRequest) -> FakeReplica:
    chosen = await route(router, request)
    router.on_request_routed(request, chosen.replica_id, result=None)
    return chosen


async def test_placed_follows_each_conversation_without_a_client_key():
    rng, router, reps = started(31, 2, policy="placed")
    first = {u: (await send(router, chat("app", history(u, 1)))).name for u in range(8)}
    assert len(set(first.values())) == 2  # eight conversations at once: the app's set grew to both
    again = {u: (await send(router, chat("app", history(u, 2)))).name for u in range(8)}
    assert again == first
    m = router._metrics
    assert counter(m, "prefixserve_router_placed_branches_total", deployment="Engine", branch="history") == 8
    assert counter(m, "prefixserve_router_history_index_entries", deployment="Engine") > 0
    assert counter(m, "prefixserve_router_predicted_cached_fraction_count", deployment="Engine", which="best") == 16


async def test_a_prompt_the_router_cannot_hash_still_routes_and_is_counted():
    rng, router, reps = started(32, 3, policy="placed")
    bad = [SYSTEM, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    chosen = await send(router, chat("app", bad))
    assert chosen.name == HashRing(sorted(r.name for r in reps)).owner("app")  # by its static key
    assert counter(router._metrics, "prefixserve_router_history_unhashable_total", deployment="Engine") == 1


async def test_a_departed_replica_leaves_the_history_index():
    rng, router, reps = started(33, 3, policy="placed")
    chosen = await send(router, chat("app", history(5, 1)))
    blocks = router._history.hasher.blocks(chat("app", history(5, 2)).args[0])
    assert chosen.name in router.placed.history.held(blocks.hashes)
    router.update_replicas([r for r in reps if r is not chosen])
    assert chosen.name not in router.placed.history.held(blocks.hashes)
    assert (await send(router, chat("app", history(5, 2)))).name != chosen.name


async def test_history_events_in_routing_stats_steer_a_later_turn_and_retract_it():
    from prefixserve.replica.contract.history_events import HistoryTracker
    from prefixserve.replica.contract.kv_events import KVEventPublisher

    rng, router, reps = started(35, 2, policy="placed")
    # A conversation this router never sent anywhere (another ingress replica did): only the
    # replica's history events can say where it lives.
    first = chat("app", history(9, 1)).args[0]
    blocks = router._history.hasher.blocks(first)
    holder = next(r for r in reps if r.name != HashRing(sorted(r.name for r in reps)).owner("app"))
    tracker = HistoryTracker()
    pub = KVEventPublisher(history=tracker)
    pool: set[bytes] = set()
    tracker.remember((h, bytes([i]) * 16) for i, h in enumerate(blocks.hashes))
    pool |= {bytes([i]) * 16 for i in range(len(blocks.hashes))}
    holder.routing_stats = stats(1, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    assert router.placed.history.held(blocks.hashes) == {holder.name: len(blocks.hashes)}
    entries = counter(router._metrics, "prefixserve_router_history_index_entries", deployment="Engine")
    assert entries == len(router.placed.history) == len(blocks.hashes)  # the size, as the events left it
    assert counter(
        router._metrics,
        "prefixserve_router_kv_events_total",
        deployment="Engine",
        replica=holder.name,
        type="HistoryStored",
    ) == len(blocks.hashes)
    turn = await send(router, chat("app", history(9, 2)))
    assert turn.name == holder.name
    router.on_request_completed(turn.replica_id, "done")
    # The holder evicted it: the next report retracts it, except what this router has sent it since.
    pool.clear()
    holder.routing_stats = stats(2, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    assert router.placed.history.held(blocks.hashes) == {holder.name: len(blocks.hashes)}  # just sent
    holder.routing_stats = stats(3, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    assert router.placed.history.held(blocks.hashes).get(holder.name, 0) == len(
        blocks.hashes
    )  # no news: the replica has not seen that turn
    tracker.remember((h, bytes([i]) * 16) for i, h in enumerate(blocks.hashes))
    pool |= {bytes([i]) * 16 for i in range(len(blocks.hashes))}
    holder.routing_stats = stats(4, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    pool.clear()
    holder.routing_stats = stats(5, 0, 0, kv_events=pub.publish(pool.__contains__))
    router.update_replicas(reps)
    assert holder.name not in router.placed.history.held(blocks.hashes)


async def test_a_completed_conversation_frees_its_keys_in_flight_count():
    rng, router, reps = started(34, 2, policy="placed")
    requests = [chat("app", history(u, 1)) for u in range(4)]
    routed = [(r, await send(router, r)) for r in requests]
    assert router.placed.key_in_flight("app") == 4
    for r, rep in routed:
        router.on_request_completed(rep.replica_id, r.metadata.internal_request_id)
    assert router.placed.key_in_flight("app") == 0


def ranked(rng: random.Random, n: int, first_rank: int = 0) -> list[FakeReplica]:
    """``n`` replicas that report ranks ``first_rank``.. in their routing stats."""
    reps = replicas(rng, n)
    for i, r in enumerate(reps):
        r.routing_stats = stats(1, 0, 0, rank=first_rank + i)
    return reps


async def test_ring_names_come_from_reported_ranks_and_a_replacement_gets_its_predecessors_keys():
    rng = random.Random(35)
    router = make_router()
    reps = ranked(rng, 4)
    router.update_replicas(reps)
    names = [router.name_of(r.replica_id) for r in reps]
    assert names == [ring_name("prefixserve", "Engine", i) for i in range(4)]
    keys = random_keys(rng, 2000)
    ring = HashRing(names)
    before = {k: router.name_of((await router.choose_replicas(reps, pending(k)))[0][0].replica_id) for k in keys}
    assert before == {k: ring.owner(k) for k in keys}
    # Rank 1 dies; Serve starts a replacement with a new (random) id that inherits rank 1.
    dead = reps[1]
    router.on_replica_actor_died(dead.replica_id)
    replacement = replicas(rng, 1)[0]
    live = [reps[0], replacement, reps[2], reps[3]]
    router.update_replicas(live)
    # No report yet: the newcomer is on the ring by its full id, so rank 1's keys went elsewhere.
    assert router.name_of(replacement.replica_id) == replacement.name
    interim = {k: router.name_of((await router.choose_replicas(live, pending(k)))[0][0].replica_id) for k in keys}
    assert any(interim[k] != before[k] for k in keys if before[k] == names[1])
    replacement.routing_stats = stats(1, 0, 0, rank=1)
    after = {k: (await router.choose_replicas(live, pending(k)))[0][0] for k in keys}
    assert {k: router.name_of(r.replica_id) for k, r in after.items()} == before
    assert all(after[k] is replacement for k in keys if before[k] == names[1])
    members = {
        s.labels["replica"]
        for f in router._metrics.registry.collect()
        for s in f.samples
        if s.name == "prefixserve_router_ring_member" and s.value == 1
    }
    assert members == set(names)


async def test_two_replicas_reporting_one_rank_are_both_named_by_their_ids_and_unreported_ids_stay():
    rng = random.Random(36)
    router = make_router()
    reps = ranked(rng, 3)
    reps[2].routing_stats = stats(1, 0, 0, rank=0)  # a reassignment in flight: two claim rank 0
    unranked = replicas(rng, 1)[0]
    router.update_replicas([*reps, unranked])
    assert router.name_of(reps[0].replica_id) == reps[0].name
    assert router.name_of(reps[2].replica_id) == reps[2].name
    assert router.name_of(reps[1].replica_id) == ring_name("prefixserve", "Engine", 1)
    assert router.name_of(unranked.replica_id) == unranked.name
    reps[2].routing_stats = stats(2, 0, 0, rank=2)
    router.refresh_reports(reps)
    assert [router.name_of(r.replica_id) for r in reps] == [ring_name("prefixserve", "Engine", i) for i in range(3)]


async def test_a_continuation_goes_to_the_replica_holding_its_conversation_while_it_is_there():
    rng, router, reps = started(31, 3, policy="placed")
    key = random_keys(rng, 1)[0]
    owner = (await route(router, pending(key))).name
    home = next(r.name for r in reps if r.name != owner)
    continuation = pending(key)
    continuation.args[0].home_replica = home
    assert (await route(router, continuation)).name == home
    gone = pending(key)
    gone.args[0].home_replica = "prefixserve#Engine#rank-99"  # replaced since: the ranking stands
    assert (await route(router, gone)).name == owner


async def test_a_request_avoids_the_replicas_that_failed_it_while_another_can_take_it():
    rng, router, reps = started(32, 3, policy="placed")
    key = random_keys(rng, 1)[0]
    owner = (await route(router, pending(key))).name
    moved = pending(key)
    moved.args[0].avoid_replicas = (owner,)
    assert (await route(router, moved)).name != owner
    everyone = pending(key)
    everyone.args[0].avoid_replicas = tuple(r.name for r in reps)
    assert (await route(router, everyone)).name == owner  # no other left: the ranking stands
