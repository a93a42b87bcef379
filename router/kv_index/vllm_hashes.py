"""A request's block hashes computed the way vLLM 0.32 computes them (vllm/v1/core/kv_cache_utils.py).

Job: let a router score vLLM replicas by the prefix they hold: hash a request's tokens as
the server will, then look the hashes up in the KV-event index (router/kv_index/index.py).

vLLM's definition, with ``--prefix-caching-hash-algo sha256_cbor``::

    H(x)           = SHA-256 of cbor2.dumps(x, canonical=True)
    NONE_HASH      = H(seed)        seed: the server's PYTHONHASHSEED if set, else "vllm-none-hash"
    block_hash[i]  = H((parent_i, tuple(tokens_i), extra_keys_i))
    parent_0       = NONE_HASH;  parent_i = block_hash[i-1]
    extra_keys_i   = None, or a tuple of (in this order) ("lora", name, path) on every block of a
                     LoRA request, ("cache_salt", salt) on block 0 of a salted request
                     (multimodal and prompt-embedding keys are not modelled here)

Only full blocks are hashed. What the vLLM servers must be started with for these hashes to
equal theirs: ``--prefix-caching-hash-algo sha256_cbor`` (0.32's default, ``sha256``, pickles
the key: Python-only), the same ``PYTHONHASHSEED`` on every server passed here as ``seed``
(unset on the servers: leave the default; with ``xxhash``/``xxhash_cbor`` an unset seed is
random per process and nothing outside can match), the same ``--block-size`` (the CPU
backend's default is 128, the GPU's 16) and the token ids the server will see, so the same
tokenizer and chat template as the server (``/tokenize`` on the server gives them exactly).

Events carry hashes as ints by default (replica/contract/vllm_kv_events.py's
``external_block_hash``); the index normalizes both forms, so these digests can be passed as is.

Pure: hashlib and cbor2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2

# vLLM 0.32's NONE_HASH seed for a cryptographic hash when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """Block 0's parent: ``sha256_cbor`` of the seed string."""
    return sha256_cbor(seed)


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_NONE_HASH_SEED,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """The ``sha256_cbor`` hashes of every full block of ``token_ids`` (the module docstring).

    ``lora``: the request's adapter as (name, path), as the server knows it.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lora_keys: list[tuple[str, ...]] = [("lora", lora[0], lora[1])] if lora is not None else []
    parent = none_hash(seed)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        keys = list(lora_keys)
        if i == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        tokens = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        parent = sha256_cbor((parent, tokens, tuple(keys) if keys else None))
        out.append(parent)
    return out
