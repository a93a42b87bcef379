"""Contract 2: chained block hashes, pinned against an independent encoding."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import xxhash

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.kv.hashing import DEFAULT_HASH_SEED, BlockHasher, hash_blocks


def _independent(algo: str, seed: bytes, tokens: list[int], bs: int, salt: bytes | None) -> list[bytes]:
    """The documented byte layout, written out again with struct only."""

    def h(data: bytes) -> bytes:
        if algo == "sha256":
            return hashlib.sha256(data).digest()
        return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big")  # canonical form

    parent = h(seed)
    out = []
    for i in range(len(tokens) // bs):
        if i == 0 and salt is not None:
            extra = struct.pack("<I", 1) + bytes([0x01]) + struct.pack("<I", len(salt)) + salt
        else:
            extra = struct.pack("<I", 0)
        parent = h(parent + extra + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_matches_documented_byte_layout(algo):
    rng = random.Random(11)
    tokens = [rng.randrange(2**32) for _ in range(16 * 5 + 7)]
    for salt in (None, "tenant-a"):
        got = BlockHasher(algo).hash_blocks(tokens, 16, salt)
        want = _independent(algo, b"prefixserve-v1", tokens, 16, salt.encode() if salt else None)
        assert got == want
        assert len(got) == 5  # the partial sixth block is not hashed


def test_pinned_values():
    # Block 0 of tokens 0..3, block size 4, default seed, no salt; computed by hand:
    # sha256(sha256(b"prefixserve-v1") + 00000000 + 00000000 01000000 02000000 03000000).
    seed_digest = hashlib.sha256(b"prefixserve-v1").digest()
    layout = seed_digest + bytes(4) + bytes.fromhex("00000000010000000200000003000000")
    assert BlockHasher("sha256").hash_blocks([0, 1, 2, 3], 4) == [hashlib.sha256(layout).digest()]
    # SHA-256 is the default (collision-resistant), in the hasher and the engine's knob alike.
    assert BlockHasher().hash_blocks([0, 1, 2, 3], 4) == [hashlib.sha256(layout).digest()]
    assert EngineConfig(model="smollm2").prefix_hash_algo == "sha256"
    x_root = xxhash.xxh3_128_intdigest(b"prefixserve-v1").to_bytes(16, "big")
    x_layout = x_root + bytes(4) + bytes.fromhex("00000000010000000200000003000000")
    assert BlockHasher("xxh3_128").hash_blocks([0, 1, 2, 3], 4) == [
        xxhash.xxh3_128_intdigest(x_layout).to_bytes(16, "big")
    ]


def test_algos_differ_but_are_deterministic():
    tokens = list(range(64))
    x1, x2 = BlockHasher("xxh3_128").hash_blocks(tokens, 16), BlockHasher("xxh3_128").hash_blocks(tokens, 16)
    s1, s2 = BlockHasher("sha256").hash_blocks(tokens, 16), BlockHasher("sha256").hash_blocks(tokens, 16)
    assert x1 == x2 and s1 == s2
    assert {len(h) for h in x1} == {16} and {len(h) for h in s1} == {32}
    assert not set(x1) & {h[:16] for h in s1}


def test_incremental_equals_one_shot():
    rng = random.Random(3)
    tokens = [rng.randrange(50_000) for _ in range(16 * 9)]
    hasher = BlockHasher()
    whole = hasher.hash_blocks(tokens, 16, "s")
    first = hasher.hash_blocks(tokens[:40], 16, "s")  # 2 full blocks
    rest = hasher.hash_blocks(tokens, 16, "s", start=2, parent=first[-1])
    assert first + rest == whole
    assert hasher.hash_blocks(tokens, 16, "s", start=2, stop=4, parent=first[-1]) == whole[2:4]
    assert hash_blocks(tokens, 16, "s") == whole


def test_chain_salt_seed_and_extra_keys_change_hashes():
    tokens = list(range(48))
    base = BlockHasher().hash_blocks(tokens, 16)
    # A change in block 0 changes every later hash (the chain).
    changed = BlockHasher().hash_blocks([7] + tokens[1:], 16)
    assert all(a != b for a, b in zip(base, changed))
    # A change in block 2 leaves blocks 0 and 1 alone.
    tail = BlockHasher().hash_blocks(tokens[:40] + [999] + tokens[41:], 16)
    assert tail[:2] == base[:2] and tail[2] != base[2]
    salted = BlockHasher().hash_blocks(tokens, 16, "a")
    assert all(a != b for a, b in zip(base, salted))
    assert BlockHasher().hash_blocks(tokens, 16, b"a") == salted  # str salt = its UTF-8
    assert BlockHasher(seed=b"other").hash_blocks(tokens, 16) != base
    assert BlockHasher(seed=DEFAULT_HASH_SEED).hash_blocks(tokens, 16) == base
    # A salt and an adapter id with the same bytes are tagged apart.
    adapter = BlockHasher().hash_blocks(tokens, 16, extra_keys=["a"])
    assert adapter[0] != salted[0] and adapter[0] != base[0]


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match="xxh3_128, sha256"):
        BlockHasher("md5")
    h = BlockHasher()
    with pytest.raises(ValueError, match="non-empty"):
        h.hash_blocks([1] * 16, 16, "")
    with pytest.raises(ValueError, match=r"0\.\.2\*\*32-1"):
        h.hash_blocks([-1] * 16, 16)
    with pytest.raises(ValueError, match="parent"):
        h.hash_blocks([1] * 32, 16, start=1)
    with pytest.raises(ValueError, match="block_size"):
        h.hash_blocks([1] * 32, 0)
