"""vLLM's own ``KVCacheManager`` on bench_kv's admit + free workload (the peer row of ``bench_kv``).

Run by a *vLLM* interpreter, never by ours: vLLM's CPU build replaces torch, so
it lives in a virtualenv of its own (docs/benchmarks/kv_manager.md). This file
imports only the standard library at module level and vLLM inside ``run_vllm``;
it never imports prefixserve, so ``/path/to/vllm-venv/bin/python
loadtest/peers/vllm_kv_manager.py`` works with nothing else installed.
``loadtest/bench_kv.py --vllm-python PY`` runs it in a subprocess and imports
``workload`` from it, so both processes generate the identical token ids (checked:
the peer reports ``workload_digest``).

The workload (``workload``): a warm-up prompt, then ``num_requests`` prompts of
``prompt_len`` tokens whose first half is the warm-up's first half (those blocks
hit) and whose second half is unique; each is looked up, allocated and freed
before the next (``admit + free``). Two pools:

* ``roomy``: ``(num_requests + 1) * blocks_per_prompt`` usable blocks, so no
  cached block is ever evicted (every allocation takes a never-used block);
* ``pressure``: ``4 * blocks_per_prompt`` usable blocks, first filled with
  cached free blocks by admitting and freeing unique filler prompts, so every
  admission evicts the unique half's worth of cached blocks.

vLLM reserves block 0 as its null block; the peer asks for one more block so
both managers have the same number of usable blocks.

Two timings, because vLLM computes ``request.block_hashes`` when a ``Request``
is created (its ``block_hasher``), not in the manager, while ours hashes inside
``get_computed_blocks``:

* ``hashing``: the timed loop includes computing the prompt's chained block
  hashes (vLLM: ``get_request_block_hasher(block_size, get_hash_fn_by_name("xxhash"))``,
  i.e. xxh3_128 over a pickle of (parent, tokens, extra keys));
* ``ops``: the hashes are computed before the clock starts; only
  ``get_computed_blocks`` + ``allocate_slots`` + ``free`` are timed.

Creating the ``Request`` objects (with ``SamplingParams(max_tokens=1)``) is never
timed. Each run builds a fresh manager; the best of ``repeats`` runs is kept.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

POOLS = ("roomy", "pressure")
TIMINGS = ("hashing", "ops")
VOCAB = 128_000


def workload(seed: int, num_requests: int, prompt_len: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(warm-up prompt, the timed prompts, filler prompts), all ``prompt_len`` long and seeded.

    Every timed prompt starts with the warm-up's first ``prompt_len // 2`` tokens
    and continues with its own; the fillers (for the ``pressure`` pool) are
    unique throughout. Pure ``random.Random`` (same in every CPython 3 process).
    """
    rng = random.Random(f"{seed}-kv-peer")
    half = prompt_len // 2

    def toks(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    shared = toks(half)
    warm = shared + toks(prompt_len - half)
    prompts = [shared + toks(prompt_len - half) for _ in range(num_requests)]
    fillers = [toks(prompt_len) for _ in range(8)]
    return warm, prompts, fillers


def workload_digest(warm: Sequence[int], prompts: Sequence[Sequence[int]], fillers: Sequence[Sequence[int]]) -> str:
    """A short digest of every token id, so both processes can prove they ran the same workload."""
    h = hashlib.sha256()
    for p in [warm, *prompts, *fillers]:
        h.update(",".join(map(str, p)).encode())
        h.update(b";")
    return h.hexdigest()[:16]


def pool_blocks(pool: str, num_requests: int, prompt_len: int, block_size: int) -> int:
    """Usable blocks of a pool kind (see the module docstring)."""
    per = -(-prompt_len // block_size)
    if pool == "roomy":
        return (num_requests + 1) * per
    if pool == "pressure":
        return 4 * per
    raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")


def num_fillers(pool: str, num_blocks: int, prompt_len: int, block_size: int) -> int:
    """Filler prompts admitted + freed before the warm-up: enough to leave every block cached."""
    return 0 if pool == "roomy" else -(-num_blocks // (prompt_len // block_size))


def _best(repeats: int, once: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        r = once()
        if best is None or r["seconds"] < best["seconds"]:
            best = r
    assert best is not None
    return best


def run_vllm(
    seed: int,
    num_requests: int,
    prompt_len: int,
    block_size: int,
    repeats: int,
    pools: Sequence[str],
    timings: Sequence[str],
) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("xxhash")  # prefix_caching_hash_algo="xxhash"
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    params = SamplingParams(max_tokens=1)
    warm, prompts, fillers = workload(seed, num_requests, prompt_len)
    # One full-attention layer group; the manager only reads block_size from the spec.
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)

    def manager(usable: int) -> Any:
        config = KVCacheConfig(
            num_blocks=usable + 1,  # + vLLM's null block 0
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        return KVCacheManager(
            config,
            max_model_len=prompt_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )

    def admit_free(m: Any, req: Any) -> int:
        blocks, n, _ = m.get_computed_blocks(req)
        if m.allocate_slots(req, prompt_len - n, n, blocks) is None:
            raise RuntimeError("pool too small for the benchmark")
        m.free(req)
        return int(n)

    def once(pool: str, timing: str) -> dict[str, Any]:
        usable = pool_blocks(pool, num_requests, prompt_len, block_size)
        m = manager(usable)
        k = num_fillers(pool, usable, prompt_len, block_size)
        for i, p in enumerate(fillers[:k] + [warm]):
            admit_free(m, Request(f"fill{i}", p, params, None, block_hasher=hasher))
        with_hashes = timing == "ops"
        reqs = [
            Request(f"r{i}", p, params, None, block_hasher=hasher if with_hashes else None)
            for i, p in enumerate(prompts)
        ]
        cached0 = len(m.block_pool.cached_block_hash_to_block)
        hit = 0
        gc.collect()
        t0 = time.perf_counter()
        if with_hashes:
            for r in reqs:
                hit += admit_free(m, r)
        else:
            for r in reqs:
                r.block_hashes.extend(hasher(r))  # what Request.__init__ does with a block_hasher
                hit += admit_free(m, r)
        seconds = time.perf_counter() - t0
        per = prompt_len // block_size
        new_cached = num_requests * per - hit // block_size
        evictions = cached0 + new_cached - len(m.block_pool.cached_block_hash_to_block)
        return {"seconds": seconds, "hit_tokens": hit, "evictions": evictions, "num_blocks": usable}

    rows = []
    for pool in pools:
        for timing in timings:
            r = _best(repeats, lambda pool=pool, timing=timing: once(pool, timing))
            rows.append({"pool": pool, "timing": timing, **r})
    return {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "hash": "xxhash (xxh3_128 of pickle)",
        "workload_digest": workload_digest(warm, prompts, fillers),
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pools", default=",".join(POOLS))
    ap.add_argument("--timings", default=",".join(TIMINGS))
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    res = run_vllm(
        args.seed,
        args.requests,
        args.prompt_len,
        args.block_size,
        args.repeats,
        args.pools.split(","),
        args.timings.split(","),
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
