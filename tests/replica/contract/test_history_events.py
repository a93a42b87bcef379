"""History events (replica/contract/history_events.py): the replica's text-block -> token-block map, its
bounded diffs in the KV event payload, the router's consumer and history index (router/policies/history.py)
applying them, and a real engine producing them."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.replica.contract.history_events import (
    HISTORY_REMOVED,
    HISTORY_STORED,
    HistoryTracker,
    token_blocks_at,
)
from prefixserve.replica.contract.kv_events import KVEventConsumer, KVEventPublisher
from prefixserve.router.policies import KIND_HISTORY, Placed, Replica
from prefixserve.router.policies.history import HistoryIndex


def t(i: int) -> bytes:  # a text block hash
    return b"T" + i.to_bytes(15, "little")


def k(i: int) -> bytes:  # a token block hash
    return b"K" + i.to_bytes(15, "little")


def events(payload: dict) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {HISTORY_STORED: [], HISTORY_REMOVED: []}
    for e in payload["history_events"]:
        out[e["type"]] += [bytes.fromhex(x) for x in e["block_hashes"]]
    return out


class FakeHost:
    """One replica's publisher over a set standing for its KV pool, and a router consuming its payloads."""

    def __init__(self, tracker: HistoryTracker | None = None, snapshot_every: int = 1000) -> None:
        self.pool: set[bytes] = set()
        self.tracker = tracker if tracker is not None else HistoryTracker()
        self.pub = KVEventPublisher(snapshot_every=snapshot_every, history=self.tracker)

    def publish(self) -> dict:
        return self.pub.publish(self.pool.__contains__)


def deliver(consumer: KVEventConsumer, index: HistoryIndex, name: str, payload: dict) -> None:
    consumer.apply(name, payload)
    for report in consumer.take_history():
        index.report(report.replica, report.stored, report.removed, report.reset)


def test_stored_and_removed_round_trip_into_the_routers_index():
    rep, consumer, index = FakeHost(), KVEventConsumer(), HistoryIndex(100)
    first = rep.publish()
    assert first["history_reset"] and first["history_events"] == []
    conv = [t(i) for i in range(4)]
    rep.tracker.remember(zip(conv, [k(i) for i in range(4)], strict=True))
    assert events(rep.publish())[HISTORY_STORED] == []  # not cached yet: nothing to say
    rep.pool |= {k(i) for i in range(4)}
    payload = rep.publish()
    assert events(payload) == {HISTORY_STORED: conv, HISTORY_REMOVED: []} and "history_reset" not in payload
    deliver(consumer, index, "r1", first)
    deliver(consumer, index, "r1", payload)
    assert index.held(conv) == {"r1": 4}
    rep.pool -= {k(2), k(3)}  # the KV manager evicted the conversation's tail
    removal = rep.publish()
    assert events(removal) == {HISTORY_STORED: [], HISTORY_REMOVED: conv[2:]}
    deliver(consumer, index, "r1", removal)
    assert index.held(conv) == {"r1": 2}
    assert rep.publish()["history_events"] == []  # quiet when nothing changed


def test_a_removal_never_undoes_what_the_router_sent_after_the_report_before_it():
    rep, consumer, index = FakeHost(), KVEventConsumer(), HistoryIndex(100)
    conv = [t(i) for i in range(3)]
    rep.tracker.remember(zip(conv, [k(i) for i in range(3)], strict=True))
    rep.pool |= {k(0), k(1), k(2)}
    deliver(consumer, index, "r1", rep.publish())
    assert index.held(conv) == {"r1": 3}
    rep.pool.clear()  # evicted; the report saying so is made ...
    stale = rep.publish()
    index.record("r1", conv + [t(3)])  # ... then the router sends the next turn, which recomputes it all
    deliver(consumer, index, "r1", stale)
    assert index.held(conv + [t(3)]) == {"r1": 4}  # the send stands
    # The report after it is trusted: if the blocks are still gone then, they are gone.
    deliver(consumer, index, "r1", rep.publish())  # (no change since the last diff: nothing said)
    rep.tracker.remember(zip(conv, [k(i) for i in range(3)], strict=True))
    rep.pool |= {k(0), k(1), k(2)}
    deliver(consumer, index, "r1", rep.publish())
    rep.pool.clear()
    deliver(consumer, index, "r1", rep.publish())
    assert index.held(conv) == {}


