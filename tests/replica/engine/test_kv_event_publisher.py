"""The vLLM-format KV-event publisher (replica/engine/kv_event_publisher.py) over real ZMQ sockets on
127.0.0.1: frames decoded with vLLM 0.32's own struct definitions (tests/vllm_events_helpers.py),
the replay socket, a stalled sender's dropped batch, the config; and an engine that publishes
every step's block events, which replayed equal its pool's hashes."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from vllm_events_helpers import DECODER, local, replay, replay_until
from vllm_events_helpers import AllBlocksCleared as VAllBlocksCleared
from vllm_events_helpers import BlockRemoved as VBlockRemoved
from vllm_events_helpers import BlockStored as VBlockStored

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    external_block_hash,
)
from prefixserve.replica.engine.kv_event_publisher import ZmqKVEventPublisher, binds

STORED = BlockStored(
    block_hashes=[external_block_hash(b"\x01" * 16), external_block_hash(b"\x02" * 16)],
    parent_block_hash=None,
    token_ids=list(range(8)),
    block_size=4,
    lora_id=None,
    medium="GPU",
    lora_name=None,
)
# The same event as vLLM's own struct decodes it.
V_STORED = VBlockStored(**{f: getattr(STORED, f) for f in STORED.__struct_fields__})


def _config(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", **kw)


@pytest.fixture
def publisher():
    pub = ZmqKVEventPublisher(_config(topic="kv", buffer_steps=3))
    yield pub
    pub.close()


def _subscribe(ctx: zmq.Context, pub: ZmqKVEventPublisher, topic: bytes = b"kv") -> zmq.Socket:
    """A SUB socket receiving ``pub``'s frames: probe batches are sent until one arrives (PUB drops
    frames for a subscriber whose connection is not complete yet)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(local(pub.endpoint))
    for _ in range(200):
        pub.publish([AllBlocksCleared()])
        if sub.poll(100):
            while sub.poll(100):
                sub.recv_multipart()
            return sub
    raise AssertionError("the SUB socket never received a probe batch")


def test_frames_decode_with_vllms_structs(publisher):
    ctx = zmq.Context.instance()
    sub = _subscribe(ctx, publisher)
    try:
        removed = BlockRemoved(block_hashes=[7], medium="CPU")
        assert publisher.publish([STORED, removed], ts=12.5)
        assert publisher.publish([AllBlocksCleared()], ts=13.0)
        first = sub.recv_multipart()
        second = sub.recv_multipart()
    finally:
        sub.close()
    topic, seq, payload = first
    assert topic == b"kv"
    assert int.from_bytes(second[1], "big") == int.from_bytes(seq, "big") + 1
    batch = DECODER.decode(payload)
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 0
    assert batch.events == [V_STORED, VBlockRemoved(block_hashes=[7], medium="CPU")]
    assert DECODER.decode(second[2]).events == [VAllBlocksCleared()]


def test_replay_sends_the_buffered_batches_from_a_seq_then_the_end_marker(publisher):
    ctx = zmq.Context.instance()
    for i in range(5):  # buffer_steps=3: seqs 2, 3, 4 stay
        publisher.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
    # The thread may not have sent all five yet when the request arrives: ask until it has.
    got = replay_until(publisher.replay_endpoint, 3, lambda got: bool(got) and int.from_bytes(got[-1][1], "big") == 4)
    assert [int.from_bytes(f[1], "big") for f in got] == [3, 4]
    assert [DECODER.decode(f[2]).events[0].block_hashes for f in got] == [[3], [4]]
    assert all(f[0] == b"kv" for f in got)
    everything = replay(ctx, publisher.replay_endpoint, 0)
    assert [int.from_bytes(f[1], "big") for f in everything] == [2, 3, 4]


def test_a_malformed_replay_request_is_ignored_and_the_socket_keeps_serving(publisher):
    ctx = zmq.Context.instance()
    publisher.publish([AllBlocksCleared()])
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(local(publisher.replay_endpoint))
    bad.send_multipart([b"", b"\x00\x01"])  # not an 8-byte seq
    bad.send_multipart([b"junk"])
    bad.close()
    got = replay_until(publisher.replay_endpoint, 0, bool)
    assert [int.from_bytes(f[1], "big") for f in got] == [0]


def test_a_batch_dropped_on_a_full_queue_makes_the_next_one_start_with_all_blocks_cleared():
    pub = ZmqKVEventPublisher(_config(max_queue_size=1))
    entered, release = threading.Event(), threading.Event()
    send = pub._send

    def stalled(batch):
        entered.set()
        release.wait()
        send(batch)

    pub._send = stalled  # type: ignore[method-assign]
    try:
        assert pub.publish([BlockRemoved(block_hashes=[1], medium="GPU")])
        assert entered.wait(10)  # the thread holds batch 0 in a stalled send
        assert pub.publish([BlockRemoved(block_hashes=[2], medium="GPU")])  # fills the queue
        assert not pub.publish([BlockRemoved(block_hashes=[3], medium="GPU")])
        assert pub.dropped == 1
        release.set()
        for _ in range(1000):  # the thread takes batch 1 off the queue
            if pub._queue.empty():
                break
            time.sleep(0.01)
        assert pub.publish([BlockRemoved(block_hashes=[4], medium="GPU")])
        got = replay_until(pub.replay_endpoint, 0, lambda got: len(got) == 3)
        events = [DECODER.decode(f[2]).events for f in got]
        assert events[0] == [VBlockRemoved(block_hashes=[1], medium="GPU")]
        assert events[1] == [VBlockRemoved(block_hashes=[2], medium="GPU")]
        assert events[2] == [VAllBlocksCleared(), VBlockRemoved(block_hashes=[4], medium="GPU")]
    finally:
        release.set()
        pub.close()


