"""Structured-output benchmark: time per output token, constrained (json_schema) / unconstrained,
at batch 1, 16 and 64, and grammar compile time (first and cached), on SmolLM2.

Both runs of a batch size generate exactly ``--max-tokens`` tokens per request from the same
prompts, greedy: unconstrained with ``ignore_eos``, constrained by a schema (an array of
at least 1,000 small objects) that cannot complete within them, so the batch stays full
and both sides decode the same number of steps at the same batch size. Time per output
token is each request's decode time ((e2e - TTFT) / (tokens - 1)), averaged; each pair
runs ``--repeats`` times, alternating, and the median ratio is reported.

Compile: a fresh ``GrammarCache`` over the engine's backend compiles the schema (first),
then answers it again (cached); plus the one-off cost of building the backend (xgrammar's
tokenizer info).

Run: ``python -m prefixserve.loadtest.bench_structured`` (prints markdown tables, writes
results/bench_structured.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarCache
from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend

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


def tpot(outputs: list) -> float:
    """Mean per-request decode time per output token (seconds)."""
    per = [(o.e2e_s - o.ttft_s) / (len(o.outputs[0].token_ids) - 1) for o in outputs]
    return statistics.fmean(per)


def run_pair(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    a = llm.generate(prompts, free)
    b = llm.generate(prompts, constrained)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in a + b)
    return tpot(a), tpot(b)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench_structured.json")
    args = parser.parse_args()
    llm = LLM("smollm2", max_num_seqs=max(args.batch_sizes), max_model_len=1024)
    prompts = [llm.engine.encode_chat(chat(i)) for i in range(max(args.batch_sizes))]
    run_pair(llm, prompts[:2], 4)  # warm-up: kernels built, grammar compiled
    rows = []
    for batch in args.batch_sizes:
        pairs = [run_pair(llm, prompts[:batch], args.max_tokens) for _ in range(args.repeats)]
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
    compiled = compile_times(llm)
    llm.shutdown()
    versions = {p: metadata.version(p) for p in ("torch", "xgrammar", "transformers")}
    result = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{len(__import__('os').sched_getaffinity(0))} cores",
        "python": platform.python_version(),
        "versions": versions,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "tpot": rows,
        "compile": compiled,
    }
    print("| batch | TPOT unconstrained (ms) | TPOT json_schema (ms) | ratio (median) | ratios |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['tpot_free_ms']:.1f} | {r['tpot_constrained_ms']:.1f} | {r['ratio']:.3f} | "
            + ", ".join(f"{x:.3f}" for x in r["ratios"])
            + " |"
        )
    print()
    print("| grammar compile | seconds |")
    print("|---|---:|")
    for k, v in compiled.items():
        print(f"| {k} | {v:.4f} |")
    print(json.dumps({"versions": versions, "machine": result["machine"]}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