def test_a_block_of_a_request_in_flight_is_not_reported_removed_until_it_ends():
    rep = FakeHost()
    conv = [t(i) for i in range(2)]
    rep.tracker.remember(zip(conv, [k(0), k(1)], strict=True))
    rep.pool |= {k(0), k(1)}
    rep.publish()
    rep.pool.clear()
    rep.tracker.begin(conv)  # the next turn arrived: it will recompute both blocks
    assert events(rep.publish())[HISTORY_REMOVED] == []
    rep.tracker.end(conv)  # it failed before its prefill: now they are reported gone
    assert events(rep.publish())[HISTORY_REMOVED] == conv
    # A router may have kept them through that report (it sent this turn just before it); the
    # next request naming them restates what became of them once it is done.
    rep.tracker.begin(conv)
    assert rep.publish()["history_events"] == []
    rep.tracker.end(conv)
    assert events(rep.publish())[HISTORY_REMOVED] == conv
    rep.tracker.begin(conv)
    rep.pool |= {k(0), k(1)}  # this one was served: they are back
    assert events(rep.publish())[HISTORY_STORED] == conv
    rep.tracker.end(conv)
    assert rep.publish()["history_events"] == []


def test_lost_or_reordered_payloads_reset_the_replica_never_route_to_it_by_stale_history():
    rep, consumer = FakeHost(), KVEventConsumer()
    policy = Placed(clock=lambda: 0.0)
    index = policy.history
    assert index is not None
    system = [t(100 + i) for i in range(2)]
    conv = system + [t(i) for i in range(4)]
    rep.tracker.remember(zip(conv, [k(i) for i in range(6)], strict=True))
    rep.pool |= {k(i) for i in range(6)}
    deliver(consumer, index, "r1", rep.publish())  # seq 1 (reset, snapshot: nothing held yet)
    stored = rep.publish()  # seq 2
    deliver(consumer, index, "r1", stored)
    assert index.held(conv) == {"r1": 6}
    rep.pool.clear()
    lost = rep.publish()  # seq 3 says they went: never delivered
    assert events(lost)[HISTORY_REMOVED] == conv
    rep.tracker.remember([(t(50), k(50))])
    rep.pool.add(k(50))
    after = rep.publish()  # seq 4: applied after the gap, which resets what the router knew
    deliver(consumer, index, "r1", stored)  # reordered: an older payload again is ignored
    deliver(consumer, index, "r1", after)
    assert consumer.gaps == 1 and index.held(conv) == {} and index.held([t(50)]) == {"r1": 1}
    replicas = [Replica("r0"), Replica("r1")]
    d = policy.rank(replicas, "app", history=conv + [t(9)], static_blocks=2)
    assert d.kind != KIND_HISTORY
    # A restarted replica (a new publisher): its diffs wait for its first payload's reset.
    fresh = FakeHost()
    fresh.tracker.remember([(t(60), k(60))])
    fresh.pool.add(k(60))
    fresh.publish()  # seq 1 lost
    diff = fresh.publish()
    deliver(consumer, index, "r1", diff)
    assert index.held([t(60)]) == {} and index.held([t(50)]) == {"r1": 1}
    fresh.pub.snapshot_every = 3
    deliver(consumer, index, "r1", fresh.publish())  # seq 3, a snapshot: reset, and restates what it holds
    assert index.held([t(60)]) == {"r1": 1} and index.held([t(50)]) == {}


