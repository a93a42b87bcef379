"""The ZMQ subscriber feeding the router's KV-event index (router/kv_index/subscriber.py), on 127.0.0.1:

* a committed fixture of vLLM-format frames (vllm_0_32_kv_events.json), built here for the
  fields a CPU server never sends (test_vllm_captured_events.py parses a real server's):
  ``fixture_frames`` encodes it with vLLM 0.32's own struct
  definitions (tests/vllm_events_helpers.py, copied from vllm/distributed/kv_events.py), with
  int hashes (0.32's default), bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) and 0.32's
  newer fields (extra_keys, group_idx, lora_name, session_id); the test checks the file still
  equals that encoding, then feeds it through the subscriber;
* our replica's publisher (replica/engine/kv_event_publisher.py) end to end into the index, the
  history a late subscriber missed fetched from the replay socket;
* gaps filled by replay, gaps replay cannot fill, restarts, malformed frames and payloads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq
from kv_helpers import block_stored
from vllm_events_helpers import ENCODER, local
from vllm_events_helpers import AllBlocksCleared as VAllBlocksCleared
from vllm_events_helpers import BlockRemoved as VBlockRemoved
from vllm_events_helpers import BlockStored as VBlockStored
from vllm_events_helpers import KVEventBatch as VKVEventBatch

from prefixserve.replica.contract.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    external_block_hash,
)
from prefixserve.replica.engine.kv_event_publisher import ZmqKVEventPublisher
from prefixserve.router.kv_index import EventSource, KVEventIndex, ZmqKVEventSubscriber, vllm_block_hashes

FIXTURE = Path(__file__).with_name("vllm_0_32_kv_events.json")
TOKENS = list(range(1000, 1048))  # 3 blocks of 16
HASHES = vllm_block_hashes(TOKENS, 16)
OTHER = vllm_block_hashes(list(range(2000, 2016)), 16)


def _stored(hashes, parent, tokens, medium="GPU", **kw) -> VBlockStored:
    return VBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=kw.pop("lora_name", None),
        **kw,
    )


def fixture_frames() -> list[list[bytes]]:
    """The fixture's frames ``[topic, seq, payload]``, encoded with vLLM 0.32's structs."""
    ints = [external_block_hash(h) for h in HASHES]
    batches = [
        VKVEventBatch(ts=1.0, events=[_stored(ints[:2], None, TOKENS[:32], group_idx=0)], data_parallel_rank=0),
        VKVEventBatch(
            ts=2.0,
            events=[
                _stored([ints[2]], ints[1], TOKENS[32:48], group_idx=0, session_id="s1", extra_keys=[None]),
                # A bytes-hash publisher (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), with a LoRA adapter.
                _stored([OTHER[0]], None, list(range(2000, 2016)), lora_name="ad", extra_keys=[("ad",)]),
                # A CPU offload copy: vLLM's placeholder form (no tokens, block_size 0).
                VBlockStored(
                    block_hashes=[ints[0]],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                ),
            ],
            data_parallel_rank=0,
        ),
        VKVEventBatch(ts=3.0, events=[VBlockRemoved(block_hashes=[ints[2]], medium="GPU", group_idx=0)]),
        VKVEventBatch(ts=4.0, events=[VAllBlocksCleared(), _stored([ints[0]], None, TOKENS[:16])]),
    ]
    return [[b"", seq.to_bytes(8, "big"), ENCODER.encode(b)] for seq, b in enumerate(batches)]


def _write_fixture() -> None:  # how the committed file was made
    frames = [{"topic": t.hex(), "seq": s.hex(), "payload": p.hex()} for t, s, p in fixture_frames()]
    FIXTURE.write_text(json.dumps(frames, indent=1) + "\n")


def _read_fixture() -> list[list[bytes]]:
    frames = json.loads(FIXTURE.read_text())
    return [[bytes.fromhex(f["topic"]), bytes.fromhex(f["seq"]), bytes.fromhex(f["payload"])] for f in frames]


def _subscriber(index: KVEventIndex, **source) -> tuple[ZmqKVEventSubscriber, EventSource]:
    src = EventSource(**{"replica": "v", "endpoint": "tcp://127.0.0.1:1", **source})
    return ZmqKVEventSubscriber([src], index, replay_timeout_s=5.0), src


def test_the_fixture_is_vllms_encoding():
    assert _read_fixture() == fixture_frames()


def test_the_vllm_fixture_through_the_subscriber():
    index = KVEventIndex()
    sub, src = _subscriber(index)
    frames = _read_fixture()
    sub.handle(src, frames[0])
    sub.handle(src, frames[1])
    assert index.longest_prefix(HASHES) == {"v": 3}
    assert index.longest_prefix(HASHES, media={"CPU"}) == {"v": 1}
    assert index.longest_prefix(OTHER) == {"v": 1}  # bytes hashes meet the bytes digests
    sub.handle(src, frames[2])
    assert index.longest_prefix(HASHES) == {"v": 2}
    sub.handle(src, frames[3])
    assert index.longest_prefix(HASHES) == {"v": 1}
    assert index.holders(HASHES[0]) == {"v": frozenset({"GPU"})}
    assert len(index) == 1
    assert sub.stats.malformed == 0 and sub.stats.gaps == 0


@pytest.fixture
def publisher():
    pub = ZmqKVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=8)
    )
    yield pub
    pub.close()


def _ours(hashes: list[bytes], medium="GPU") -> BlockStored:
    return block_stored([external_block_hash(h) for h in hashes], medium)


def _wait_replayable(pub: ZmqKVEventPublisher, n: int) -> None:
    """Until the publisher's thread has sent (and buffered) ``n`` batches."""
    for _ in range(1000):
        if pub.sent >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the publisher sent {pub.sent} of {n} batches")


