"""Torch reference of the fused layer ops (:class:`prefixserve.kernels.interface.LayerOps`).

Any device, any dtype: the layer ops of the torch backend, the fallback where no fused kernel
runs, and the oracle the C and Triton layer kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.kernels.interface import LayerOps


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, like the transformers implementation."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return torch_rms_norm(total, weight, eps), total


def torch_prepare_rotary(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Gathered once per step, shared by every layer: [T, 1, D/2].
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def torch_rotary(x: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x*cos + rotate_half(x)*sin`` with the two halves of cos/sin equal (stored once)."""
    cos, sin = prepared
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_LAYER_OPS = LayerOps(
    "torch", torch_rms_norm, torch_add_rms_norm, torch_prepare_rotary, torch_rotary, torch_silu_and_mul
)
