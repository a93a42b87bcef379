"""vLLM's sha256_cbor block hashes (router/kv_index/vllm_hashes.py) against vLLM 0.32's definition
(vllm/v1/core/kv_cache_utils.py hash_block_tokens, init_none_hash; vllm/utils/hashing.py
sha256_cbor), the expected digests computed here independently: the CBOR bytes written out by hand
for the small cases, cbor2 for the rest."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from prefixserve.replica.contract.vllm_kv_events import external_block_hash
from prefixserve.router.kv_index.vllm_hashes import DEFAULT_NONE_HASH_SEED, none_hash, vllm_block_hashes


def _text(s: str) -> bytes:  # CBOR major type 3, length < 24
    assert len(s) < 24
    return bytes([0x60 + len(s)]) + s.encode()


def _bytes32(b: bytes) -> bytes:  # CBOR major type 2, one-byte length
    assert len(b) == 32
    return b"\x58\x20" + b


def test_none_hash_is_sha256_of_the_cbor_text_seed():
    expected = hashlib.sha256(_text("vllm-none-hash")).digest()
    assert DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert none_hash() == expected
    assert none_hash("0") == hashlib.sha256(b"\x61" + b"0").digest()  # PYTHONHASHSEED=0 on the servers


def test_block_hashes_by_hand_encoded_cbor():
    root = hashlib.sha256(_text("vllm-none-hash")).digest()
    # (parent, (1, 2, 3, 4), None): array(3), bytes(32), array(4) of small ints, null.
    b0 = hashlib.sha256(b"\x83" + _bytes32(root) + b"\x84\x01\x02\x03\x04" + b"\xf6").digest()
    b1 = hashlib.sha256(b"\x83" + _bytes32(b0) + b"\x84\x05\x06\x07\x08" + b"\xf6").digest()
    assert vllm_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [b0, b1]  # the partial block is not hashed
    # Token ids above 23 take CBOR's longer integer forms: 24 -> 18 18, 1000 -> 19 03 e8.
    b = hashlib.sha256(b"\x83" + _bytes32(root) + b"\x82\x18\x18\x19\x03\xe8" + b"\xf6").digest()
    assert vllm_block_hashes([24, 1000], 2) == [b]


def test_extra_keys_lora_on_every_block_and_the_salt_on_block_zero():
    seed = "42"
    root = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    lora = ("lora", "adapter", "/models/adapter")
    tokens = list(range(100, 108))
    b0 = hashlib.sha256(
        cbor2.dumps((root, tuple(tokens[:4]), (lora, ("cache_salt", "tenant-a"))), canonical=True)
    ).digest()
    b1 = hashlib.sha256(cbor2.dumps((b0, tuple(tokens[4:]), (lora,)), canonical=True)).digest()
    got = vllm_block_hashes(tokens, 4, seed=seed, cache_salt="tenant-a", lora=("adapter", "/models/adapter"))
    assert got == [b0, b1]
    # Each key changes every hash from its block on.
    plain = vllm_block_hashes(tokens, 4, seed=seed)
    assert plain[0] != got[0] and plain[1] != got[1]
    salted = vllm_block_hashes(tokens, 4, seed=seed, cache_salt="tenant-a")
    assert salted[0] != plain[0] and salted[1] != plain[1]


def test_event_form_is_the_low_64_bits_big_endian():
    (digest,) = vllm_block_hashes([1, 2, 3, 4], 4)
    assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    with pytest.raises(ValueError, match="block_size"):
        vllm_block_hashes([1], 0)