def test_our_publisher_into_the_index_a_late_subscriber_replays_what_it_missed(publisher):
    publisher.publish([_ours(HASHES[:2])])  # before anyone subscribes: only the replay buffer has it
    _wait_replayable(publisher, 1)
    index = KVEventIndex()
    src = EventSource("ours", local(publisher.endpoint), local(publisher.replay_endpoint))
    sub = ZmqKVEventSubscriber([src], index, replay_timeout_s=5.0).start()
    try:
        # Until the SUB socket is connected its frames are lost; each later one shows the gap.
        for i in range(500):
            publisher.publish([_ours(OTHER)] if i == 0 else [])
            if index.longest_prefix(HASHES) == {"ours": 2}:
                break
            time.sleep(0.01)
        assert index.longest_prefix(HASHES) == {"ours": 2}
        assert index.longest_prefix(OTHER) == {"ours": 1}
        publisher.publish([BlockRemoved(block_hashes=[external_block_hash(HASHES[1])], medium="GPU")])
        for _ in range(500):
            if index.longest_prefix(HASHES) == {"ours": 1}:
                break
            time.sleep(0.01)
        assert index.longest_prefix(HASHES) == {"ours": 1}
        assert sub.stats.malformed == 0 and sub.stats.replay_failures == 0 and sub.stats.replayed >= 1
    finally:
        sub.stop()


def test_a_gap_is_filled_from_the_replay_socket(publisher):
    for h in HASHES:  # batches 0, 1, 2: one block each
        publisher.publish([_ours([h])])
    _wait_replayable(publisher, 3)
    index = KVEventIndex()
    sub, src = _subscriber(index, replay_endpoint=local(publisher.replay_endpoint))
    live = _frame(0, [_ours([HASHES[0]])])
    sub.handle(src, live)
    # Batch 1 never arrives live; batch 2 does: 1 comes from the replay, then 2 is applied.
    sub.handle(src, _frame(2, [_ours([HASHES[2]])]))
    assert index.longest_prefix(HASHES) == {"v": 3}
    assert sub.stats.gaps == 1 and sub.stats.replayed == 1 and sub.stats.replay_failures == 0


def test_a_gap_the_replay_cannot_fill_forgets_the_replica():
    index = KVEventIndex()
    sub, src = _subscriber(index)  # no replay endpoint
    sub.handle(src, _frame(0, [_ours(HASHES[:2])]))
    sub.handle(src, _frame(2, [_ours(OTHER)]))  # batch 1 (which might have removed blocks) is lost
    assert index.longest_prefix(HASHES) == {}
    assert index.longest_prefix(OTHER) == {"v": 1}
    assert sub.stats.replay_failures == 1


def test_a_buffer_past_the_gap_forgets_the_replica_and_keeps_the_run_it_has(publisher):
    for i in range(12):  # buffer_steps=8: seqs 4..11 stay
        publisher.publish([_ours([OTHER[0]])] if i else [_ours(HASHES[:1])])
    _wait_replayable(publisher, 12)
    index = KVEventIndex()
    sub, src = _subscriber(index, replay_endpoint=local(publisher.replay_endpoint))
    sub.handle(src, _frame(0, [_ours(HASHES[:1])]))
    sub.handle(src, _frame(11, [_ours([OTHER[0]])]))  # 1..10 missing, 1..3 no longer buffered
    assert index.longest_prefix(HASHES) == {}  # batch 1, 2 or 3 may have removed it
    assert index.longest_prefix(OTHER[:1]) == {"v": 1}  # 4..10 applied to an empty view
    assert sub.stats.replay_failures == 1 and sub.stats.replayed == 7


