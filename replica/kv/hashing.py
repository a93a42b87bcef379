"""Chained block hashes (Contract 2 of docs/design.md): the identity of a KV block.

Byte layout, language-neutral (no pickle), so any process, the router or a
client in another language computes the same digests:

    root           = H(seed)                       seed defaults to b"prefixserve-v1"
    block_hash[i]  = H(parent_i || extra_i || tokens_i)
    parent_0       = root;  parent_i = block_hash[i-1]
    tokens_i       = the block's ``block_size`` token ids, each a little-endian uint32
    extra_i        = le32(k) || k entries of  tag:u8 || le32(len(payload)) || payload
                       tag 0x01  cache_salt (UTF-8), on block 0 only, when a salt is given
                       tag 0x02  an extra key (adapter id; UTF-8 or raw bytes), on every
                                 block, in the order given
                     so a block without extra keys has extra_i = 00 00 00 00.
    H              = SHA-256 (32 bytes), the default, as vLLM's: the seed is public, so
                     with a non-cryptographic H a client could craft two prompts whose
                     blocks collide and be served another tenant's KV; or xxh3_128 (seed 0)
                     as its canonical 16-byte big-endian digest (C:
                     XXH128_canonicalFromHash; Python: xxhash.xxh3_128_digest), the
                     option where every client is trusted. SHA-256 costs about 0.8 us
                     more per 16-token block (loadtest/bench_kv.py, docs/engine.md).

Only full blocks are hashed: a partial block's content is still changing.
Because each digest covers its parent, equal hashes mean equal whole prefixes.

Invariants: hashing is a pure function of (algo, seed, tokens, salt, extra keys).
Imports: stdlib and xxhash only (no torch, no ray): the router uses this module.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

HASH_ALGOS: tuple[str, ...] = ("xxh3_128", "sha256")
DEFAULT_HASH_ALGO = "sha256"
DEFAULT_HASH_SEED = b"prefixserve-v1"

_TAG_SALT = 0x01
_TAG_EXTRA = 0x02

# array("I") is a C unsigned int: 4 bytes on every platform Python supports
# today; checked once so the byte layout can never silently change.
_U32 = "I" if array("I").itemsize == 4 else "L"
if array(_U32).itemsize != 4:  # pragma: no cover - exotic platform
    raise ImportError("no 4-byte unsigned array typecode on this platform")
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


def _as_bytes(value: str | bytes, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise ValueError(f"{what} must be str or bytes, got {type(value).__name__}")


def encode_extra(entries: Sequence[tuple[int, bytes]]) -> bytes:
    """``extra_i`` for the given (tag, payload) entries, in order."""
    out = bytearray(len(entries).to_bytes(4, "little"))
    for tag, payload in entries:
        out.append(tag)
        out += len(payload).to_bytes(4, "little")
        out += payload
    return bytes(out)


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian uint32 (ValueError outside 0..2**32-1)."""
    try:
        arr = array(_U32, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in 0..2**32-1 to be hashed: {exc}") from None
    if _BIG_ENDIAN_HOST:  # pragma: no cover - no big-endian CI host
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True)
class BlockKeys:
    """What besides its tokens enters a request's block hashes: its cache salt (block 0) and
    its extra keys (every block; a LoRA adapter's name). Passed where a bare salt goes."""

    cache_salt: str | bytes | None = None
    extra_keys: tuple[str | bytes, ...] = ()


class BlockHasher:
    """Computes the chained hashes of a token sequence's full blocks.

    ``hash_blocks`` is incremental: pass ``start`` (the first block index to
    hash) and ``parent`` (the digest of block ``start - 1``) to extend hashes
    cached earlier without rehashing the prefix.
    """

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, seed: str | bytes = DEFAULT_HASH_SEED) -> None:
        if algo not in _DIGESTS:
            raise ValueError(f"hash algo {algo!r} is unknown: choose one of {', '.join(HASH_ALGOS)}")
        self.algo = algo
        self.seed = _as_bytes(seed, "hash seed")
        self._digest = _DIGESTS[algo]
        self.root: bytes = self._digest(self.seed)
        self.digest_size = len(self.root)

    def digest(self, data: bytes) -> bytes:
        """H(data) with this hasher's algorithm."""
        return self._digest(data)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | bytes | BlockKeys | None = None,
        *,
        extra_keys: Sequence[str | bytes] = (),
        start: int = 0,
        stop: int | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Hashes of full blocks ``start, start+1, ...`` (up to ``stop``, exclusive) of ``token_ids``.

        ``token_ids`` is the whole sequence from position 0 (block ``i`` covers
        ``token_ids[i*block_size:(i+1)*block_size]``); the trailing partial
        block is not hashed. Returns one digest per block, in order. A ``BlockKeys`` in
        place of ``cache_salt`` gives the salt and extra keys (its keys before ``extra_keys``).
        """
        if isinstance(cache_salt, BlockKeys):
            extra_keys = (*cache_salt.extra_keys, *extra_keys)
            cache_salt = cache_salt.cache_salt
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if start == 0:
            if parent is not None:
                raise ValueError("parent must be None when start == 0 (block 0's parent is H(seed))")
            parent = self.root
        elif parent is None:
            raise ValueError(f"start={start} needs parent= the hash of block {start - 1}")
        if cache_salt is not None:
            salt = _as_bytes(cache_salt, "cache_salt")
            if not salt:
                raise ValueError("cache_salt must be non-empty, or None for no salt")
        else:
            salt = None
        extras = [(_TAG_EXTRA, _as_bytes(k, "extra key")) for k in extra_keys]
        extra_rest = encode_extra(extras)
        extra_first = encode_extra([(_TAG_SALT, salt), *extras]) if salt is not None else extra_rest

        n_full = len(token_ids) // block_size
        stop = n_full if stop is None else min(stop, n_full)
        if stop <= start:
            return []
        data = encode_tokens(token_ids[start * block_size : stop * block_size])
        nbytes = block_size * 4
        digest = self._digest
        out: list[bytes] = []
        append = out.append
        pos = 0
        if start == 0:
            parent = digest(parent + extra_first + data[:nbytes])
            append(parent)
            pos = nbytes
        end = len(data)
        while pos < end:
            parent = digest(parent + extra_rest + data[pos : pos + nbytes])
            append(parent)
            pos += nbytes
        return out


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int = 16,
    cache_salt: str | bytes | None = None,
    *,
    algo: str = DEFAULT_HASH_ALGO,
    seed: str | bytes = DEFAULT_HASH_SEED,
    extra_keys: Sequence[str | bytes] = (),
) -> list[bytes]:
    """One-shot convenience: the chained hashes of every full block of ``token_ids``."""
    return BlockHasher(algo, seed).hash_blocks(token_ids, block_size, cache_salt, extra_keys=extra_keys)
