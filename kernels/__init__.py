"""Attention kernels over paged KV, and the dispatch the model calls.

``select_backend("auto", device)`` gives the Triton kernels on a CUDA device and the
torch reference elsewhere; ``"triton"`` or ``"torch"`` forces one. Both backends
share the signatures documented in :mod:`kernels.reference`.

This package knows nothing of requests, schedulers or replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class AttentionBackend:
    """The two operations the model needs, bound to one implementation."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]


def select_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Return the attention backend for ``device`` (``name`` in :data:`BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return AttentionBackend("torch", reference.paged_attention, reference.write_kv_cache)
    # Imported lazily: on CPU-only machines Triton is only used under TRITON_INTERPRET.
    from kernels.cache_write import write_kv_cache
    from kernels.paged_attention import paged_attention

    return AttentionBackend("triton", paged_attention, write_kv_cache)
