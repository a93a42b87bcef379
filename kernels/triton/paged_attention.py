"""Triton paged attention for a varlen batch of decode tokens and prefill chunks.

One kernel family serves every batch the scheduler builds: each sequence brings
``q_len >= 0`` new tokens (1 for decode, more for a prefill chunk that continues a
cached prefix) and attends causally to all of its ``seq_len`` tokens, read from the
paged K/V cache through its block-table row. Layouts and semantics are those of
:mod:`prefixserve.kernels.reference` (the oracle the tests compare against).

How the work is cut:
  * A program owns one KV head and a tile of ``block_m`` query rows: ``block_q``
    consecutive tokens of one sequence times the ``group`` query heads that share
    the KV head (GQA/MQA of any ratio). ``block_m >= 16`` keeps ``tl.dot`` legal on
    NVIDIA GPUs; rows past ``block_q * group`` are padding and never stored.
  * Programs find their sequence by a binary search over ``query_start_loc``
    (tile index ``query_start_loc[s] // block_q + s`` bounds the tiles of sequence
    ``s``), so launching needs no host synchronisation.
  * The inner loop walks the keys in tiles of ``tile_n`` (a multiple of 16, the
    second dot's K dimension) gathering each key's physical block from the table,
    so any block size that is a multiple of 16 works with any tile.
  * Flash-decoding: with ``num_kv_splits > 1`` a third grid axis cuts each
    sequence's key range into that many pieces; each writes a normalised partial
    output and its log-sum-exp, and :func:`_reduce_splits_kernel` merges them.

Numerics: scores and the online softmax are fp32. fp16 runs its dots in fp16,
fp32 in fp32 with ``input_precision="ieee"``. bf16 runs bf16 dots on a GPU; under
``TRITON_INTERPRET`` (whose bf16 dot is broken) it upcasts to fp32 first, which is
exact for bf16 inputs. fp8 (e4m3) K/V are cast to the compute dtype (exact) and
their per-tensor scales are folded into the softmax scale (K) and the output (V).

Imports torch and triton only; knows nothing of requests or the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from prefixserve.kernels.checks import check_cache_pair, check_last_dim_contiguous, check_one_device
from prefixserve.kernels.reference import FP8_DTYPES

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(*tensors: torch.Tensor) -> None:
    """All ``tensors`` on one device the kernels can run on: CUDA, or the CPU under the interpreter."""
    device = check_one_device(*tensors)
    if interpreting() != (device.type == "cpu") or device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"the Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            f"set before importing kernels (kernels.reference runs on CPU); got {device}"
        )


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= tile``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    v_scale,
    sliding_window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pos,
    stride_pot,
    stride_poh,
    stride_pls,
    stride_plt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)

    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(COMPUTE_DTYPE)

    # Keys this tile needs: up to its last query's position, from the window start.
    last_q = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_end = context_len + last_q + 1
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    tile_lo = kv_begin // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if SPLIT:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + offs_n
        k_ok = k_pos < kv_end
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k = tl.load(
            key_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        k = k.to(tl.float32).to(COMPUTE_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = v.to(tl.float32).to(COMPUTE_DTYPE)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(COMPUTE_DTYPE), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    store_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(
            part_out_ptr
            + split * stride_pos
            + token[:, None] * stride_pot
            + head[:, None] * stride_poh
            + offs_d[None, :],
            o,
            mask=store_mask,
        )
        tl.store(part_lse_ptr + split * stride_pls + token * stride_plt + head, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    stride_pos,
    stride_pot,
    stride_poh,
    stride_pls,
    stride_plt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # Rows past the last sequence are not attention outputs; leave them as they are.
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(
        part_lse_ptr + offs_s[:, None] * stride_pls + token * stride_plt + offs_h[None, :],
        mask=(offs_s < num_splits)[:, None] & (offs_h < num_heads)[None, :],
        other=float("-inf"),
    )  # [splits, heads]
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(tl.exp2(lse - m[None, :]), 0)  # empty splits weigh 0
    # One split at a time keeps the live tile [heads, head_dim] whatever the split count.
    o = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], tl.float32)
    hd_ok = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    for s in range(num_splits):
        lse_s = tl.load(
            part_lse_ptr + s * stride_pls + token * stride_plt + offs_h, mask=offs_h < num_heads, other=float("-inf")
        )
        part = tl.load(
            part_out_ptr + s * stride_pos + token * stride_pot + offs_h[:, None] * stride_poh + offs_d[None, :],
            mask=hd_ok & (lse_s > float("-inf"))[:, None],
            other=0.0,
        )
        o += part * tl.exp2(lse_s - m)[:, None]
    o = o / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=hd_ok,
    )


@dataclass(frozen=True)
class LaunchPlan:
    """Tile sizes of one launch (no autotuning: the interpreter rejects several configs).

    ``block_m``: query rows per program, ``block_q`` tokens x ``group`` heads, a power
    of two >= 16. ``tile_n``: keys per inner step, a multiple of 16. ``num_kv_splits``:
    pieces each sequence's key range is cut into (1 = no flash-decoding reduce).
    ``upcast_bf16``: run bf16 dots in fp32 (needed by the interpreter).
    """

    block_m: int
    tile_n: int
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    upcast_bf16: bool = False

    def block_q(self, group: int) -> int:
        return self.block_m // group

    def check(self, group: int) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m={self.block_m} must be a power of two >= 16")
        if self.block_m < group:
            raise ValueError(f"block_m={self.block_m} must be >= the query-head group size {group}")
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n={self.tile_n} must be a power of two >= 16")
        if self.num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={self.num_kv_splits} must be >= 1")


def plan_launch(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LaunchPlan:
    """Tile sizes from shapes alone (no host sync on the lengths).

    A batch with one token per sequence is treated as decode: the smallest row tile
    that holds a query-head group, and on a GPU with too few (sequence, KV head)
    programs to fill it, flash-decoding splits sized so every split reads at least
    512 keys of ``max_context`` (the block-table capacity). Otherwise prefill tiles.
    """
    group = num_heads // num_kv_heads
    group_rows = max(16, triton.next_power_of_2(group))
    wide = dtype != torch.float32 and head_dim <= 128
    upcast = dtype == torch.bfloat16 and interpreting()
    if num_tokens <= num_seqs:
        splits = 1
        if device.type == "cuda" and not interpreting():
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            programs = max(num_seqs, 1) * num_kv_heads
            splits = max(1, min(triton.cdiv(4 * sms, programs), max_context // 512, 64))
        return LaunchPlan(
            block_m=group_rows,
            tile_n=64 if wide else 32,
            num_kv_splits=splits,
            num_warps=4,
            num_stages=3 if wide else 2,
            upcast_bf16=upcast,
        )
    return LaunchPlan(
        block_m=max(64, group_rows),
        tile_n=64 if wide else 32,
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=2,
        upcast_bf16=upcast,
    )


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, sliding_window) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if query.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"query dtype must be one of {ACTIVATION_DTYPES}, got {query.dtype}")
    check_cache_pair(key_cache, value_cache)
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache is {key_cache.dtype} but value_cache is {value_cache.dtype}")
    if key_cache.dtype != query.dtype and key_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"the KV cache must be {query.dtype} like the query, or fp8 e4m3; got {key_cache.dtype}")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_size % 16:
        raise ValueError(f"block_size={block_size} must be a multiple of 16")
    check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(
            "block_tables must be a row-major int32 [num_seqs, max_blocks] tensor, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}"
        )
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens must be a contiguous int32 [{num_seqs}] tensor, got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if (
        query_start_loc.shape != (num_seqs + 1,)
        or query_start_loc.dtype != torch.int32
        or not query_start_loc.is_contiguous()
    ):
        raise ValueError(
            f"query_start_loc must be a contiguous int32 [{num_seqs + 1}] tensor, got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must match the query ({query.dtype} {tuple(query.shape)}, last dim "
            f"contiguous), got {out.dtype} {tuple(out.shape)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    optional = [out] if out is not None else []
    check_triton_device(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *optional)


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
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V; see :func:`prefixserve.kernels.reference.paged_attention`.

    Tile sizes come from :func:`plan_launch` unless ``plan`` gives them
    (:func:`paged_attention_planned`).
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, sliding_window)
    if plan is None:
        plan = plan_launch(
            query.shape[0],
            block_tables.shape[0],
            query.shape[1],
            key_cache.shape[2],
            query.shape[2],
            block_tables.shape[1] * key_cache.shape[1],
            query.dtype,
            query.device,
        )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    plan.check(group)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    fp8 = key_cache.dtype in FP8_DTYPES
    k_scale = float(k_scale) if fp8 else 1.0
    v_scale = float(v_scale) if fp8 else 1.0
    block_q = plan.block_q(group)
    splits = plan.num_kv_splits
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    if splits > 1:
        part_out = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
    else:  # never read: the SPLIT branch is compiled out
        part_out = part_lse = out
    head_dim_pad = triton.next_power_of_2(head_dim)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        float(scale) * k_scale * _LOG2E,
        v_scale,
        int(sliding_window or 0),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        # [block, slot, head] strides of each cache
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        **kernel_constants(plan, group, head_dim, block_size, query.dtype, sliding_window is not None),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if splits > 1:
        _reduce_splits_kernel[(num_tokens,)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            num_seqs,
            splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out


def paged_attention_planned(plan: LaunchPlan, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """:func:`paged_attention` with explicit tile sizes (tests and benchmarks); the same arguments follow ``plan``."""
    return paged_attention(*args, plan=plan, **kwargs)


def kernel_constants(
    plan: LaunchPlan, group: int, head_dim: int, block_size: int, dtype: torch.dtype, use_window: bool
) -> dict:
    """The constexpr arguments of :func:`_paged_attention_kernel` for one launch (one compiled variant)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and plan.upcast_bf16):
        # tf32 is exact for bf16 values; fp32 activations want true fp32 products.
        compute, precision = tl.float32, "ieee" if dtype == torch.float32 else "tf32"
    else:
        compute, precision = (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"
    return dict(
        GROUP=group,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=plan.tile_n,
        COMPUTE_DTYPE=compute,
        DOT_PRECISION=precision,
        USE_WINDOW=use_window,
        SPLIT=plan.num_kv_splits > 1,
    )
