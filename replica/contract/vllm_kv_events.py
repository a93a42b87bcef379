"""vLLM's KV-event wire format (vLLM 0.32, vllm/distributed/kv_events.py), for both ends.

Job: one definition of the frames that vLLM's ZMQ KV-event publisher sends, so a
replica can speak it (replica/engine/kv_event_publisher.py) and a router can read it
from vLLM servers and from ours (router/kv_index/). llm-d, Dynamo, vllm-router's
``kv_aware`` policy and Ray's KV-aware router consume this format.

Frames. The PUB socket sends multipart messages ``[topic, seq, payload]``: ``topic``
the configured topic (UTF-8, ``""`` by default), ``seq`` an 8-byte big-endian
counter from 0 (one per batch), ``payload`` a msgpack ``KVEventBatch``. The replay
socket is a ROUTER: a client (a DEALER) sends ``[b"", start_seq]`` (8 bytes,
big-endian) and gets ``[b"", topic, seq, payload]`` for every buffered batch with
``seq >= start_seq``, then the end marker ``[b"", b"", END_SEQ, b""]`` (END_SEQ is -1
as a signed 8-byte big-endian integer).

Payload. The structs below equal vLLM 0.32's field for field (names, order, types,
defaults, and the msgspec options that shape the bytes): ``KVEventBatch`` is an array
``[ts, events, data_parallel_rank]``; each event a map tagged ``"type"`` (the class
name), fields left at their default omitted. Decoders ignore fields they do not know,
so a newer vLLM's additions decode too.

Block hashes. vLLM 0.32 sends each hash as an int by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's low 64 bits read big-endian
(``int.from_bytes(digest, "big") & (2**64 - 1)``); with that variable at 0 it sends the
digest's bytes. ``external_block_hash`` is the int form; ``normalize_block_hash``
maps either form to it, so a consumer matches both kinds of publisher.

Media. vLLM's names: ``GPU`` (the device pool, also on its CPU backend), ``CPU`` (a host
offload tier), ``STORAGE`` (a file tier); ours (replica/kv/tiers.py) map onto them.

Pure: msgspec only (no ZMQ, no torch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

import msgspec

# An 8-byte big-endian -1: the replay socket's last frame after the buffered batches.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# Our tier names (replica/kv/tiers.py's media, kept as literals: the contract imports nothing
# of the engine) to vLLM's.
MEDIUM_OF_TIER: dict[str, str] = {"device": MEDIUM_GPU, "host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}

_LOW_64 = (1 << 64) - 1

# vLLM's ExternalBlockHash: bytes (a digest) or int (its low 64 bits).
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (a tagged union: the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one chain entered ``medium``; ``parent_block_hash`` is the
    block before the first (None at the chain's start), ``token_ids`` the blocks' tokens."""

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
    """The blocks left ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block of the publisher is gone (a prefix-cache reset, a rebuilt cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """One engine step's events, in order."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# Older vLLM releases encoded each event as an array (``array_like=True`` on the event base
# class too): ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
# medium, lora_name, ...]``, the trailing fields a release did not have (or left at their default)
# absent. Decoded only by consumers (``decode_any_batch``); we never publish it.


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(EventBatch):
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
_LEGACY_DECODER = msgspec.msgpack.Decoder(type=_LegacyBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of a batch (the frame after ``seq``)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into a batch; ``msgspec.DecodeError`` (a ``ValueError``) when malformed."""
    return _DECODER.decode(payload)


def decode_any_batch(payload: bytes) -> KVEventBatch:
    """``decode_batch``, falling back to the older array layout of the events (converted to these
    structs); ``msgspec.DecodeError``/``ValidationError`` when it is neither."""
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError:
        legacy = _LEGACY_DECODER.decode(payload)
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in legacy.events:
        if isinstance(e, _LegacyBlockStored):
            events.append(
                BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                    lora_name=e.lora_name,
                )
            )
        elif isinstance(e, _LegacyBlockRemoved):
            events.append(BlockRemoved(block_hashes=e.block_hashes, medium=e.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=legacy.ts, events=events, data_parallel_rank=legacy.data_parallel_rank)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number of a ``seq`` frame (signed: the replay end marker reads -1)."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a seq frame is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def external_block_hash(digest: bytes) -> int:
    """vLLM 0.32's default event form of a block hash: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _LOW_64


def normalize_block_hash(value: object) -> int | None:
    """An event's block hash (bytes or int) as ``external_block_hash``'s int; None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value & _LOW_64
    if isinstance(value, bytes):
        return external_block_hash(value)
    return None


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (vllm/config/kv_events.py), the same field names and defaults.

    ``publisher`` None means ``"zmq"`` when events are enabled, ``"null"`` otherwise (as vLLM).
    A PUB ``endpoint`` binds when it holds ``*`` or ``::`` or is ``ipc://``/``inproc://``, and
    connects otherwise (vLLM's rule); ``replay_endpoint`` always binds.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"endpoint must be a tcp://, ipc:// or inproc:// address, got {self.endpoint!r}")
        if self.replay_endpoint is not None and (
            not isinstance(self.replay_endpoint, str)
            or not self.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://"))
        ):
            raise ValueError(
                f"replay_endpoint must be a tcp://, ipc:// or inproc:// address, got {self.replay_endpoint!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def enabled(self) -> bool:
        """Whether a ZMQ publisher runs (events on and the publisher not ``null``)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_json(self) -> str:
        """The JSON object ``from_json`` reads back (vLLM's CLI form)."""
        return json.dumps(dataclasses.asdict(self))

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config for the ``rank``-th of several publishers built from it on one host (the
        replicas of one Serve deployment): each endpoint moved by ``offset_endpoint``."""
        return dataclasses.replace(
            self,
            endpoint=offset_endpoint(self.endpoint, rank),
            replay_endpoint=None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, rank),
        )

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the JSON object vLLM's CLI takes; unknown keys are refused, by name."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config must be a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port`` (its data-parallel ranks' endpoints): a tcp port moved up by
    ``rank`` (port 0, any free port, left as it is), an inproc name suffixed ``_dp<rank>``; an ipc
    path suffixed the same way (vLLM refuses ipc there; two publishers cannot share one path)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not head.startswith("tcp://"):
        raise ValueError(f"a tcp endpoint needs a port to offset, got {endpoint!r}")
    return endpoint if int(port) == 0 else f"{head}:{int(port) + rank}"
