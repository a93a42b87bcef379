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

``--workload multi_turn``: ``--users`` conversations of ``--rounds`` turns on
token ids; turn r's prompt is the user's previous prompt, the engine's actual
answer to it (its generated token ids) and a new ``--question-len`` question, so a
turn can hit the blocks its previous answer filled. Rounds go in order, users
shuffled within a round (as ``workloads.multi_turn``, whose synthetic answers
would never hit), waves of ``--wave``.

``--generated-blocks`` (comma list, each run for every policy): ``warm`` frees a
finished request's blocks in vLLM's order (the engine with
``evict_generated_first=False``); ``cold`` passes ``generated_cold=True`` to
``KVCacheManager.free`` for finished requests that are not conversation turns
(every zipf request; no multi_turn request), so their generated blocks enter the
pool's cold end: the engine's default (``evict_generated_first``), with the
benchmark knowing exactly which requests are turns (the engine infers it from
the chat messages or an X-Session-Id header); ``cold-all`` does it for every
finished request, conversation turns included (what not knowing them costs).
The benchmark wraps the scheduler's ``finish`` to decide (preempted requests
are freed as usual).

Run: ``python -m prefixserve.loadtest.bench_eviction`` (prints a markdown table,
writes results/bench_eviction.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixserve.common.logs import add_verbose_flag, quiet_libraries
from prefixserve.loadtest.harness.report import config_json, markdown_table, write_json
from prefixserve.loadtest.harness.stats import median_run
from prefixserve.replica.kv.block_pool import EVICTION_POLICIES

VOCAB_LOW, VOCAB_HIGH = 100, 49_000  # SmolLM2's ordinary tokens (no specials)


def build_workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(tenant of each request, prompt token ids of each request)."""
    from prefixserve.loadtest.workloads import zipf_tenant_sequence

    tenants = zipf_tenant_sequence(args.tenants, args.requests, args.zipf_s, args.hot_share, args.seed)

    def toks(*key: object) -> list[int]:
        rng = random.Random("-".join(map(str, (args.seed, *key))))
        return [
            rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_len if key[0] == "s" else args.question_len)
        ]

    systems = {t: toks("s", t) for t in set(tenants)}
    return tenants, [systems[t] + toks("q", i) for i, t in enumerate(tenants)]


def request_kinds(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The sequence of requests: ("z", i) is zipf prompt i, ("c", u) user u's next conversation turn.

    multi_turn: rounds in order, users shuffled within a round; mixed: the same
    turns, each followed by ``--oneshots-per-turn`` zipf requests.
    """
    if args.workload == "zipf":
        return [("z", i) for i in range(args.requests)]
    out: list[tuple[str, int]] = []
    z = 0
    for r in range(args.rounds):
        users = list(range(args.users))
        random.Random(f"{args.seed}-round-{r}").shuffle(users)
        for u in users:
            out.append(("c", u))
            if args.workload == "mixed":
                out += [("z", z + k) for k in range(args.oneshots_per_turn)]
                z += args.oneshots_per_turn
    return out


def _toks(args: argparse.Namespace, n: int, *key: object) -> list[int]:
    rng = random.Random("-".join(map(str, (args.seed, *key))))
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


GENERATED_MODES = ("warm", "cold", "cold-all")
STATIC_MODES = ("protected", "plain")


def _wire_generated_cold(llm: Any, cold: Callable[[Any], bool]) -> None:
    """Free each *finished* sequence ``seq`` with ``generated_cold=cold(seq)``.

    The scheduler's ``finish`` calls ``kv.free(seq_id)``; during that call the
    manager's ``free`` is bound with the flag. Preemptions (``_preempt``) still
    free without it: a preempted request comes back for its blocks.
    """
    sched, kv = llm.engine.scheduler, llm.engine.kv_manager
    finish = sched.finish

    def finish_cold(seq: Any) -> None:
        def free(seq_id: str, generated_cold: bool = False, static_prefix_tokens: int = 0) -> bool:
            return type(kv).free(kv, seq_id, generated_cold=cold(seq), static_prefix_tokens=static_prefix_tokens)

        kv.free = free
        try:
            finish(seq)
        finally:
            del kv.free

    sched.finish = finish_cold


def run_key(policy: str, generated: str, static: str) -> str:
    """A run's key in the results: the policy, then "+mode" unless warm, "+plain" unless protected."""
    return policy + ("" if generated == "warm" else f"+{generated}") + ("" if static == "protected" else "+plain")


def run_policy(
    policy: str, prompts: list[list[int]], args: argparse.Namespace, generated: str = "warm", static: str = "protected"
) -> dict[str, Any]:
    """One engine, the whole request sequence (``request_kinds``): zipf requests take ``prompts[i]``;
    conversation turns are built from the user's previous prompt and the engine's own answer.
    ``static``: "protected" frees each request's system prompt blocks as reused
    (EngineConfig.protect_static_prefix), "plain" as any other block."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    if generated not in GENERATED_MODES:
        raise ValueError(f"--generated-blocks: {generated!r} is not one of {GENERATED_MODES}")
    if static not in STATIC_MODES:
        raise ValueError(f"--static-prefix: {static!r} is not one of {STATIC_MODES}")
    kinds = request_kinds(args)
    history = {u: _toks(args, args.system_len, "user-system", u) for k, u in kinds if k == "c"}
    # A finished sequence is a conversation turn when it starts with a user's system prompt.
    conv_heads = {tuple(h[:8]) for h in history.values()}

    def is_turn(seq: Any) -> bool:
        return tuple(seq.token_ids[:8]) in conv_heads

    llm = LLM(
        args.model,
        eviction_policy=policy,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        dtype=args.dtype,
        max_num_seqs=args.wave,
        evict_generated_first=False,  # the bench decides
        protect_static_prefix=static == "protected",
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len)
    warm_up = prompts[0][:40] if prompts else _toks(args, 40, "warmup")
    llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=2))  # kernels, pages
    kv = llm.engine.kv_manager
    assert kv.reset_prefix_cache()
    if generated == "cold":
        _wire_generated_cold(llm, lambda seq: not is_turn(seq))
    elif generated == "cold-all":
        _wire_generated_cold(llm, lambda seq: True)
    evictions0 = kv.stats.num_evictions
    preempt0 = llm.engine.scheduler.num_preemptions
    cached = total = 0
    hit_by_kind = {"z": [0, 0], "c": [0, 0]}  # cached, prompt tokens
    turn = dict.fromkeys(history, 0)
    cpu0 = time.process_time()
    start = time.perf_counter()
    for w in range(0, len(kinds), args.wave):
        batch = kinds[w : w + args.wave]
        wave = [
            history[x] + _toks(args, args.question_len, "q", x, turn[x]) if k == "c" else prompts[x] for k, x in batch
        ]
        outs = llm.generate(wave, params, static_prefix_tokens=args.system_len)
        for (k, x), prompt, out in zip(batch, wave, outs, strict=True):
            cached += out.num_cached_tokens
            hit_by_kind[k][0] += out.num_cached_tokens
            hit_by_kind[k][1] += len(prompt)
            if k == "c":
                history[x] = prompt + list(out.outputs[0].token_ids)
                turn[x] += 1
        total += sum(len(p) for p in wave)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    result = {
        "policy": policy,
        "generated_blocks": generated,
        "static_prefix": static,
        "requests_per_s": len(kinds) / wall,
        "wall_s": wall,
        "requests_per_cpu_s": len(kinds) / cpu,
        "cpu_s": cpu,
        "num_requests": len(kinds),
        "prompt_tokens": total,
        "hit_rate": cached / total,
        "hit_rate_oneshot": hit_by_kind["z"][0] / hit_by_kind["z"][1] if hit_by_kind["z"][1] else None,
        "hit_rate_conversation": hit_by_kind["c"][0] / hit_by_kind["c"][1] if hit_by_kind["c"][1] else None,
        "evictions": kv.stats.num_evictions - evictions0,
        "preemptions": llm.engine.scheduler.num_preemptions - preempt0,
    }
    del llm
    return result


def render(res: dict[str, Any]) -> str:
    c = res["config"]
    conv = (
        f"{c['users']} conversations x {c['rounds']} turns (system {c['system_len']}, each turn "
        f"+ the previous answer + a {c['question_len']}-token question)"
    )
    zipf = (
        f"{c['requests']} requests of {c['tenants']} Zipf({c['zipf_s']}) tenants, "
        f"system {c['system_len']} + question {c['question_len']} tokens"
    )
    what = {
        "zipf": zipf,
        "multi_turn": conv,
        "mixed": f"{conv}, each turn followed by {c['oneshots_per_turn']} of the {zipf}",
    }[c["workload"]]
    what += f", {c['output_len']} out"
    lines = [
        f"## Eviction policies on one CPU replica, {c['workload']} ({c['model']}, {c['num_kv_blocks']} KV blocks "
        f"of {c['block_size']} tokens; {what}, waves of {c['wave']})",
        "",
    ]
    header = (
        "policy | generated blocks | static prefix | hit rate | x lru | x warm"
        " | one-shot / conversation hit rate | req/s (median) | x lru | runs req/s | req/CPU-s (median)"
        " | x lru | evictions | preemptions"
    )
    rows = []
    runs = res["policies"]
    for r in runs.values():
        static = r.get("static_prefix", "protected")
        base = runs.get(run_key("lru", r["generated_blocks"], static))
        warm = runs.get(run_key(r["policy"], "warm", static))
        hx = f"{r['hit_rate'] / base['hit_rate']:.2f}" if base and base["hit_rate"] else "-"
        wx = f"{r['hit_rate'] / warm['hit_rate']:.2f}" if warm and warm["hit_rate"] else "-"
        rx = f"{r['requests_per_s'] / base['requests_per_s']:.2f}" if base else "-"
        cx = f"{r['requests_per_cpu_s'] / base['requests_per_cpu_s']:.2f}" if base else "-"
        rr = ", ".join(f"{x:.2f}" for x in r["runs_requests_per_s"])
        kinds = " / ".join(
            "-" if r[k] is None else f"{r[k]:.3f}" for k in ("hit_rate_oneshot", "hit_rate_conversation")
        )
        rows.append(
            [
                r["policy"],
                r["generated_blocks"],
                static,
                f"{r['hit_rate']:.3f}",
                hx,
                wx,
                kinds,
                f"{r['requests_per_s']:.2f}",
                rx,
                rr,
                f"{r['requests_per_cpu_s']:.3f}",
                cx,
                r["evictions"],
                r["preemptions"],
            ]
        )
    lines.append(markdown_table(header, rows, "lllrrrlrrlrrrr"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_eviction", description=__doc__.splitlines()[0]
    )
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
    ap.add_argument("--question-len", type=int, default=None, help="default: zipf 20, multi_turn and mixed 12")
    ap.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="default: zipf 4 (its one answer block is never full: uncached), multi_turn and mixed 16 "
        "(3 cached answer blocks, the 4th holds the last token, whose KV is never computed)",
    )
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="the pool (default: zipf 100, a wave of running requests (~56 blocks) and ~5 system "
        "prompts; multi_turn 240, a wave of last turns (~144 blocks) and ~3 conversations; "
        "mixed 400)",
    )
    ap.add_argument(
        "--workload",
        choices=("zipf", "multi_turn", "mixed"),
        default="zipf",
        help="mixed: multi_turn's turns, each followed by --oneshots-per-turn zipf requests",
    )
    ap.add_argument("--users", type=int, default=12, help="multi_turn, mixed: conversations")
    ap.add_argument("--rounds", type=int, default=4, help="multi_turn, mixed: turns per conversation")
    ap.add_argument("--oneshots-per-turn", type=int, default=2, help="mixed: zipf requests after each turn")
    ap.add_argument(
        "--generated-blocks",
        default="warm",
        help=f"comma list of {','.join(GENERATED_MODES)} (module docstring); each runs every policy",
    )
    ap.add_argument(
        "--static-prefix",
        default="protected",
        help=f"comma list of {','.join(STATIC_MODES)}: whether each request's system prompt "
        "blocks are freed as reused (EngineConfig.protect_static_prefix); each runs every policy",
    )
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--wave", type=int, default=4, help="requests per generate call (and max_num_seqs)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_eviction.json"))
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    zipf = args.workload == "zipf"
    if args.num_kv_blocks is None:
        args.num_kv_blocks = {"zipf": 100, "multi_turn": 240, "mixed": 400}[args.workload]
    if args.question_len is None:
        args.question_len = 20 if zipf else 12
    if args.output_len is None:
        args.output_len = 4 if zipf else 16
    if args.workload == "mixed":
        args.requests = args.users * args.rounds * args.oneshots_per_turn  # the zipf prompts it needs
    modes = args.generated_blocks.split(",")
    if set(modes) - set(GENERATED_MODES):
        ap.error(f"--generated-blocks takes {','.join(GENERATED_MODES)}, got {args.generated_blocks!r}")
    statics = args.static_prefix.split(",")
    if set(statics) - set(STATIC_MODES):
        ap.error(f"--static-prefix takes {','.join(STATIC_MODES)}, got {args.static_prefix!r}")
    quiet_libraries(args.verbose)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    policies = args.policies.split(",")
    if args.workload == "multi_turn":
        tenants, prompts = [], []
    else:
        tenants, prompts = build_workload(args)  # mixed: the one-shots
    # Results are keyed "policy" (warm, protected), "policy+mode" and "...+plain".
    combos = [(p, m, st) for st in statics for m in modes for p in policies]
    runs: dict[str, list[dict[str, Any]]] = {run_key(p, m, st): [] for p, m, st in combos}
    for rep in range(args.repeats):
        for p, m, st in combos:
            r = run_policy(p, prompts, args, m, st)
            print(
                f"repeat {rep} {p} {m} {st}: hit {r['hit_rate']:.3f}, {r['requests_per_s']:.2f} req/s, "
                f"{r['requests_per_cpu_s']:.3f} req/CPU-s",
                file=sys.stderr,
                flush=True,
            )
            runs[run_key(p, m, st)].append(r)
    res: dict[str, Any] = {
        "config": config_json(args),
        "distinct_tenants": len(set(tenants)),
        "policies": {},
    }
    for p, rs in runs.items():
        rps = [r["requests_per_s"] for r in rs]
        med = median_run(rs)
        res["policies"][p] = {
            **med,
            "requests_per_s": statistics.median(rps),
            "runs_requests_per_s": rps,
            "requests_per_cpu_s": statistics.median(r["requests_per_cpu_s"] for r in rs),
            "hit_rates": [r["hit_rate"] for r in rs],
        }
    print(render(res))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
