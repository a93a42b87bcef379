"""replica/contract/kv_events.py: the KV event publisher (no Ray) and the router-side consumer, fed by a real engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from prefixserve.replica.contract.kv_events import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    MEDIUM_DEVICE,
    MEDIUM_DISK,
    MEDIUM_HOST,
    KVEventConsumer,
    KVEventPublisher,
    TierWeights,
    holds_prefix,
    leading_held,
    weighted_blocks,
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


def test_a_real_engine_feeds_the_publisher_through_the_request_runner(ckpt):
    """Requests with a routing key through RequestRunner: the publisher learns the key's shared prefix
    blocks (Contract-2 hashes equal to the KV manager's) and sees them in the real pool."""
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.contract.request import EngineRequest
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.engine.request_runner import RequestRunner
    from prefixserve.replica.sampling_params import SamplingParams

    engine = AsyncEngine(
        EngineConfig.from_dict({"model": ckpt, "num_kv_blocks": 64, "block_size": 4, "max_model_len": 256})
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
        ids = engine.engine.input_processor.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": "x"}]
        )
        assert prefix == kv.hasher.hash_blocks(ids, kv.block_size, None)[: len(prefix)]
        payload = pub.publish(kv.pool.hash_to_block.__contains__)
        assert payload["held"]["tenant"] == [len(prefix), len(prefix)]
        # An unkeyed request teaches the publisher nothing.
        asyncio.run(runner.generate(EngineRequest(prompt="plain", sampling=SamplingParams(max_tokens=1))).aclose())
        assert len(pub) == 1
    finally:
        asyncio.run(engine.shutdown())


def test_events_carry_each_blocks_medium_and_a_move_between_tiers_is_removed_then_stored():
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("k1", [h(1), h(2), h(3), h(4)])
    device, host, disk = {h(1), h(2), h(3), h(4)}, set(), set()

    def medium_of(x: bytes) -> str | None:
        return MEDIUM_HOST if x in host else MEDIUM_DISK if x in disk else None

    first = pub.publish(device.__contains__, medium_of, disk.__contains__, "g")
    assert first["snapshot"] and first["tiers"] == {"k1": [4, 0, 0, 0]} and first["disk_group"] == "g"
    device -= {h(3), h(4)}  # evicted: h(3) kept in the host tier, h(4) on disk only
    host.add(h(3))
    disk |= {h(1), h(2), h(3), h(4)}
    second = pub.publish(device.__contains__, medium_of, disk.__contains__, "g")
    assert second["held"] == {"k1": [2, 4]}  # the device's view, as without tiers
    assert second["tiers"] == {"k1": [2, 1, 1, 4]}
    assert sorted((e["type"], e["medium"], tuple(e["block_hashes"])) for e in second["events"]) == [
        (BLOCK_REMOVED, MEDIUM_DEVICE, (h(3).hex(), h(4).hex())),
        (BLOCK_STORED, MEDIUM_DISK, (h(4).hex(),)),
        (BLOCK_STORED, MEDIUM_HOST, (h(3).hex(),)),
    ]
    json.dumps(second)
    assert pub.publish(device.__contains__, medium_of, disk.__contains__, "g")["events"] == []


def test_the_consumer_weighs_tier_blocks_between_a_recompute_and_a_device_hit():
    assert weighted_blocks(1, 2, 1, 0, TierWeights(host=0.5, disk=0.25)) == 1 + 1.0 + 0.25
    assert weighted_blocks(0, 0, 0, 4, TierWeights(disk=0.5)) == 2.0
    with pytest.raises(ValueError, match="host tier weight"):
        TierWeights(host=1.5)
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("k", [h(i) for i in range(4)])
    payload = pub.publish(set().__contains__, lambda x: MEDIUM_HOST)  # every block in the host tier
    # Without weights for the host tier (0) the replica holds nothing; with the default it holds the key.
    assert KVEventConsumer(TierWeights(host=0.0)).apply("r", payload) == [("k", False)]
    assert KVEventConsumer().apply("r", payload) == [("k", True)]


def test_a_shared_disk_run_counts_for_every_replica_of_its_directory():
    def payload(pub: KVEventPublisher, shared: set[bytes], group: str) -> dict:
        return pub.publish(set().__contains__, lambda x: None, shared.__contains__, group)

    blocks = [h(i) for i in range(4)]
    pubs = {name: KVEventPublisher(snapshot_every=100) for name in ("a", "b", "c")}
    for pub in pubs.values():
        pub.remember("k", blocks)
    for weight, held in ((0.6, True), (0.4, False)):  # 4 shared blocks x weight against half of 4
        consumer = KVEventConsumer(TierWeights(disk=weight))
        assert consumer.apply("b", payload(pubs["b"], set(), "g")) == [("k", False)]
        assert consumer.apply("c", payload(pubs["c"], set(), "other")) == [("k", False)]
        # a wrote the key's blocks to the directory b mounts too: b can load them, c cannot.
        assert consumer.apply("a", payload(pubs["a"], set(blocks), "g")) == [("k", held)]
        assert consumer.take_shared_facts() == [("b", "k", held)]
        assert sorted(consumer.held().get("k", [])) == (["a", "b"] if held else [])
        for pub in pubs.values():
            pub.seq = 0  # the next payloads are snapshots again, for the next consumer


def test_a_real_engine_reports_its_host_tier_blocks(ckpt):
    """An engine with a host tier: blocks its device pool evicted are reported in the host medium."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    llm = LLM(ckpt, num_kv_blocks=8, kv_offloading_size=2**22 / 2**30)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = list(range(100, 164))  # 4 full blocks
    llm.generate([first], params)
    llm.generate([list(range(200, 312))], params)  # takes every block: the first prompt's go to the host tier
    kv = llm.engine.kv_manager
    pub = KVEventPublisher()
    pub.remember("k", kv.hasher.hash_blocks(first, kv.block_size, None))
    payload = pub.publish(kv.pool.hash_to_block.__contains__, kv.tier_medium)
    device, host, disk, shared = payload["tiers"]["k"]
    assert host > 0 and device + host == 4 and disk == shared == 0
    assert KVEventConsumer().apply("r", payload) == [("k", True)]
    assert payload["held"]["k"][0] < 2  # the device alone would not hold the key
    llm.shutdown()


def test_a_publish_with_a_disk_tier_lists_the_directory_at_most_once(tmp_path, monkeypatch):
    """The publisher's tier lookups of a real disk tier cost no per-block system call: at most
    one directory listing per ``list_every_s``, whatever the number of tracked blocks."""
    import os

    from prefixserve.replica.kv.disk_tier import DiskKey, DiskTier

    key = DiskKey("ab" * 32, "float32", 16, "cpu:2x16x16.2x16x16", 0, 1, 64)
    now = [0.0]
    tier = DiskTier(str(tmp_path), 1 << 24, key, list_every_s=2.0, clock=lambda: now[0])
    other = DiskTier(str(tmp_path), 1 << 24, key)  # another replica sharing the directory
    keys = {f"k{k}": [h(k * 1000 + i) for i in range(32)] for k in range(64)}
    pub = KVEventPublisher(snapshot_every=1000)
    for k, hashes in keys.items():
        pub.remember(k, hashes)

    def medium_of(x: bytes) -> str | None:
        return MEDIUM_DISK if tier.contains(x) else None

    calls = {"stat": 0, "scandir": 0}
    real_stat, real_scandir = os.stat, os.scandir

    def counting_stat(*args, **kwargs):
        calls["stat"] += 1
        return real_stat(*args, **kwargs)

    def counting_scandir(*args, **kwargs):
        calls["scandir"] += 1
        return real_scandir(*args, **kwargs)

    def publish() -> dict:
        calls.update(stat=0, scandir=0)
        monkeypatch.setattr(os, "stat", counting_stat)
        monkeypatch.setattr(os, "scandir", counting_scandir)
        try:
            return pub.publish(set().__contains__, medium_of, tier.contains, tier.group)
        finally:
            monkeypatch.undo()

    assert publish()["tiers"]["k0"] == [0, 0, 0, 0]
    assert calls == {"stat": 0, "scandir": 0}
    for x in keys["k0"][:8]:  # the other replica writes a key's first 8 blocks
        other.store(x, bytes(64))
    assert other.flush()
    assert publish()["tiers"].get("k0") is None  # within the listing interval: not seen yet
    assert calls == {"stat": 0, "scandir": 0}
    now[0] += 2.0
    assert publish()["tiers"]["k0"] == [0, 0, 8, 8]  # one listing sees the other replica's files
    assert calls == {"stat": 0, "scandir": 1}
    assert publish()["tiers"].get("k0") is None  # unchanged: no event, no listing
    assert calls == {"stat": 0, "scandir": 0}
    os.remove(os.path.join(tier.path, key.file_name(keys["k0"][7])))  # the other replica's trim
    assert tier.load(keys["k0"][7]) is None  # a miss found by a read leaves the set at once
    assert publish()["tiers"]["k0"] == [0, 0, 7, 7]
    assert tier.store(keys["k1"][0], bytes(64)) and tier.flush()  # this replica's write shows at once
    assert publish()["tiers"]["k1"] == [0, 0, 1, 1] and calls["stat"] == 0
    tier.close()
    other.close()
