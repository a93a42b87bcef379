"""vLLM's CPU kernels on the layer benchmark's cases (loadtest/bench_layers.py), called directly.

Runs from vLLM's own virtualenv (``python -I``: nothing of ours on ``sys.path``), so it imports
nothing from prefixserve; it loads loadtest/harness/layer_cases.py by its path (standard library
and torch only), the code that builds a case's tensors and times a call on both sides. What each
case calls is what vLLM 0.32's CPU model runs for that layer:

* linear: ``dispatch_cpu_unquantized_gemm`` on the weight (vLLM's own choice per shape:
  sgl-kernel's packed GEMM for small weights, else a cached oneDNN matmul primitive,
  ``create_onednn_mm(w.t(), 32)`` + ``onednn_mm``), then ``layer.cpu_linear``;
* attention: ``cpu_attn_reshape_and_cache`` into vLLM's cache layout, then
  ``cpu_attention_with_kv_cache`` with the step's scheduler metadata (built once a step, so
  outside the timed call), at vLLM's CPU block size;
* rms_norm / add_rms_norm / rotary: ``torch.ops._C.rms_norm``, ``fused_add_rms_norm``,
  ``rotary_embedding`` (neox style, as Llama); silu_and_mul: vLLM's CPU forward is torch's
  ``F.silu(x[:, :d]) * x[:, d:]`` (no C kernel on x86).

The script re-executes itself in the environment vLLM's CPU platform gives its model workers
(``platforms/cpu.py``, ``utils/ompmultiprocessing.py``): torch's libgomp in ``LD_PRELOAD`` (else
vLLM's kernels and torch's run two OpenMP runtimes whose threads spin against each other: a
call of a few microseconds took 5-8 ms here), ``OMP_NUM_THREADS`` and ``GOMP_CPU_AFFINITY`` over
every core. vLLM's model runs these under torch.compile, which may fuse the element-wise ones; this times
the kernels as called, not the compiled graph. Job: JSON (see bench_layers.vllm_job); prints one
JSON line: per case id, the seconds a call and what was called; each case's output is saved
to ``out_dir/<index>.pt`` for the benchmark to compare with its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys


def load_cases():
    """loadtest/harness/layer_cases.py, by its path: what both sides build and time alike."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness", "layer_cases.py")
    spec = importlib.util.spec_from_file_location("layer_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_env() -> dict[str, str] | None:
    """The environment of vLLM's CPU model worker, or None when this process already runs in it."""
    import glob
    import importlib.util

    if "libgomp" in os.environ.get("LD_PRELOAD", ""):
        return None
    spec = importlib.util.find_spec("torch")
    torch_dir = os.path.dirname(spec.origin) if spec and spec.origin else ""
    gomp = sorted(glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*")))
    if not gomp:
        return None
    cores = [str(c) for c in sorted(os.sched_getaffinity(0))]
    preload = ":".join(p for p in (os.environ.get("LD_PRELOAD", ""), gomp[0]) if p)
    return {
        **os.environ,
        "LD_PRELOAD": preload,
        "OMP_NUM_THREADS": str(len(cores)),
        "GOMP_CPU_AFFINITY": " ".join(cores),
    }


def attention_call(torch, ops, case: dict, t: dict, model: dict, block: int, isa: str):
    """vLLM's CPU attention over the case's K/V written into a cache of its own layout."""
    seqs, q_len, ctx = case["seqs"], case["query_len"], case["context"]
    heads, kvh, d = model["heads"], model["kv_heads"], model["head_dim"]
    blocks_per_seq = -(-ctx // block)
    cache = torch.zeros(seqs * blocks_per_seq + 1, kvh, block, 2 * d)  # block 0: vLLM's null block
    view = cache.view(cache.shape[0], kvh, block * 2, d)
    key_cache, value_cache = view.chunk(2, dim=2)
    tables = (1 + torch.arange(seqs * blocks_per_seq, dtype=torch.int32)).view(seqs, blocks_per_seq)
    slots = torch.cat(
        [(tables[s].to(torch.int64)[:, None] * block + torch.arange(block)).flatten()[:ctx] for s in range(seqs)]
    )
    ops.cpu_attn_reshape_and_cache(t["k"], t["v"], key_cache, value_cache, slots, isa)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    starts = torch.arange(0, (seqs + 1) * q_len, q_len, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seqs,
        num_heads=heads,
        num_kv_heads=kvh,
        head_dim=d,
        seq_lens=lens,
        dtype=torch.float32,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=True,
    )
    q = t["q"]
    out = torch.empty_like(q)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=starts,
            seq_lens=lens,
            scale=d**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=tables,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )
        return out

    return call


def main() -> int:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env = worker_env()
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-I", os.path.abspath(__file__), *sys.argv[1:]], env)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch
    import vllm
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cases = load_cases()
    case_tensors, rotating, time_call = cases.case_tensors, cases.rotating, cases.time_call
    model, seed, block = job["model"], job["seed"], job["block_size"]
    samples, min_s = job["samples"], job["min_sample_s"]
    cos, sin = cases.rotary_tables(torch, model)
    cos_sin = torch.cat([cos, sin], dim=-1).contiguous()
    d, eps = model["head_dim"], model["eps"]
    results: dict[str, dict] = {}
    for index, case in enumerate(job["cases"]):
        t = case_tensors(torch, case, model, seed + index)
        op = case["op"]
        copies = job["copies"][index]
        if op == "linear":
            x, calls = t["x"], []
            for c in range(copies):
                layer = torch.nn.Module()
                layer.weight = torch.nn.Parameter(t["w"] if c == 0 else t["w"].clone(), requires_grad=False)
                layer.bias = None
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
                calls.append(lambda layer=layer, x=x: layer.cpu_linear(x, layer.weight, None))
            names = layer.cpu_linear.__code__.co_names  # the op the dispatcher's closure calls
            kinds = ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")
            impl = next((n for n in kinds if n in names), "F.linear")
            fn = rotating(calls)

        elif op == "rms_norm":
            x, w = t["x"], t["weight"]
            impl = "torch.ops._C.rms_norm"

            def fn(x=x, w=w):
                out = torch.empty_like(x)
                ops.rms_norm(out, x, w, eps)
                return out

        elif op == "add_rms_norm":
            x0, r0, w = t["x"], t["residual"], t["weight"]
            impl = "torch.ops._C.fused_add_rms_norm"
            bufs = (x0.clone(), r0.clone())  # in place on both inputs: restored before each call

            def restore(x0=x0, r0=r0, bufs=bufs):
                bufs[0].copy_(x0)
                bufs[1].copy_(r0)

            def fn(w=w, bufs=bufs):
                ops.fused_add_rms_norm(bufs[0], bufs[1], w, eps)
                return bufs[0]

        elif op == "rotary":
            # As vLLM's model passes them: [tokens, heads * head_dim] (a 3-D view rotates wrongly).
            q0, k0, pos = t["q"].flatten(1), t["k"].flatten(1), t["positions"]
            impl = "torch.ops._C.rotary_embedding (neox)"
            bufs = (q0.clone(), k0.clone())  # rotated in place: restored before each call

            def restore(q0=q0, k0=k0, bufs=bufs):
                bufs[0].copy_(q0)
                bufs[1].copy_(k0)

            def fn(pos=pos, bufs=bufs):
                ops.rotary_embedding(pos, bufs[0], bufs[1], d, cos_sin, True)
                return bufs[0]

        elif op == "silu_and_mul":
            x = t["gate_up"]
            impl = "F.silu(x[:, :d]) * x[:, d:] (vLLM's CPU forward)"
            half = x.shape[-1] // 2

            def fn(x=x, half=half):
                return torch.nn.functional.silu(x[:, :half]) * x[:, half:]

        elif op == "attention":
            isa = _get_attn_isa(torch.float32, block, d, "auto")
            impl = f"cpu_attention_with_kv_cache (isa {isa}, block {block})"
            fn = rotating([attention_call(torch, ops, case, t, model, block, isa) for _ in range(copies)])

        else:
            raise ValueError(f"unknown op {op!r}")
        if op in ("add_rms_norm", "rotary"):
            seconds = cases.time_in_place(fn, restore, samples, min_s)
            restore()
        else:
            seconds = time_call(fn, samples, min_s)
        torch.save(fn().clone(), os.path.join(job["out_dir"], f"{index}.pt"))
        results[case["id"]] = {"seconds": seconds, "impl": impl}
    print(
        json.dumps(
            {
                "vllm_version": vllm.__version__,
                "torch_version": torch.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
