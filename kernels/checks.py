"""Argument checks shared by the kernel implementations (torch only, no Triton).

The kernels read raw pointers with fixed strides, so a tensor of the wrong shape,
dtype, layout or device would be read as garbage rather than fail; every public
entry point checks its arguments with these first and raises ``ValueError``.
"""

from __future__ import annotations

import torch

SLOT_DTYPES = (torch.int32, torch.int64)


def check_one_device(*tensors: torch.Tensor) -> torch.device:
    """The one device all ``tensors`` are on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return next(iter(devices))


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Each tensor's rows may be strided, its last dimension must be dense."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1); call .contiguous()")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """K and V caches of one shape in the standard layout; with ``rows``, its ``(num_kv_heads, head_dim)``."""
    heads, dim = rows if rows is not None else ("num_kv_heads", "head_dim")
    if (
        key_cache.dim() != 4
        or key_cache.shape != value_cache.shape
        or (rows is not None and tuple(key_cache.shape[2:]) != rows)
    ):
        raise ValueError(
            f"key_cache and value_cache must both be [num_blocks, block_size, {heads}, "
            f"{dim}], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )


def check_cache_dtype(key_cache: torch.Tensor, value_cache: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """K and V caches of one dtype, one of ``allowed``."""
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in allowed:
        raise ValueError(
            f"key_cache and value_cache must share one dtype of {allowed}, got "
            f"{key_cache.dtype} and {value_cache.dtype}"
        )


def check_slot_mapping(slot_mapping: torch.Tensor, rows: int) -> None:
    """One dense int32/int64 cache slot per token row."""
    if slot_mapping.shape != (rows,) or slot_mapping.dtype not in SLOT_DTYPES or not slot_mapping.is_contiguous():
        raise ValueError(
            f"slot_mapping must be a contiguous int32/int64 [{rows}] tensor, got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
