"""Eviction policies on one memory-bound CPU replica: prefix hit rate and req/s per policy.

Workload: Zipf tenants (``workloads.zipf_tenant_sequence``, the simulator's
sequence), each with its own system prompt of ``--system-len`` random token ids;
a request is its tenant's system prompt plus a distinct ``--question-len``-token
question, and generates ``--output-len`` tokens (greedy, min_tokens = max_tokens).
The KV pool (``--num-kv-blocks``) holds the system prompts of only a few tenants
beside the running requests, so what eviction keeps decides the hit rate.

Requests arrive in waves of ``--wave`` (one ``LLM.generate`` call each, the next
wave after the previous finished), the same sequence for every policy. Each
repeat builds one engine per policy (policies alternate, so machine noise hits
all of them alike), warms it up on a throw-away prompt, resets the prefix cache
and times the whole sequence. Reported per policy: hit rate (cached prompt
tokens / prompt tokens, from the engine's outputs; the same in every repeat since
scheduling is deterministic), req/s (median over repeats, every run beside it),
requests per CPU-second of the process (``time.process_time``: on a machine
shared with other jobs wall time varies with their load, CPU time much less),
evictions, preemptions; and hit rate, req/s and req/CPU-s relative to ``lru``.

Run: ``python -m prefixserve.loadtest.bench_eviction`` (prints a markdown table,
writes results/bench_eviction.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prefixserve.replica.kv.block_pool import EVICTION_POLICIES
from prefixserve.replica.logs import add_verbose_flag, quiet_libraries

VOCAB_LOW, VOCAB_HIGH = 100, 49_000  # SmolLM2's ordinary tokens (no specials)


def build_workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(tenant of each request, prompt token ids of each request)."""
    from prefixserve.loadtest.workloads import zipf_tenant_sequence

    tenants = zipf_tenant_sequence(args.tenants, args.requests, args.zipf_s, args.hot_share, args.seed)

    def toks(*key: object) -> list[int]:
        rng = random.Random("-".join(map(str, (args.seed, *key))))
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_len if key[0] == "s" else
                                                                      args.question_len)]

    systems = {t: toks("s", t) for t in set(tenants)}
    return tenants, [systems[t] + toks("q", i) for i, t in enumerate(tenants)]


def run_policy(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from prefixserve.replica.llm import LLM
    from prefixserve.replica.sampling import SamplingParams

    llm = LLM(args.model, eviction_policy=policy, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
              dtype=args.dtype, max_num_seqs=args.wave)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len)
    llm.generate([prompts[0][:40]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up (kernels, pages)
    kv = llm.engine.kv_manager
    assert kv.reset_prefix_cache()
    evictions0 = kv.stats.num_evictions
    preempt0 = llm.engine.scheduler.num_preemptions
    cached = total = 0
    cpu0 = time.process_time()
    start = time.perf_counter()
    for w in range(0, len(prompts), args.wave):
        wave = prompts[w : w + args.wave]
        for out in llm.generate(wave, params):
            cached += out.num_cached_tokens
        total += sum(len(p) for p in wave)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    result = {
        "policy": policy, "requests_per_s": len(prompts) / wall, "wall_s": wall,
        "requests_per_cpu_s": len(prompts) / cpu, "cpu_s": cpu,
        "hit_rate": cached / total, "evictions": kv.stats.num_evictions - evictions0,
        "preemptions": llm.engine.scheduler.num_preemptions - preempt0,
    }
    del llm
    return result


def render(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"## Eviction policies on one CPU replica ({c['model']}, {c['num_kv_blocks']} KV blocks of "
        f"{c['block_size']} tokens; {c['requests']} requests of {c['tenants']} Zipf({c['zipf_s']}) tenants, "
        f"system {c['system_len']} + question {c['question_len']} tokens, {c['output_len']} out, "
        f"waves of {c['wave']})",
        "",
        "| policy | hit rate | x lru | req/s (median) | x lru | runs req/s | req/CPU-s (median) | x lru "
        "| evictions | preemptions |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    base = res["policies"].get("lru")
    for p, r in res["policies"].items():
        hx = f"{r['hit_rate'] / base['hit_rate']:.2f}" if base and base["hit_rate"] else "-"
        rx = f"{r['requests_per_s'] / base['requests_per_s']:.2f}" if base else "-"
        cx = f"{r['requests_per_cpu_s'] / base['requests_per_cpu_s']:.2f}" if base else "-"
        runs = ", ".join(f"{x:.2f}" for x in r["runs_requests_per_s"])
        lines.append(f"| {p} | {r['hit_rate']:.3f} | {hx} | {r['requests_per_s']:.2f} | {rx} | {runs} | "
                     f"{r['requests_per_cpu_s']:.3f} | {cx} | {r['evictions']} | {r['preemptions']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixserve.loadtest.bench_eviction",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--zipf-s", type=float, default=0.8)
    ap.add_argument("--hot-share", type=float, default=0.05)
    # 8 system blocks, 5 question blocks and 1 answer block per request: the block-level shape
    # of 128 + 80 + 16 tokens at block size 16, at a quarter of the prefill cost (CPU time is
    # scarce on a shared 2-core machine; --block-size 16 with 4x the lengths is the same test).
    ap.add_argument("--system-len", type=int, default=32)
    ap.add_argument("--question-len", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=100,
                    help="the pool: a wave of running requests (~56 blocks) and ~5 system prompts")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--wave", type=int, default=4, help="requests per generate call (and max_num_seqs)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_eviction.json"))
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_libraries(args.verbose)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    policies = args.policies.split(",")
    tenants, prompts = build_workload(args)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rep in range(args.repeats):
        for p in policies:
            r = run_policy(p, prompts, args)
            print(f"repeat {rep} {p}: hit {r['hit_rate']:.3f}, {r['requests_per_s']:.2f} req/s, "
                  f"{r['requests_per_cpu_s']:.3f} req/CPU-s", file=sys.stderr, flush=True)
            runs[p].append(r)
    res: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "distinct_tenants": len(set(tenants)), "policies": {},
    }
    for p, rs in runs.items():
        rps = [r["requests_per_s"] for r in rs]
        med = sorted(rs, key=lambda r: r["requests_per_s"])[len(rs) // 2]
        res["policies"][p] = {**med, "requests_per_s": statistics.median(rps), "runs_requests_per_s": rps,
                              "requests_per_cpu_s": statistics.median(r["requests_per_cpu_s"] for r in rs),
                              "hit_rates": [r["hit_rate"] for r in rs]}
    print(render(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
