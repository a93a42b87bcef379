"""KV tier benchmark: one replica whose conversations outgrow its device pool.

``python -m prefixserve.loadtest.bench_tiers`` runs, in one process and side by side:

1. **Multi-turn** (``loadtest/workloads.py``'s ``multi_turn``: users x rounds, each
   round resending the user's whole history; users shuffled within a round), sized so
   that the last round's histories need ``--pool-ratio`` (4) times the device pool.
   Requests are sent one at a time (TTFT is the prefill of what is not cached). One
   engine per row: the device pool alone (tier off), plus a host tier of 4x the pool,
   plus the shared disk tier, and a pool big enough for everything (unlimited). Per
   row: the hit rate (prompt tokens served from any tier / prompt tokens), which tier
   served them, TTFT p50 and p99, and the ratio of TTFT p50 to the tier-off row's.
   Targets (issue): hit rate within 5 points of unlimited; TTFT p50 <= 0.5x tier-off.
2. **Copy-back cost**: a prompt of ``--restore-tokens`` tokens, per block size, its
   TTFT when nothing is cached (recompute), when its blocks are on the device, in the
   host tier (evicted there by another prompt), and on disk only (a second engine on
   the same directory), with the restore's own copy time from the tier metrics.

Every row's greedy tokens are checked against the unlimited row's (same model, same
prompts): a tier never changes what is generated.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixserve.loadtest.harness.report import write_json
from prefixserve.loadtest.harness.stats import floor_rank

MODEL = "smollm2"


def _llm(**knobs: Any) -> Any:
    from prefixserve.replica.entrypoints.llm import LLM

    return LLM(MODEL, dtype="float32", **knobs)


def _encoder(llm: Any):
    tok = llm.engine.tokenizer

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    return encode


def conversation_prompts(encode, users: int, rounds: int, system_len: int, seed: int) -> list[list[int]]:
    from prefixserve.loadtest.workloads import MultiTurnConfig, multi_turn

    cfg = MultiTurnConfig(
        num_users=users,
        num_rounds=rounds,
        system_prompt_len=system_len,
        user_turn_len=32,
        assistant_turn_len=64,
        output_len=8,
        seed=seed,
    )
    return [encode(r.body["messages"]) for r in multi_turn(cfg)]


def run_row(name: str, prompts: list[list[int]], output_len: int, **knobs: Any) -> dict[str, Any]:
    from prefixserve.replica.sampling_params import SamplingParams

    llm = _llm(**knobs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:20]], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
    llm.engine.kv_manager.reset_prefix_cache()
    before = llm.engine.kv_manager.stats
    base_q, base_h = before.prefix_query_tokens, before.prefix_hit_tokens
    outs, ttfts = [], []
    start = time.perf_counter()
    for p in prompts:
        out = llm.generate([p], params)[0]
        outs.append(out.outputs[0].token_ids)
        ttfts.append(out.ttft_s)
        if llm.engine.tiers is not None and llm.engine.tiers.disk is not None:
            llm.engine.tiers.disk.flush()
    wall = time.perf_counter() - start
    st = llm.engine.kv_manager.stats
    queries = st.prefix_query_tokens - base_q
    device = st.prefix_hit_tokens - base_h
    host = st.tiers.host_hit_tokens - st.tiers.disk_hit_tokens
    disk = st.tiers.disk_hit_tokens
    row = {
        "name": name,
        "num_kv_blocks": llm.engine.kv_manager.num_blocks,
        "host_blocks": llm.engine.runner.num_host_blocks,
        "hit_rate": (device + host + disk) / queries,
        "device_hits": device / queries,
        "host_hits": host / queries,
        "disk_hits": disk / queries,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": floor_rank(ttfts, 99),
        "wall_s": wall,
        "token_ids": outs,
    }
    llm.shutdown()
    print(
        f"row {name}: hit rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, {wall:.0f} s",
        flush=True,
    )
    return row


def unlimited_pool_hit_rate(prompts: list[list[int]], block_size: int = 16) -> float:
    """The hit rate of ``prompts`` on the real KV manager with a pool that never evicts (lookups in
    order, no model run): what the unlimited row's engine serves, for a quick check at any size."""
    from prefixserve.replica.kv.manager import KVCacheManager

    kv = KVCacheManager(sum(-(-len(p) // block_size) for p in prompts) + 1, block_size, True)
    hit = 0
    for i, p in enumerate(prompts):
        blocks, n = kv.get_computed_blocks(p)
        assert kv.allocate_slots(str(i), p, len(p) - n, blocks) is not None
        kv.free(str(i))
        hit += n
    return hit / sum(len(p) for p in prompts)


def run_conversations(args: argparse.Namespace, encode, block_bytes: int) -> list[dict[str, Any]]:
    prompts = conversation_prompts(encode, args.users, args.rounds, args.system_len, args.seed)
    last_round = prompts[-args.users :]
    need = sum(-(-len(p) // 16) for p in last_round)
    longest = max(-(-(len(p) + args.output_len) // 16) for p in prompts)
    pool = max(longest + 1, need // args.pool_ratio)  # it must hold the longest request
    host_gib = args.pool_ratio * pool * block_bytes / 1024**3
    disk = Path(tempfile.mkdtemp(prefix="bench_tiers_"))
    common = dict(max_num_batched_tokens=2048)
    host = dict(num_kv_blocks=pool, kv_offloading_size=host_gib)
    knobs = {
        "unlimited": ("unlimited device", dict(num_kv_blocks=need * 4)),
        "off": ("tier off", dict(num_kv_blocks=pool)),
        "host": (f"host {args.pool_ratio}x pool", host),
        "disk": (f"host {args.pool_ratio}x + disk", dict(host, kv_disk_path=str(disk), kv_disk_size_gb=4.0)),
    }
    print(f"unlimited-pool hit rate (KV manager alone): {unlimited_pool_hit_rate(prompts):.1%}", flush=True)
    rows = []
    try:
        for row in args.rows.split(","):
            name, row_knobs = knobs[row]
            rows.append(run_row(name, prompts, args.output_len, **row_knobs, **common))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    # Against the first row (unlimited by default) and the tier-off row, when they ran.
    ref = rows[0]["token_ids"]
    off = next((r for r in rows if r["name"] == "tier off"), None)
    for r in rows:
        r["same_tokens_as_first_row"] = r.pop("token_ids") == ref
        r["ttft_p50_vs_off"] = r["ttft_p50_s"] / off["ttft_p50_s"] if off is not None else None
        r["hit_rate_vs_first_row_pts"] = 100 * (r["hit_rate"] - rows[0]["hit_rate"])
    meta = {
        "requests": len(prompts),
        "last_round_blocks": need,
        "device_pool_blocks": pool,
        "host_gib": host_gib,
        "unlimited_pool_hit_rate": unlimited_pool_hit_rate(prompts),
    }
    return [meta, *rows]


def _value(llm: Any, name: str, **labels: str) -> float:
    v = llm.engine.metrics.registry.get_sample_value(
        name, {"model_name": llm.engine.model_name, "engine": "0", **labels}
    )
    return float(v or 0.0)


def restore_cost(block_size: int, tokens: int, seed: int) -> dict[str, Any]:
    """TTFT of one prompt by where its blocks are, and the restore's copy time."""
    import numpy as np

    from prefixserve.replica.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(100, 40000, tokens + 1)]
    filler = [int(t) for t in rng.integers(100, 40000, tokens + 1)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    blocks = tokens // block_size
    disk = Path(tempfile.mkdtemp(prefix="bench_tiers_restore_"))
    knobs = dict(
        block_size=block_size,
        num_kv_blocks=blocks + 1,  # one prompt's blocks: the filler evicts them all
        max_num_batched_tokens=max(2048, tokens + 1),
        kv_disk_path=str(disk),
        kv_disk_size_gb=4.0,
    )
    try:
        probe = _llm(block_size=block_size, num_kv_blocks=4)
        host_gib = 4 * (blocks + 1) * probe.engine.runner.kv_bytes_per_block / 1024**3
        probe.shutdown()
        llm = _llm(kv_offloading_size=host_gib, **knobs)
        llm.generate([filler[:32]], one)  # warm-up
        t_miss = llm.generate([prompt], one)[0].ttft_s
        t_device = llm.generate([prompt], one)[0].ttft_s
        llm.generate([filler], one)  # evicts the prompt's blocks into the host tier
        copy0 = _value(llm, "prefixserve:kv_tier_copy_seconds_total", op="copy_back")
        out = llm.generate([prompt], one)[0]
        t_host, host_cached = out.ttft_s, out.num_cached_tokens
        host_copy = _value(llm, "prefixserve:kv_tier_copy_seconds_total", op="copy_back") - copy0
        llm.engine.tiers.disk.flush()
        llm.shutdown()
        second = _llm(kv_offloading_size=host_gib, **knobs)
        second.generate([filler[:32]], one)  # warm-up (its blocks are not the prompt's)
        out = second.generate([prompt], one)[0]
        t_disk, disk_cached = out.ttft_s, out.num_cached_tokens
        disk_copy = _value(second, "prefixserve:kv_tier_copy_seconds_total", op="disk_fill") + _value(
            second, "prefixserve:kv_tier_copy_seconds_total", op="copy_back"
        )
        disk_read = second.engine.tiers.disk.stats.loaded_bytes
        second.shutdown()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return {
        "block_size": block_size,
        "blocks": blocks,
        "ttft_recompute_s": t_miss,
        "ttft_device_s": t_device,
        "ttft_host_s": t_host,
        "ttft_disk_s": t_disk,
        "host_cached_tokens": host_cached,
        "disk_cached_tokens": disk_cached,
        "host_copy_s": host_copy,
        "disk_copy_s": disk_copy,
        "disk_read_bytes": disk_read,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=200, help="words of each user's system prompt")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--pool-ratio", type=int, default=4, help="last round's history blocks / device pool")
    parser.add_argument("--restore-tokens", type=int, default=1024)
    parser.add_argument("--block-sizes", default="16,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-conversations", action="store_true")
    parser.add_argument(
        "--rows",
        default="unlimited,off,host,disk",
        help="multi-turn rows to run, in order (unlimited, off, host, disk); tokens are checked against the first",
    )
    parser.add_argument("--skip-restore", action="store_true", help="no copy-back table")
    parser.add_argument("--out", default="results/bench_tiers.json")
    args = parser.parse_args(argv)

    import torch

    probe = _llm(num_kv_blocks=4)
    encode, block_bytes = _encoder(probe), probe.engine.runner.kv_bytes_per_block
    probe.shutdown()
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.python_version()}",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": MODEL,
        "block_bytes": block_bytes,
    }
    if not args.skip_conversations:
        meta, *rows = run_conversations(args, encode, block_bytes)
        result["conversations"] = {"meta": meta, "rows": rows}
        print(f"\nmulti-turn, one replica: {meta}")
        print(
            f"{'row':<20}{'hit rate':>10}{'device':>8}{'host':>8}{'disk':>8}"
            f"{'TTFT p50':>10}{'p99':>8}{'vs off':>8}  same"
        )
        for r in rows:
            print(
                f"{r['name']:<20}{r['hit_rate']:>10.1%}{r['device_hits']:>8.1%}{r['host_hits']:>8.1%}"
                f"{r['disk_hits']:>8.1%}{r['ttft_p50_s'] * 1e3:>8.0f}ms{r['ttft_p99_s'] * 1e3:>6.0f}ms"
                f"{r['ttft_p50_vs_off'] or float('nan'):>8.2f}  {r['same_tokens_as_first_row']}"
            )
    restores = (
        []
        if args.skip_restore
        else [restore_cost(int(bs), args.restore_tokens, args.seed) for bs in args.block_sizes.split(",")]
    )
    result["restore"] = restores
    print(f"\nrestoring a {args.restore_tokens}-token prompt (TTFT, ms; copy = the restore's copies alone)")
    print(
        f"{'block':>6}{'blocks':>8}{'recompute':>11}{'device':>8}{'host':>8}{'disk':>8}"
        f"{'host copy':>11}{'disk copy':>11}"
    )
    for r in restores:
        print(
            f"{r['block_size']:>6}{r['blocks']:>8}{r['ttft_recompute_s'] * 1e3:>11.0f}{r['ttft_device_s'] * 1e3:>8.0f}"
            f"{r['ttft_host_s'] * 1e3:>8.0f}{r['ttft_disk_s'] * 1e3:>8.0f}{r['host_copy_s'] * 1e3:>11.1f}"
            f"{r['disk_copy_s'] * 1e3:>11.1f}"
        )
    write_json(args.out, result, announce=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
