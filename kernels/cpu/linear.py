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


def c_small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for ``x`` of 1 to :data:`SMALL_GEMM_MAX_ROWS` rows; ValueError for other inputs."""
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
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != torch.float32:
            raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not match {n} float32 outputs")
        bias = bias.contiguous()
    x = x.contiguous()
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