def test_config_takes_vllms_json_and_refuses_unknown_keys():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "t"}')
    assert cfg.publisher == "zmq" and cfg.enabled and cfg.buffer_steps == 10_000 and cfg.hwm == 100_000
    assert not KVEventsConfig.from_json("{}").enabled
    assert KVEventsConfig.from_json("{}").publisher == "null"
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "buffer_steps": 0}')
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.from_json("[1]")
    with pytest.raises(ValueError, match="kv_events_config"):
        EngineConfig(kv_events_config="{not json")
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events == KVEventsConfig(True)
    # vLLM's bind-or-connect rule for the PUB socket.
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("tcp://[::]:1")
    assert not binds("tcp://10.0.0.1:5557")


def _replay_everything(pub: ZmqKVEventPublisher) -> list[list[bytes]]:
    """Every batch the publisher holds, once its thread has sent the last one published."""
    last = pub._next_seq - 1
    return replay_until(pub.replay_endpoint, 0, lambda got: bool(got) and int.from_bytes(got[-1][1], "big") == last)


def test_the_engine_publishes_each_steps_block_events(ckpt):
    """Blocks stored and evicted by a real engine: replayed from seq 0, the batches' events hold
    exactly the pool's hashes, with the prompt's tokens in the stored events."""
    from prefixserve.replica.engine.core import LLMEngine
    from prefixserve.replica.sampling_params import SamplingParams

    knobs = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
    engine = LLMEngine(EngineConfig(model=ckpt, num_kv_blocks=12, block_size=4, kv_events_config=knobs))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        prompts = [[20 + (i * 7 + j) % 50 for j in range(13)] for i in range(4)]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
            while engine.has_unfinished_requests():
                engine.step()
        pub = engine.kv_event_publisher
        assert pub is not None
        got = _replay_everything(pub)
        held: set[int] = set()
        stored_tokens: list[int] = []
        for _topic, _seq, payload in got:
            for e in DECODER.decode(payload).events:
                if isinstance(e, VAllBlocksCleared):
                    held.clear()
                elif isinstance(e, VBlockStored):
                    assert e.medium == "GPU" and e.block_size == 4
                    assert len(e.token_ids) == 4 * len(e.block_hashes)
                    held.update(e.block_hashes)
                    stored_tokens += e.token_ids
                else:
                    assert e.medium == "GPU"
                    held.difference_update(e.block_hashes)
        assert held == {external_block_hash(h) for h in engine.kv_manager.pool.hash_to_block}
        assert stored_tokens[:12] == prompts[0][:12]
        assert any(isinstance(e, VBlockRemoved) for f in got for e in DECODER.decode(f[2]).events)
    finally:
        engine.shutdown()


def test_the_engine_reports_its_host_and_disk_tiers(ckpt, tmp_path):
    """With the host and disk tiers on, replayed events hold the host tier's hashes as CPU and the
    disk directory's as STORAGE (the disk's set as of the engine's last step)."""
    from prefixserve.replica.engine.core import LLMEngine
    from prefixserve.replica.sampling_params import SamplingParams

    knobs = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
    config = EngineConfig(
        model=ckpt,
        num_kv_blocks=12,
        block_size=4,
        kv_offloading_size=2**22 / 2**30,
        kv_disk_path=str(tmp_path / "kv"),
        kv_disk_size_gb=0.05,
        kv_events_config=knobs,
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i in range(6):  # more prompts than the device holds: evictions go to the host tier
            engine.add_request(f"r{i}", [20 + (i * 11 + j) % 60 for j in range(17)], params)
            while engine.has_unfinished_requests():
                engine.step()
        assert engine.tiers is not None and engine.tiers.disk is not None
        assert engine.tiers.flush()
        engine._disk_events_due = 0.0  # the next step diffs the disk's set at once
        engine.step()
        pub = engine.kv_event_publisher
        assert pub is not None
        got = _replay_everything(pub)
        media: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        for _topic, _seq, payload in got:
            for e in DECODER.decode(payload).events:
                if isinstance(e, VAllBlocksCleared):
                    for held in media.values():
                        held.clear()
                elif isinstance(e, VBlockStored):
                    media[e.medium].update(e.block_hashes)
                else:
                    media[e.medium].difference_update(e.block_hashes)
        kv = engine.kv_manager
        assert media["GPU"] == {external_block_hash(h) for h in kv.pool.hash_to_block}
        assert media["CPU"] == {external_block_hash(h) for h in kv._host_of_hash}
        assert media["STORAGE"] == {external_block_hash(h) for h in engine.tiers.disk.known_hashes()}
        assert media["CPU"] and media["STORAGE"]
    finally:
        engine.shutdown()
