"""Attention kernels over paged KV, and the dispatch the model calls.

``select_backend("auto", device, dtype)`` gives the Triton kernels on a CUDA device;
on a CPU, the C kernel (:mod:`prefixserve.kernels.cpu_attention`) for float32 when a C compiler
is there to build it, else the torch reference. ``"triton"``, ``"cpu"`` or
``"torch"`` forces one. All backends share the signatures documented in
:mod:`prefixserve.kernels.reference`; each names the KV cache layout it reads.

This package knows nothing of requests, schedulers or replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixserve.kernels import reference

BACKENDS = ("auto", "triton", "cpu", "torch")
log = logging.getLogger(__name__)

# (num_blocks, block_size, num_kv_heads, head_dim) -> (key cache shape, value cache shape)
CacheShapeFn = Callable[[int, int, int, int], tuple[tuple[int, ...], tuple[int, ...]]]


def standard_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V (torch and Triton)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape


@dataclass(frozen=True)
class AttentionBackend:
    """The two operations the model needs, bound to one implementation, and the
    layout of the per-layer K/V caches they read and write (blocks always lead)."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]
    kv_cache_shape: CacheShapeFn = standard_cache_shape


def select_backend(
    name: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """Return the attention backend for ``device`` and ``dtype`` (``name`` in :data:`BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif device.type == "cpu" and dtype == torch.float32:
            from prefixserve.kernels import cpu_attention

            ok, why = cpu_attention.available()
            if not ok:
                log.warning("CPU attention kernel unavailable, using the slower torch reference: %s", why)
            name = "cpu" if ok else "torch"
        else:
            name = "torch"
    if name == "torch":
        return AttentionBackend("torch", reference.paged_attention, reference.write_kv_cache)
    if name == "cpu":
        from prefixserve.kernels import cpu_attention

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the 'cpu' attention backend runs float32 on a CPU, not {dtype} on {device}")
        cpu_attention.load()  # raises CPUKernelUnavailable with the compiler's message
        return AttentionBackend(
            "cpu", cpu_attention.paged_attention, cpu_attention.write_kv_cache, cpu_attention.kv_cache_shape
        )
    # Imported lazily: on CPU-only machines Triton is only used under TRITON_INTERPRET.
    from prefixserve.kernels.cache_write import write_kv_cache
    from prefixserve.kernels.paged_attention import paged_attention

    return AttentionBackend("triton", paged_attention, write_kv_cache)
