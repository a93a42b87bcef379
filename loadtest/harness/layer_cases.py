"""The layer benchmark's cases as both sides build and time them (loadtest/bench_layers.py and,
in vLLM's own venv, loadtest/peers/vllm_layer_ops.py).

Standard library and a ``torch`` handed in only: the peer loads this file by its path, with
nothing of prefixserve importable there. torch's CPU generator gives the same values for the
same seed in both venvs (torch 2.13 in each), so both sides compute on the same tensors.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def case_tensors(torch: Any, case: dict[str, Any], model: dict[str, Any], seed: int) -> dict[str, Any]:
    """A case's inputs: a linear's ``x`` and ``w``, a norm's ``x``, ``residual`` and ``weight``,
    rotary's ``q``, ``k`` and ``positions``, SiLU-and-multiply's ``gate_up``, attention's
    ``q``, ``k`` and ``v`` (every cached token's K and V, sequence after sequence)."""

    def randn(*shape: int, offset: int, scale: float = 1.0) -> Any:
        g = torch.Generator().manual_seed(seed * 1000 + offset)
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    h, heads, kvh, d = model["hidden"], model["heads"], model["kv_heads"], model["head_dim"]
    op = case["op"]
    if op == "linear":
        return {
            "x": randn(case["m"], case["k"], offset=0),
            "w": randn(case["n"], case["k"], offset=1, scale=case["k"] ** -0.5),
        }
    if op in ("rms_norm", "add_rms_norm"):
        return {
            "x": randn(case["m"], h, offset=0),
            "residual": randn(case["m"], h, offset=1),
            "weight": 1.0 + randn(h, offset=2, scale=0.1),
        }
    if op == "rotary":
        m = case["m"]
        return {
            "q": randn(m, heads, d, offset=0),
            "k": randn(m, kvh, d, offset=1),
            "positions": (torch.arange(m, dtype=torch.int64) * 7 + 100) % model["max_pos"],
        }
    if op == "silu_and_mul":
        return {"gate_up": randn(case["m"], 2 * model["inter"], offset=0)}
    if op == "attention":
        seqs, q_len, ctx = case["seqs"], case["query_len"], case["context"]
        return {
            "q": randn(seqs * q_len, heads, d, offset=0),
            "k": randn(seqs * ctx, kvh, d, offset=1),
            "v": randn(seqs * ctx, kvh, d, offset=2),
        }
    raise ValueError(f"unknown op {op!r}")


def rotary_tables(torch: Any, model: dict[str, Any]) -> tuple[Any, Any]:
    """cos and sin ``[max_pos, head_dim / 2]`` (vLLM's ``cos_sin_cache`` is the two side by side)."""
    d = model["head_dim"]
    inv_freq = 1.0 / (model["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(model["max_pos"], dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def time_call(fn: Callable[[], Any], samples: int, min_sample_s: float) -> float:
    """Median seconds of one call of ``fn`` over ``samples`` samples of at least ``min_sample_s``
    each (calls looped to fill a sample), after two untimed calls."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(min_sample_s / once))
    per_call = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        per_call.append((time.perf_counter() - start) / loops)
    return statistics.median(per_call)


def time_in_place(call: Callable[[], Any], restore: Callable[[], Any], samples: int, min_sample_s: float) -> float:
    """Seconds of one call of an operation that overwrites its inputs: each timed call first runs
    ``restore`` (the inputs copied back), which is timed alone as well and taken out."""

    def restored() -> Any:
        restore()
        return call()

    return max(0.0, time_call(restored, samples, min_sample_s) - time_call(restore, samples, min_sample_s))


def rotating(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """A call that calls each of ``calls`` in turn (they compute the same values on copies of the
    data: a weight or KV cache per layer, as a forward reads them)."""
    state = {"next": 0}

    def call() -> Any:
        i = state["next"]
        state["next"] = (i + 1) % len(calls)
        return calls[i]()

    return call
