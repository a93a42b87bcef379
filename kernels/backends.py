"""Kernels over paged KV, and the one dispatch the model calls.

``select_backend("auto", device, dtype)`` gives the Triton backend (:mod:`prefixserve.kernels.triton`)
on a CUDA device; on a CPU, the C backend (:mod:`prefixserve.kernels.cpu`) for float32 when a C
compiler is there to build it, else the torch reference. ``"triton"``, ``"cpu"`` or ``"torch"``
forces one. Each backend (:class:`KernelBackend`, the interface in :mod:`prefixserve.kernels.interface`)
carries its attention operations, the KV cache layout they read and its fused layer ops.

The kernels know nothing of requests, schedulers or replicas.
"""

from __future__ import annotations

import logging

import torch

from prefixserve.kernels import reference
from prefixserve.kernels.interface import KernelBackend, LayerOps, standard_cache_shape
from prefixserve.kernels.reference_layer_ops import TORCH_LAYER_OPS

__all__ = ["BACKENDS", "KernelBackend", "LayerOps", "select_backend"]

BACKENDS = ("auto", "triton", "cpu", "torch")
log = logging.getLogger(__name__)


def select_backend(
    name: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> KernelBackend:
    """Return the kernel backend for ``device`` and ``dtype`` (``name`` in :data:`BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif device.type == "cpu" and dtype == torch.float32:
            from prefixserve.kernels.cpu import library

            ok, why = library.available()
            if not ok:
                log.warning("CPU attention kernel unavailable, using the slower torch reference: %s", why)
            name = "cpu" if ok else "torch"
        else:
            name = "torch"
    if name == "torch":
        return KernelBackend(
            "torch", reference.paged_attention, reference.write_kv_cache, standard_cache_shape, TORCH_LAYER_OPS
        )
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the 'cpu' attention backend runs float32 on a CPU, not {dtype} on {device}")
        from prefixserve.kernels.cpu import attention, library
        from prefixserve.kernels.cpu.layer_ops import C_LAYER_OPS

        library.load()  # raises CPUKernelUnavailable with the compiler's message
        return KernelBackend(
            "cpu", attention.paged_attention, attention.write_kv_cache, attention.kv_cache_shape, C_LAYER_OPS
        )
    # Imported lazily: on CPU-only machines Triton is only used under TRITON_INTERPRET.
    from prefixserve.kernels.triton.cache_write import write_kv_cache
    from prefixserve.kernels.triton.layer_ops import TRITON_LAYER_OPS
    from prefixserve.kernels.triton.paged_attention import paged_attention

    return KernelBackend("triton", paged_attention, write_kv_cache, standard_cache_shape, TRITON_LAYER_OPS)
