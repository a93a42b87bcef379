"""vLLM's CPU build on bench_structured's measurement (the peer rows of ``bench_structured``).

Run by a *vLLM* interpreter, never by ours (vLLM's CPU build replaces torch, so it lives
in a virtualenv of its own): this file imports only the standard library at module
level and vLLM inside ``main``, and never imports prefixserve.
``loadtest/bench_structured.py --vllm-python PY`` writes the job (a JSON file: the model,
the prompts' token ids, the schema, batch sizes, ``max_tokens``, repeats) and runs
``PY -I vllm_structured.py JOB``; one JSON object comes back on the last line of stdout.

The measurement is bench_structured's: per batch size, pairs of runs over the same
prompts, greedy, exactly ``max_tokens`` tokens per request: unconstrained with
``ignore_eos``, constrained by ``StructuredOutputsParams(json=schema)`` (vLLM's
xgrammar backend) with a schema that cannot complete within them. The engine is
``LLMEngine`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
stepped here; each step is timed, and a step counts as a decode step when every request
of the batch got a token in it and had one before. A run's TPOT is the median of its
decode steps; the ratio of a pair is constrained / unconstrained, and the median ratio
over the pairs is reported.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def timed_run(engine, prompts: list[list[int]], params, tag: str) -> tuple[list[float], list[int]]:
    """Step ``engine`` over ``prompts``; the decode steps' seconds and each request's token count."""
    counts = {f"{tag}-{i}": 0 for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    steps: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        grew = set()
        for out in outputs:
            n = len(out.outputs[0].token_ids)  # cumulative output
            if n > counts[out.request_id]:
                if counts[out.request_id] > 0:
                    grew.add(out.request_id)
                counts[out.request_id] = n
        if len(grew) == len(prompts):
            steps.append(elapsed)
    return steps, [counts[f"{tag}-{i}"] for i in range(len(prompts))]


def main(job_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with open(job_path) as f:
        job = json.load(f)
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    args = EngineArgs(
        model=job["model"],
        tokenizer=job.get("tokenizer") or None,
        dtype="float32",
        max_model_len=job["max_model_len"],
        max_num_seqs=max(job["batch_sizes"]),
        enable_prefix_caching=False,
        # An explicit KV size: the default (a fraction of the NUMA node's memory) is refused when
        # other processes hold some of it.
        kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        structured_outputs_config={"backend": "xgrammar"},
        seed=0,
    )
    engine = LLMEngine.from_engine_args(args)
    start_s = time.perf_counter() - started
    max_tokens = job["max_tokens"]
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=job["schema"])
    )
    prompts = job["prompts"]
    # Warm-up: its first run after start is 2-3x slower, and the grammar compiles here.
    for params in (free, constrained):
        timed_run(engine, prompts[: max(job["batch_sizes"])], params, f"warm{id(params)}")
    rows = []
    for batch in job["batch_sizes"]:
        pairs = []
        for r in range(job["repeats"]):
            f_steps, f_counts = timed_run(engine, prompts[:batch], free, f"free{batch}-{r}")
            c_steps, c_counts = timed_run(engine, prompts[:batch], constrained, f"json{batch}-{r}")
            if any(n != max_tokens for n in f_counts + c_counts):
                raise RuntimeError(f"a request did not generate {max_tokens} tokens: {f_counts} / {c_counts}")
            if not f_steps or not c_steps:
                raise RuntimeError("no step decoded the whole batch")
            pairs.append((statistics.median(f_steps), statistics.median(c_steps)))
        ratios = [c / f for f, c in pairs]
        rows.append(
            {
                "batch": batch,
                "tpot_free_ms": 1e3 * statistics.median(f for f, _ in pairs),
                "tpot_constrained_ms": 1e3 * statistics.median(c for _, c in pairs),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
            }
        )
    from importlib import metadata

    import torch

    print(
        json.dumps(
            {
                "vllm_version": vllm.__version__,
                "torch_version": torch.__version__,
                "xgrammar_version": metadata.version("xgrammar"),
                "python": sys.version.split()[0],
                "start_s": start_s,
                "tpot": rows,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
