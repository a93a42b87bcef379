"""The element-wise operations of a decoder layer, fused: residual add + RMSNorm,
rotary embedding, SiLU-and-multiply.

Three implementations share one interface (:class:`LayerOps`): torch (any device,
any dtype: the reference), the C kernels of ``kernels/cpu/layer_ops.c`` (CPU,
float32) and the Triton kernels of :mod:`prefixserve.kernels.triton_layer_ops` (CUDA,
fp16/bf16/fp32); the last two do each operation in one pass over the activations
instead of the five to eight passes of the torch chain. ``select_layer_ops`` picks one.

Semantics (every implementation):
  rms_norm(x, weight, eps)                -> rmsnorm(x) * weight
  add_rms_norm(x, residual, weight, eps)  -> (rmsnorm(x + residual) * weight, x + residual);
                                             may overwrite ``residual`` with the sum
  prepare_rotary(positions, cos, sin)     -> per-step rotary inputs (cos/sin tables
                                             [max_pos, D/2], positions [T])
  rotary(x, prepared)                     -> x [T, heads, D] rotated (half-split layout);
                                             may rotate ``x`` in place
  silu_and_mul(gate_up)                   -> silu(gate_up[:, :I]) * gate_up[:, I:]

Optional (None where an implementation does not fuse it):
  rotary_and_write_kv(qk, v, prepared, k_cache, v_cache, slot_mapping, *, k_scale, v_scale)
                                          -> rotary(qk, prepared) (in place, returned), and
                                             the rotated K heads qk[:, H:] and v stored into
                                             the paged cache as the attention backend's
                                             write_kv_cache would, in the same pass
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.kernels.layer_ops_interface import LayerOps

# --- torch (reference) ----------------------------------------------------------


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


# --- C (CPU, float32) -----------------------------------------------------------


def _dense(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the C layer ops run float32 on a CPU, got {x.dtype} on {x.device}")
    return x.contiguous()


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def c_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from prefixserve.kernels.cpu_library import load

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
    from prefixserve.kernels.cpu_library import load

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
    from prefixserve.kernels.cpu_library import load

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
    from prefixserve.kernels.cpu_library import load

    gate_up = _dense(gate_up)
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    load().silu_and_mul_f32(
        gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, torch.get_num_threads()
    )
    return out


C_LAYER_OPS = LayerOps("c", c_rms_norm, c_add_rms_norm, c_prepare_rotary, c_rotary, c_silu_and_mul)


def select_layer_ops(attention_backend: str) -> LayerOps:
    """The C ops alongside the C attention kernel (CPU, float32), the Triton ops alongside
    the Triton attention kernels (CUDA), torch otherwise."""
    if attention_backend == "cpu":
        return C_LAYER_OPS
    if attention_backend == "triton":
        # Imported lazily, as kernels/__init__.py imports the Triton attention: CPU-only
        # installs without a working Triton never import it.
        from prefixserve.kernels.triton_layer_ops import TRITON_LAYER_OPS

        return TRITON_LAYER_OPS
    return TORCH_LAYER_OPS
