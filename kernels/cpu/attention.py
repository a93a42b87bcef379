"""Paged attention for CPUs: a small C kernel (kernels/cpu/paged_attention.c), built at
first use and called through ctypes.

Why not the torch reference on CPU: it gathers each sequence's blocks into a fresh
tensor and calls SDPA once per sequence and layer; at decode time that is ~0.3 ms
of copies and dispatch for ~1 MFLOP of work. The C kernel reads blocks in place,
runs every sequence of a step in one OpenMP-parallel call, and keeps the query
heads of a KV head together (GQA) so each K/V row is loaded once for all of them.
Decoding sequences that share leading blocks (one system prompt, many requests)
are scored against the shared keys together, cascade style.

The kernel wants its own cache layout (``kv_cache_shape``): keys transposed within
a block, ``[num_blocks, num_kv_heads, head_dim, block_size]``, so that the scores
of 16 keys are plain vector FMAs; values ``[num_blocks, num_kv_heads, block_size,
head_dim]``. Blocks stay the leading dimension, so block copies (copy-on-write)
work on it unchanged. float32 activations only (other dtypes use the torch
reference); the cache is float32 or fp8 e4m3 (``kv_cache_dtype="fp8"``): the write
quantizes ``x / scale`` exactly as :func:`prefixserve.kernels.reference.quantize_fp8`
does, and attention converts fp8 rows to float32 as it reads them, K's scale folded
into the query's, V's into the output.

The library is built and loaded by :mod:`prefixserve.kernels.cpu.library`.
"""

from __future__ import annotations

import torch

from prefixserve.kernels.cpu.library import load
from prefixserve.kernels.reference import FP8_DTYPES

MAX_TILE_ROWS = 48  # must equal the C constant: a KV head's group of query heads fits one task
MAX_HEAD_DIM = 512


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the key and value caches of one layer in this kernel's layout."""
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype | tuple[torch.dtype, ...]) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
        kinds = " or ".join(map(str, dtypes))
        raise ValueError(
            f"{name} must be a contiguous CPU {kinds} tensor, got {t.dtype} on {t.device} "
            f"(contiguous={t.is_contiguous()})"
        )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new tokens' K/V (``[T, KVH, D]``) into their slots; negative slots are skipped.

    Into an fp8 cache each element is ``x / scale`` rounded to nearest even and saturated
    to +-448 (bit for bit the torch reference's quantization).
    """
    fp8 = _cache_is_fp8(key_cache, value_cache, k_scale, v_scale)
    num_blocks, num_kv_heads, head_dim, block_size = key_cache.shape
    # Token rows may be strided (views into the fused qkv output); heads and dims must be dense.
    key, value = _rows_dense(key), _rows_dense(value)
    slots = slot_mapping.to(torch.int64).contiguous()
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        _check(t, name, (torch.float32, *FP8_DTYPES))
    if key.dtype != torch.float32 or value.dtype != torch.float32:
        raise ValueError(f"key/value must be float32, got {key.dtype}/{value.dtype}")
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape or slots.shape[0] != key.shape[0]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} / slots {tuple(slots.shape)} "
            f"do not fit a cache of {num_kv_heads} KV heads x {head_dim}"
        )
    # The kernel checks slots against the cache (one pass, no extra reduction per layer).
    args = (
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        num_blocks * block_size,
        num_kv_heads,
        head_dim,
        block_size,
    )
    if fp8:
        code = load().write_kv_cache_fp8(*args, float(k_scale), float(v_scale))
    else:
        code = load().write_kv_cache_f32(*args)
    if code != 0:
        raise ValueError(f"slot {int(slots.max())} outside the cache ({num_blocks} blocks of {block_size})")


def _cache_is_fp8(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    fp8 = key_cache.dtype in FP8_DTYPES
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"key_cache and value_cache must share one dtype, got {key_cache.dtype} and {value_cache.dtype}"
        )
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("k_scale and v_scale apply to an fp8 cache only: they must be 1.0 for a float32 cache")
    if fp8 and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"fp8 scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
    return fp8


def _rows_dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] itself if each row is dense (rows may be apart), else a contiguous copy."""
    if x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V in this kernel's layout.

    Same arguments and result as :func:`prefixserve.kernels.reference.paged_attention`; only the
    cache layout differs (see :func:`kv_cache_shape`).
    """
    fp8 = _cache_is_fp8(key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, cache_head_dim, block_size = key_cache.shape
    if cache_head_dim != head_dim or value_cache.shape != (num_blocks, num_kv_heads, block_size, head_dim):
        raise ValueError(
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not match "
            f"query head_dim {head_dim} in the CPU layout"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_heads // num_kv_heads > MAX_TILE_ROWS or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"the CPU kernel supports up to {MAX_TILE_ROWS} query heads per KV head and head_dim <= {MAX_HEAD_DIM}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    query = _rows_dense(query)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        _check(t, name, (torch.float32, *FP8_DTYPES))
    if query.dtype != torch.float32:
        raise ValueError(f"query must be float32, got {query.dtype}")
    if out is None:
        out = torch.empty_like(query)
    _check(out, "out", torch.float32)
    num_seqs = lens.shape[0]
    code = load().paged_attention_f32(
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0) if tables.dim() == 2 else 0,
        lens.data_ptr(),
        starts.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        int(sliding_window or 0),
        out.data_ptr(),
        torch.get_num_threads(),
        int(fp8),
        float(k_scale),
        float(v_scale),
    )
    if code != 0:
        raise RuntimeError(f"CPU paged attention failed (code {code})")
    return out
