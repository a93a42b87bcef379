"""LoRA decode throughput: a batch mixing adapters against the base model alone.

``python -m prefixserve.loadtest.bench_lora`` writes ``--adapters`` random LoRA adapters for
SmolLM2 with peft (PEFT's format, as a training run leaves it: rank ``--rank`` on every
projection, q/k/v/o/gate/up/down) and times the engine's decode steps over one batch of
``--batch`` sequences (64-token prompts, greedy, ``ignore_eos``), three ways:

* **base**: an engine without LoRA (``enable_lora`` off), every sequence on the base model;
* **base, LoRA on**: the engine with ``max_loras`` = ``--adapters`` slots, every sequence on
  the base model (what the slots cost when no request uses them);
* **mixed**: the same engine, the batch spread evenly over the adapters (each step applies
  every adapter: the segmented LoRA matmul, torch on CPU, Triton on CUDA).

Each way ``--repeats`` times, alternated; the figure is the median decode tokens/s of mixed
against base. Writes a markdown table and results/bench_lora.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from prefixserve.common.logs import add_verbose_flag
from prefixserve.loadtest.harness.cli import alternated, plan_and_run
from prefixserve.loadtest.harness.report import config_json, fmt, markdown_table, write_json
from prefixserve.loadtest.harness.stats import ratio

WAYS = ("base", "base, LoRA on", "mixed")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_folder(model: str) -> Path:
    """The Hugging Face folder of ``model`` (a GGUF is converted once into the checkpoint cache)."""
    from prefixserve.replica.model.loader import prepare, resolve

    return prepare(resolve(model)).folder


def write_adapters(model: str, out: Path, count: int, rank: int, seed: int) -> list[str]:
    """``count`` random adapters of ``model`` written by peft into ``out``; their directories."""
    # peft and transformers' Auto classes first: the checkpoint's conversion (hf_folder) loads its
    # tokenizer on a background thread, and transformers' lazy module refuses a name another
    # thread is importing.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = hf_folder(model)
    paths = []
    for i in range(count):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, lora_dropout=0.0, init_lora_weights=False
        )
        path = out / f"adapter-{i}"
        get_peft_model(model, config).save_pretrained(path)
        paths.append(str(path))
    return paths


def decode_tokens_per_s(engine: Any, prompts: list[list[int]], loras: list[Any], steps: int) -> float:
    """Decode tokens/s of one batch: its prefills first, then ``steps`` timed steps."""
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_request=lora)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # the prefills (chunked over a few steps when the batch is large)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * steps / elapsed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_lora",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="'smollm2' or a checkpoint directory / .gguf file")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each way, alternated")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    add_verbose_flag(p)
    return p


def plan(args: argparse.Namespace) -> None:
    for name in ("adapters", "rank", "batch", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.batch % args.adapters:
        raise ValueError("--batch must be a multiple of --adapters (an even mix)")


def run(args: argparse.Namespace, _: None) -> int:
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.core import LLMEngine
    from prefixserve.replica.lora.request import LoRARequest

    started = time.perf_counter()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(args.batch)]
    common = {"model": args.model, "device": args.device, "enable_prefix_caching": False, "dtype": "float32"}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        paths = write_adapters(args.model, Path(tmp), args.adapters, args.rank, args.seed)
        adapters = [LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(paths)]
        mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
        plain = LLMEngine(EngineConfig(**common))
        lora = LLMEngine(EngineConfig(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank))
        runs: dict[str, list[float]] = {way: [] for way in WAYS}
        cases = {
            "base": (plain, [None] * args.batch),
            "base, LoRA on": (lora, [None] * args.batch),
            "mixed": (lora, mixed),
        }
        for engine, loras in cases.values():  # warm-up: first-use costs out of the timed runs
            decode_tokens_per_s(engine, prompts[:2], loras[:2], 2)
        for _, way in tqdm(alternated(WAYS, args.repeats), desc="runs", unit="run", file=sys.stderr):
            engine, loras = cases[way]
            runs[way].append(decode_tokens_per_s(engine, prompts, loras, args.steps))
        plain.shutdown()
        lora.shutdown()
    medians = {way: statistics.median(v) for way, v in runs.items()}
    figure = ratio(medians["mixed"], medians["base"])
    print(
        f"\n## LoRA decode: batch {args.batch}, {args.adapters} adapters of rank {args.rank}, "
        f"{args.steps} steps, model {Path(args.model).name}\n"
    )
    rows = [[way, ", ".join(f"{v:.1f}" for v in runs[way]), f"{medians[way]:.1f}"] for way in WAYS]
    print(markdown_table(["way", "decode tokens/s per run", "median"], rows))
    print(f"\nmixed / base: {fmt(figure, '.3f')} (target >= 0.8)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config_json(args),
        "runs": runs,
        "medians": medians,
        "mixed_vs_base": figure,
        "wall_s": time.perf_counter() - started,
    }
    path = write_json(args.out_dir / "bench_lora.json", payload, announce=False)
    print(f"\nwrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return plan_and_run(build_parser(), plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
