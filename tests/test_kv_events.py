"""replica/contract/kv_events.py: the KV event publisher (no Ray) and the router-side consumer, fed by a real engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from prefixserve.replica.contract.kv_events import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    KVEventConsumer,
    KVEventPublisher,
    holds_prefix,
    leading_held,
)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_first_publish_is_a_snapshot_then_diffs_name_changed_blocks():
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("k1", [h(1), h(2), h(3), h(4)])
    pool = {h(1), h(2)}
    first = pub.publish(pool.__contains__)
    assert first["seq"] == 1 and first["snapshot"] and first["events"] == []
    assert first["held"] == {"k1": [2, 4]}
    json.dumps(first)  # JSON-serializable
    pool |= {h(3), h(4)}
    second = pub.publish(pool.__contains__)
    assert not second["snapshot"] and second["held"] == {"k1": [4, 4]}
    assert second["events"] == [{"type": BLOCK_STORED, "key": "k1", "block_hashes": [h(3).hex(), h(4).hex()]}]
    pool.discard(h(1))
    third = pub.publish(pool.__contains__)
    assert third["events"] == [{"type": BLOCK_REMOVED, "key": "k1", "block_hashes": [h(1).hex()]}]
    assert third["held"] == {"k1": [0, 4]}  # block 0 gone: a request of k1 hits nothing
    quiet = pub.publish(pool.__contains__)
    assert quiet["events"] == [] and quiet["held"] == {}


def test_a_keys_prefix_is_the_common_run_of_its_requests():
    pub = KVEventPublisher()
    pub.remember("k", [h(1), h(2), h(3), h(9)])
    pub.remember("k", [h(1), h(2), h(3), h(7), h(8)])
    assert pub.prefix("k") == [h(1), h(2), h(3)]
    pub.remember("k", [h(1), h(5)])
    assert pub.prefix("k") == [h(1)]
    assert pub.prefix_blocks("k") == 1 and pub.prefix_blocks("other") is None


def test_events_are_bounded_and_an_overflow_becomes_a_snapshot():
    pub = KVEventPublisher(max_events=5, snapshot_every=100)
    for k in range(4):
        pub.remember(f"k{k}", [h(10 * k + i) for i in range(3)])
    pool: set[bytes] = set()
    pub.publish(pool.__contains__)
    pool |= {h(10 * k + i) for k in range(4) for i in range(3)}  # 12 stored hashes > 5
    payload = pub.publish(pool.__contains__)
    assert payload["snapshot"] and payload["events"] == []
    assert payload["held"] == {f"k{k}": [3, 3] for k in range(4)}


def test_keys_beyond_max_keys_are_forgotten_oldest_first_and_a_snapshot_follows():
    pub = KVEventPublisher(max_keys=2, snapshot_every=100)
    pub.remember("a", [h(1)])
    pub.remember("b", [h(2)])
    pub.publish(lambda _h: True)
    pub.remember("a", [h(1)])  # a is now the most recent
    pub.remember("c", [h(3)])
    payload = pub.publish(lambda _h: True)
    assert payload["snapshot"] and set(payload["held"]) == {"a", "c"}


def test_blocks_per_key_are_capped():
    pub = KVEventPublisher(max_blocks_per_key=3)
    pub.remember("k", [h(i) for i in range(10)])
    assert pub.prefix("k") == [h(0), h(1), h(2)]


@pytest.mark.parametrize(
    ("present", "leading", "holds"),
    [
        ([True, True, False, True], 2, True),
        ([False, True, True], 0, False),
        ([True, False, False, False], 1, False),
    ],
)
def test_held_summary_reading(present, leading, holds):
    assert leading_held(present) == leading
    assert holds_prefix(leading, len(present)) is holds


def test_consumer_applies_the_diff_after_a_gap_and_a_new_epoch_waits_for_its_snapshot():
    pub = KVEventPublisher(snapshot_every=4)
    pub.remember("k", [h(1), h(2)])
    pool = {h(1), h(2)}
    consumer = KVEventConsumer()
    assert consumer.apply("r", pub.publish(pool.__contains__)) == [("k", True)]  # seq 1, snapshot
    assert consumer.apply("r", pub.publish(pool.__contains__)) == []  # seq 2: nothing changed
    pool.clear()
    lost = pub.publish(pool.__contains__)  # seq 3: never delivered
    assert lost["held"] == {"k": [0, 2]}
    pool.add(h(1))
    pool.add(h(2))
    # seq 4 is a snapshot (every 4th); make seq 4 a diff by asking for a later snapshot period.
    pub.snapshot_every = 100
    after_gap = pub.publish(pool.__contains__)
    assert not after_gap["snapshot"]
    # Its summary is absolute: the key is held again, whatever the missed payload said.
    assert consumer.apply("r", after_gap) == [("k", True)] and consumer.gaps == 1 and consumer.in_sync("r")
    pub.snapshot_every = 5
    pool.clear()
    snap = pub.publish(pool.__contains__)  # seq 5: snapshot
    assert snap["snapshot"]
    assert consumer.apply("r", snap) == [("k", False)]
    assert consumer.apply("r", snap) == []  # the same report seen again
    # A new publisher (a restarted replica) has another epoch: a diff of it before any snapshot
    # is ignored; its snapshot is taken in.
    fresh = KVEventPublisher(snapshot_every=3)
    fresh.remember("k2", [h(5)])
    fresh.publish(lambda _h: True)  # seq 1, the snapshot: never delivered
    fresh.remember("k3", [h(6)])
    diff = fresh.publish(lambda _h: True)  # seq 2: k3 is new
    assert not diff["snapshot"] and consumer.apply("r", diff) == [] and consumer.gaps == 1
    snap = fresh.publish(lambda _h: True)  # seq 3
    assert snap["snapshot"] and consumer.apply("r", snap) == [("k2", True), ("k3", True)]


def test_a_snapshot_withdraws_keys_it_no_longer_lists():
    consumer = KVEventConsumer()
    base = {"format": 1, "epoch": "e", "events": []}
    consumer.apply("r", {**base, "seq": 1, "snapshot": True, "held": {"a": [1, 1], "b": [1, 1]}})
    facts = consumer.apply("r", {**base, "seq": 2, "snapshot": True, "held": {"b": [1, 1]}})
    assert facts == [("b", True), ("a", False)]
    assert consumer.apply("r", {"format": 99}) == []


def test_a_real_engine_feeds_the_publisher_through_the_request_runner(tmp_path):
    """Requests with a routing key through RequestRunner: the publisher learns the key's shared prefix
    blocks (Contract-2 hashes equal to the KV manager's) and sees them in the real pool."""
    from model_helpers import tiny_checkpoint

    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.contract.request import EngineRequest
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.engine.request_runner import RequestRunner
    from prefixserve.replica.sampling_params import SamplingParams

    model = tiny_checkpoint(tmp_path / "tiny", max_pos=512)
    engine = AsyncEngine(
        EngineConfig.from_dict({"model": str(model), "num_kv_blocks": 64, "block_size": 4, "max_model_len": 256})
    )
    pub = KVEventPublisher(snapshot_every=100)
    runner = RequestRunner(engine, pub)
    system = "You are a careful assistant. " + "alpha beta gamma delta " * 8

    async def ask(question: str) -> None:
        request = EngineRequest(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            sampling=SamplingParams(max_tokens=2, temperature=0),
            routing_key="tenant",
        )
        async for _ in runner.generate(request):
            pass

    try:
        asyncio.run(ask("first question"))
        asyncio.run(ask("another one entirely"))
        kv = engine.engine.kv_manager
        prefix = pub.prefix("tenant")
        assert len(prefix) >= 4  # the system prompt's blocks, not the questions'
        ids = engine.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "x"}])
        assert prefix == kv.hasher.hash_blocks(ids, kv.block_size, None)[: len(prefix)]
        payload = pub.publish(kv.pool.hash_to_block.__contains__)
        assert payload["held"]["tenant"] == [len(prefix), len(prefix)]
        # An unkeyed request teaches the publisher nothing.
        asyncio.run(runner.generate(EngineRequest(prompt="plain", sampling=SamplingParams(max_tokens=1))).aclose())
        assert len(pub) == 1
    finally:
        asyncio.run(engine.shutdown())
