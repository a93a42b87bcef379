"""The interface every kernel backend fills: what the model calls, bound to one implementation.

A :class:`KernelBackend` carries the two paged-attention operations, the layout of the KV cache they
read and write, and the :class:`LayerOps` that run beside them. The implementations (the torch
reference in ``reference.py`` and ``reference_layer_ops.py``, the C kernels in ``cpu/``, the Triton
kernels in ``triton/``) import this module; the dispatcher (``kernels/__init__.py``,
``select_backend``) imports them: no implementation imports the dispatcher.

Attention (the signatures and layouts of :mod:`prefixserve.kernels.reference`):
  paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                  *, scale, sliding_window, k_scale, v_scale, out)  -> [num_tokens, num_heads, head_dim]
  write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale, v_scale)
  kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)   -> (key cache shape, value cache shape),
                                                                      blocks always leading

Layer ops, the element-wise operations of a decoder layer, fused (every implementation):
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (num_blocks, block_size, num_kv_heads, head_dim) -> (key cache shape, value cache shape)
CacheShapeFn = Callable[[int, int, int, int], tuple[tuple[int, ...], tuple[int, ...]]]


def standard_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V (torch and Triton)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape


@dataclass(frozen=True)
class LayerOps:
    """One implementation of the fused layer ops (semantics in this module's docstring)."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    prepare_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    rotary: Callable[[torch.Tensor, Any], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # Rotary + KV-cache write in one kernel; only for the standard cache layout
    # [num_blocks, block_size, num_kv_heads, head_dim] (torch and Triton backends).
    rotary_and_write_kv: Callable[..., torch.Tensor] | None = None


@dataclass(frozen=True)
class KernelBackend:
    """Everything the model runs on one implementation: the attention operations, the layout of
    the per-layer K/V caches they read and write (blocks always lead), and the layer ops."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]
    kv_cache_shape: CacheShapeFn
    layer_ops: LayerOps