def test_stale_history_of_a_replica_that_does_not_answer_is_never_routed_to():
    rep, consumer = FakeHost(), KVEventConsumer()
    policy = Placed(clock=lambda: 0.0)
    assert policy.history is not None
    conv = [t(i) for i in range(5)]
    rep.tracker.remember(zip(conv, [k(i) for i in range(5)], strict=True))
    rep.pool |= {k(i) for i in range(5)}
    deliver(consumer, policy.history, "gone", rep.publish())
    assert policy.history.held(conv) == {"gone": 5}  # the replica died after reporting
    for _ in range(20):
        d = policy.rank([Replica("r0"), Replica("r1")], "app", history=conv + [t(9)], static_blocks=0)
        assert d.chosen.name in ("r0", "r1") and "gone" not in [c.name for c in d.ranking]


def test_the_index_at_its_bound_evicts_under_stored_events_never_grows():
    rep, consumer, index = (
        FakeHost(HistoryTracker(max_entries=10_000, max_events=64)),
        KVEventConsumer(),
        HistoryIndex(50),
    )
    deliver(consumer, index, "r1", rep.publish())
    for batch in range(10):
        pairs = [(t(batch * 40 + i), k(batch * 40 + i)) for i in range(40)]
        rep.tracker.remember(pairs)
        rep.pool |= {p[1] for p in pairs}
        deliver(consumer, index, "r1", rep.publish())
        index.record("r2", [t(10_000 + batch * 40 + i) for i in range(40)])
        assert len(index) <= 50
    assert index.evictions > 0


def test_the_replicas_map_is_bounded_and_a_dropped_held_block_is_reported_removed():
    tracker = HistoryTracker(max_entries=8, max_events=1000)
    rep = FakeHost(tracker)
    rep.publish()
    tracker.remember([(t(i), k(i)) for i in range(8)])
    rep.pool |= {k(i) for i in range(8)}
    assert len(events(rep.publish())[HISTORY_STORED]) == 8
    tracker.remember([(t(i), k(i)) for i in range(100, 104)])  # four more: the four oldest leave the map
    assert len(tracker) == 8
    assert events(rep.publish())[HISTORY_REMOVED] == [t(i) for i in range(4)]


def test_a_diff_is_batched_within_its_bound_and_the_rest_follows():
    tracker = HistoryTracker(max_events=5)
    rep = FakeHost(tracker)
    rep.publish()
    tracker.remember([(t(i), k(i)) for i in range(12)])
    rep.pool |= {k(i) for i in range(12)}
    got = [events(rep.publish())[HISTORY_STORED] for _ in range(4)]
    assert [len(g) for g in got] == [5, 5, 2, 0]
    assert sum(got, []) == [t(i) for i in range(12)]


def test_a_snapshot_restates_held_blocks_in_rotating_windows():
    tracker = HistoryTracker(max_events=4)
    rep = FakeHost(tracker, snapshot_every=2)
    rep.publish()  # seq 1
    tracker.remember([(t(i), k(i)) for i in range(6)])
    rep.pool |= {k(i) for i in range(6)}
    while events(rep.publish())[HISTORY_STORED]:  # reported (and snapshots, which restate)
        pass
    seen: set[bytes] = set()
    for _ in range(8):
        payload = rep.publish()
        if payload["snapshot"]:
            window = events(payload)[HISTORY_STORED]
            assert 0 < len(window) <= 4
            seen |= set(window)
    assert seen == {t(i) for i in range(6)}


def test_text_blocks_map_onto_token_blocks_exactly_for_token_ids_and_by_scale_otherwise():
    # A token-id prompt of 130 ids: text blocks of 64 ids (256 bytes); token blocks of 16.
    assert token_blocks_at([256, 512, 520], 0, 0, 130, 16) == [3, 7, 7]
    # A chat: the static prefix's 600 bytes rendered as 160 tokens, the rest 400 bytes as 100.
    ends = [256, 512, 600, 856, 1000]
    at = token_blocks_at(ends, 3, 160, 260, 16)
    assert at[2] == 160 // 16 - 1  # the static prefix's last block ends at its last token block
    assert at[-1] == 260 // 16 - 1  # the prompt's end: its last full token block
    assert at == sorted(at)
    assert token_blocks_at([100], 1, 0, 8, 16) == [-1]  # no full token block


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_entries"):
        HistoryTracker(max_entries=0)
    with pytest.raises(ValueError, match="max_events"):
        HistoryTracker(max_events=-1)