def test_a_restarted_publisher_resets_the_replica():
    index = KVEventIndex()
    sub, src = _subscriber(index)
    sub.handle(src, _frame(0, [_ours(HASHES[:2])]))
    sub.handle(src, _frame(1, [_ours(HASHES[2:])]))
    sub.handle(src, _frame(0, [_ours(OTHER)]))  # counts from 0 again: a new process, an empty cache
    assert index.longest_prefix(HASHES) == {}
    assert index.longest_prefix(OTHER) == {"v": 1}
    assert sub.stats.restarts == 1


def test_malformed_frames_are_skipped_and_an_undecodable_payload_forgets_the_replica():
    index = KVEventIndex(max_entries=8)
    sub, src = _subscriber(index)
    sub.handle(src, _frame(0, [_ours(HASHES[:2])]))
    sub.handle(src, [b"", b"\x00"])  # two parts
    sub.handle(src, [b"", b"\x00\x01", b""])  # a 2-byte seq
    sub.handle(src, [b"", (-5).to_bytes(8, "big", signed=True), b""])  # negative
    assert index.longest_prefix(HASHES) == {"v": 2}
    assert sub.stats.malformed == 3
    sub.handle(src, [b"", (1).to_bytes(8, "big"), b"\x93\xff garbage"])
    assert index.longest_prefix(HASHES) == {}  # batch 1's events are unknown
    # A well-formed batch of the wrong shape (a map where the batch array goes) is refused the same way.
    sub.handle(src, [b"", (2).to_bytes(8, "big"), ENCODER.encode({"ts": 1.0, "events": []})])
    assert sub.stats.malformed == 5
    # A huge batch stays within the bound; the stream goes on.
    many = [i.to_bytes(32, "big") for i in range(100)]
    sub.handle(src, _frame(3, [_ours(many)]))
    assert len(index) == 8
    sub.handle(src, _frame(4, [_ours(HASHES[:1])]))
    assert index.longest_prefix(HASHES) == {"v": 1}


def test_the_thread_survives_garbage_on_the_wire():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KVEventIndex()
    sub = ZmqKVEventSubscriber([EventSource("x", f"tcp://127.0.0.1:{port}")], index).start()
    try:
        assert pub.poll(10_000), "the subscription never arrived"
        pub.recv()  # the SUB's subscribe message: frames sent from now on reach it
        pub.send_multipart([b"only one part"])
        pub.send_multipart([b"", b"12345678", b"\xc1"])  # 0xc1 is never valid msgpack
        pub.send_multipart(_frame(2, [_ours(HASHES[:1])]))
        for _ in range(500):
            if index.longest_prefix(HASHES):
                break
            time.sleep(0.01)
        assert index.longest_prefix(HASHES) == {"x": 1}
        assert sub.stats.malformed == 2
    finally:
        sub.stop()
        pub.close()


def _frame(seq: int, events) -> list[bytes]:
    payload = ENCODER.encode(VKVEventBatch(ts=0.0, events=[_vllm(e) for e in events]))
    return [b"", seq.to_bytes(8, "big"), payload]


def _vllm(e):
    """Our event as vLLM's struct (the frame then is vLLM's encoding)."""
    if isinstance(e, BlockStored):
        return VBlockStored(**{f: getattr(e, f) for f in e.__struct_fields__})
    if isinstance(e, BlockRemoved):
        return VBlockRemoved(**{f: getattr(e, f) for f in e.__struct_fields__})
    assert isinstance(e, AllBlocksCleared)
    return VAllBlocksCleared()


def test_an_older_vllms_array_layout_is_indexed_too():
    from vllm_events_helpers import LegacyBlockRemoved, LegacyBlockStored, LegacyKVEventBatch

    ints = [external_block_hash(h) for h in HASHES]
    stored = LegacyBlockStored(
        block_hashes=ints, parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None, medium="GPU"
    )
    index = KVEventIndex()
    sub, src = _subscriber(index)
    sub.handle(src, [b"", (0).to_bytes(8, "big"), ENCODER.encode(LegacyKVEventBatch(ts=1.0, events=[stored]))])
    removed = LegacyBlockRemoved(block_hashes=ints[2:], medium="GPU")
    sub.handle(src, [b"", (1).to_bytes(8, "big"), ENCODER.encode(LegacyKVEventBatch(ts=2.0, events=[removed]))])
    assert index.longest_prefix(HASHES) == {"v": 2}
    assert sub.stats.malformed == 0
