"""vLLM's CPU build on the host-overhead benchmark's decode steps (loadtest/bench_host.py).

Runs from vLLM's own virtualenv (``python -I``: nothing of ours on ``sys.path``), so it
imports nothing from prefixserve. It reads the checkpoint folder and the prompts (token
ids, one list per batch size) that bench_host wrote, and for each batch size queues that
many greedy requests, steps until each has its first token (the prefill), runs the
warm-up steps, then times ``--steps`` decode steps of ``LLMEngine.step()`` one by one.
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one
``step()`` is one scheduler step, forward, sampling and output processing, as ours is.
Prints one JSON line: per batch size, each timed step's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="checkpoint folder (config, safetensors, tokenizer)")
    ap.add_argument("--prompts", required=True, help='JSON: {"<batch>": [[token ids], ...], ...}')
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with open(args.prompts) as f:
        batches = {int(k): v for k, v in json.load(f).items()}
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    biggest = max(batches)
    prompt_len = max(len(p) for ps in batches.values() for p in ps)
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        seed=0,
        max_model_len=args.max_model_len,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(2048, biggest * prompt_len),
    )
    startup_s = time.perf_counter() - started
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 4, ignore_eos=True)
    out: dict[str, object] = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "startup_s": startup_s,
        "steps": {},
    }
    for batch, prompts in sorted(batches.items()):
        ids = [f"b{batch}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, params)
        started_ids: set[str] = set()
        while len(started_ids) < len(ids):  # the prefill: every request has its first token
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    started_ids.add(o.request_id)
        for _ in range(args.warmup):
            engine.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        out["steps"][str(batch)] = times  # type: ignore[index]
        print(f"vllm batch {batch}: done", file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":  # LLM() may spawn processes that re-import this file
    sys.exit(main())
