"""The layer ops (:class:`prefixserve.kernels.interface.LayerOps`) on the C kernels of
``kernels/cpu/layer_ops.c``: CPU, float32, each operation one OpenMP-parallel pass over the
activations instead of the five to eight passes of the torch chain (residual add + RMSNorm,
rotary embedding, SiLU-and-multiply). No fused rotary + cache write: this backend's cache
layout is its own (:func:`prefixserve.kernels.cpu.attention.kv_cache_shape`).
"""

from __future__ import annotations

import torch

from prefixserve.kernels.cpu.library import load
from prefixserve.kernels.interface import LayerOps


def _dense(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the C layer ops run float32 on a CPU, got {x.dtype} on {x.device}")
    return x.contiguous()


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def c_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = _dense(x), _dense(weight)
    _check_norm_weight(x, weight)
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    load().add_rms_norm_f32(
        x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps, torch.get_num_threads()
    )
    return out


def c_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight = _dense(x), _dense(weight)
    _check_norm_weight(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    residual = _dense(residual)
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    load().add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out, residual


def c_prepare_rotary(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions = positions.to(torch.int64).contiguous()
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"positions outside the rotary table of {cos.shape[0]} positions")
    return positions, _dense(cos), _dense(sin)


def c_rotary(x: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates ``x`` [T, heads, D] in place; token rows may be strided, heads and dims dense."""
    positions, cos, sin = prepared
    rows, heads, head_dim = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("c_rotary needs a float32 [T, heads, D] tensor with dense heads")
    if positions.shape[0] != rows or cos.shape[1] * 2 != head_dim:
        raise ValueError(
            f"{rows} rows / head_dim {head_dim} do not match {positions.shape[0]} positions / "
            f"table width {cos.shape[1]}"
        )
    load().rotary_f32(
        x.data_ptr(),
        rows,
        x.stride(0),
        heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return x


def c_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _dense(gate_up)
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    load().silu_and_mul_f32(
        gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, torch.get_num_threads()
    )
    return out


C_LAYER_OPS = LayerOps("c", c_rms_norm, c_add_rms_norm, c_prepare_rotary, c_rotary, c_silu_and_mul)