def test_a_real_engines_finished_chats_report_the_routers_text_blocks(ckpt):
    """LLMEngine (through AsyncEngine and RequestRunner) with a history-tracking publisher: finished chats
    produce HistoryStored events whose hashes are exactly the router's hashes of the same messages, and
    blocks the KV manager evicts are reported removed."""
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.contract.prompt_blocks import PromptHasher
    from prefixserve.replica.contract.request import EngineRequest
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.engine.request_runner import RequestRunner
    from prefixserve.replica.sampling_params import SamplingParams

    engine = AsyncEngine(
        EngineConfig.from_dict({"model": ckpt, "num_kv_blocks": 160, "block_size": 4, "max_model_len": 512, "seed": 0})
    )
    pub = KVEventPublisher(snapshot_every=1000, history=HistoryTracker())
    runner = RequestRunner(engine, pub)
    router_hasher = PromptHasher()  # the router's, as router/serve/request_router.py builds it
    system = {"role": "system", "content": "You answer briefly. " * 20}

    def chat(user: int, turns: int) -> EngineRequest:
        messages = [system]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"user {user} question {turn} " * 14})
            if turn + 1 < turns:
                messages.append({"role": "assistant", "content": f"answer {turn} " * 10})
        return EngineRequest(messages=messages, sampling=SamplingParams(max_tokens=2, temperature=0), routing_key="app")

    async def run(request: EngineRequest) -> None:
        async for _ in runner.generate(request):
            pass

    def publish() -> dict:
        view = engine.kv_block_view()
        return pub.publish(view.contains, view.medium_of, view.shared_of, view.disk_group)

    consumer, index = KVEventConsumer(), HistoryIndex(10_000)
    try:
        deliver(consumer, index, "r1", publish())
        first = chat(1, 2)
        asyncio.run(run(first))
        payload = publish()
        stored = events(payload)[HISTORY_STORED]
        want = router_hasher.blocks(first).hashes
        assert len(want) >= 6 and set(stored) == set(want)
        deliver(consumer, index, "r1", payload)
        later = router_hasher.blocks(chat(1, 3)).hashes  # the next turn, as the router hashes it
        assert index.held(later) == {"r1": len(want)}
        # Other conversations take the whole cache: the first one's blocks are evicted and retracted.
        for user in range(2, 12):
            asyncio.run(run(chat(user, 1)))
        payload = publish()
        removed = events(payload)[HISTORY_REMOVED]
        own = want[router_hasher.blocks(chat(1, 1)).static_blocks :]  # beyond the shared system prompt
        assert removed and set(removed) <= set(want) and set(removed) & set(own)
        deliver(consumer, index, "r1", payload)
        assert index.held(later).get("r1", 0) < len(want)
    finally:
        asyncio.run(engine.shutdown())


def test_what_the_router_sent_before_a_replicas_first_report_survives_its_reset():
    rep, consumer, index = FakeHost(), KVEventConsumer(), HistoryIndex(100)
    conv = [t(i) for i in range(3)]
    index.record("r1", conv)  # routed before the router heard from the replica
    deliver(consumer, index, "r1", rep.publish())  # its first payload: a reset
    assert index.held(conv) == {"r1": 3}


def test_the_sends_kept_for_reports_are_bounded_in_all():
    index = HistoryIndex(10)
    for r in range(5):
        index.record(f"r{r}", [t(100 * r + i) for i in range(4)])
    assert index._sent_total <= 10 and sum(len(s) for s in index._sent.values()) == index._sent_total
    index.report("r0", [], [], reset=True)
    index.forget("r1")
    assert index._sent_total == sum(len(s) for s in index._sent.values())
