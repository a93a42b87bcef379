"""A linear layer's ``x W^T + b`` at decode batches on the C kernel of ``kernels/cpu/small_gemm.c``.

For one to :data:`SMALL_GEMM_MAX_ROWS` rows, float32 on a CPU, with W as the model stores it
(``[out, in]``, contiguous; no packed copy). Measured against MKL's packed GEMM on SmolLM2's
five linears in docs/benchmarks/layers.md: faster at every one of those shapes up to eight rows,
not beyond, where the engine keeps MKL.
"""

from __future__ import annotations

import torch

from prefixserve.kernels.cpu.library import load

SMALL_GEMM_MAX_ROWS = 8


def small_gemm_fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be streamed by the kernel as it is: a contiguous float32 CPU matrix."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
    )


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """ValueError for what the kernel cannot take; the bias made contiguous."""
    if not small_gemm_fits(weight):
        raise ValueError(f"the C small GEMM takes a contiguous float32 CPU weight, got {weight.dtype} {weight.layout}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the C small GEMM takes a 2-D float32 CPU input, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= SMALL_GEMM_MAX_ROWS:
        raise ValueError(f"the C small GEMM takes 1 to {SMALL_GEMM_MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"input of {k} features does not match a weight of {weight.shape[1]}")
    if bias is None:
        return None
    if bias.shape != (n,) or bias.dtype != torch.float32:
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not match {n} float32 outputs")
    return bias.contiguous()


def c_small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for ``x`` of 1 to :data:`SMALL_GEMM_MAX_ROWS` rows; ValueError for other inputs."""
    bias = _check_inputs(x, weight, bias)
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    load().small_gemm_f32(
        x.data_ptr(),
        m,
        weight.data_ptr(),
        n,
        k,
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def c_small_linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP's fused gate/up projection and its SwiGLU in one pass: ``silu(g) * u`` where
    ``[g | u] = x W^T (+ bias)`` and W stacks the gate rows over the up rows. Equal, bit for
    bit, to :func:`c_small_linear` followed by ``c_silu_and_mul``, without writing the
    ``[rows, 2 * inter]`` projection out; same inputs and errors as :func:`c_small_linear`, and
    W's row count must be even."""
    bias = _check_inputs(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight stacks two equal halves, got {weight.shape[0]} rows")
    x = x.contiguous()
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty((m, inter), dtype=torch.float32)
    load().small_gemm_silu_mul_f32(
        x.data_ptr(),
        m,
        weight.data_ptr(),
        inter,
        k,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
