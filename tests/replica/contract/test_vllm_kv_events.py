"""vLLM's KV-event wire format (replica/contract/vllm_kv_events.py): the int form of a hash, the
seq frames, and the endpoints of several publishers built from one config (vLLM's rank offset)."""

from __future__ import annotations

import msgspec
import pytest

from prefixserve.replica.contract.vllm_kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    decode_any_batch,
    decode_batch,
    decode_seq,
    encode_seq,
    external_block_hash,
    normalize_block_hash,
    offset_endpoint,
)


def test_the_int_form_is_the_low_64_bits_read_big_endian():
    digest = bytes(range(16))
    assert external_block_hash(digest) == 0x08090A0B0C0D0E0F
    assert normalize_block_hash(digest) == 0x08090A0B0C0D0E0F
    assert normalize_block_hash(0x08090A0B0C0D0E0F) == 0x08090A0B0C0D0E0F
    assert normalize_block_hash(2**64 + 5) == 5
    assert normalize_block_hash(True) is None and normalize_block_hash("ab") is None


def test_seq_frames():
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_seq(encode_seq(258)) == 258
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1  # the replay end marker
    with pytest.raises(ValueError, match="8 bytes"):
        decode_seq(b"\x01")


def test_endpoints_offset_by_rank_as_vllm_offsets_its_data_parallel_ranks():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"  # any free port already differs
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError, match="port"):
        offset_endpoint("tcp://host", 1)
    cfg = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600", topic="t")
    moved = cfg.for_rank(2)
    assert (moved.endpoint, moved.replay_endpoint, moved.topic) == ("tcp://*:5559", "tcp://*:5602", "t")
    assert KVEventsConfig.from_json(moved.to_json()) == moved


def test_older_releases_array_layout_decodes_to_the_same_events():
    from vllm_events_helpers import ENCODER, LegacyBlockRemoved, LegacyBlockStored, LegacyKVEventBatch

    payload = ENCODER.encode(
        LegacyKVEventBatch(
            ts=2.0,
            events=[
                LegacyBlockStored(
                    block_hashes=[5, 6], parent_block_hash=4, token_ids=[1, 2], block_size=1, lora_id=None, medium="GPU"
                ),
                LegacyBlockRemoved(block_hashes=[5], medium="GPU"),
            ],
        )
    )
    with pytest.raises(msgspec.ValidationError):
        decode_batch(payload)  # 0.32's decoder wants maps
    batch = decode_any_batch(payload)
    assert batch.ts == 2.0
    assert batch.events == [
        BlockStored(
            block_hashes=[5, 6],
            parent_block_hash=4,
            token_ids=[1, 2],
            block_size=1,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[5], medium="GPU"),
    ]
    with pytest.raises(msgspec.DecodeError):
        decode_any_batch(b"\xc1")
