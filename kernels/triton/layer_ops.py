"""Triton kernels for the element-wise operations of a decoder layer (CUDA, fp16/bf16/fp32).

The GPU implementation of :class:`prefixserve.kernels.interface.LayerOps`; each operation is
one pass over the activations instead of the several kernels of the torch chain:

  * ``rms_norm`` / ``add_rms_norm``: one program per row holds the whole row; the
    residual sum is written back into ``residual`` and normalised in the same pass.
  * ``rotary``: one program per (token, block of heads), half-split layout, in place.
  * ``rotary_and_write_kv``: the same rotation of q and k, and in the same pass the
    rotated K and the V rows are stored into their paged-cache slots (the layout and
    the fp8 e4m3 quantizing store of :mod:`prefixserve.kernels.triton.cache_write`), so K
    is never re-read from memory by a separate cache-write kernel.
  * ``silu_and_mul``: one program per (row, block of the intermediate size).

Numerics follow the torch reference (:mod:`prefixserve.kernels.reference_layer_ops`) step by step:
float32 math, rounded to the activation dtype exactly where the torch chain
materialises a tensor of that dtype (e.g. rotary rounds ``x1*cos`` and ``x2*sin``
before subtracting, RMSNorm rounds the normalised row before the weight multiply).
Rotary is therefore bit-identical to ``torch_rotary`` (the products of two fp16 or
bf16 values are exact in float32, and fp32 rotation runs with FMA contraction
disabled), and so is everything it stores into an fp8 cache. RMSNorm and SiLU differ
from torch only through reduction order and ``exp``/``rsqrt`` rounding, which can
move a result by one unit in the last place of the output dtype.

Roundings to bf16 are done in integer ops (:func:`_round_to`) rather than by the
cast, because the Triton interpreter's fp32 -> bf16 cast truncates instead of
rounding to nearest even; that keeps the CPU tests (``TRITON_INTERPRET=1``) checking
the same arithmetic the GPU runs.

Imports torch and triton only; only :func:`prefixserve.kernels.backends.select_backend` imports this
module, lazily, so CPU-only installs never need a working Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixserve.kernels.checks import (
    check_cache_dtype,
    check_cache_pair,
    check_last_dim_contiguous,
    check_slot_mapping,
)
from prefixserve.kernels.interface import LayerOps
from prefixserve.kernels.reference import FP8_DTYPES
from prefixserve.kernels.triton.cache_write import CACHE_DTYPES, _fp8_e4m3_bits, _slot_rows
from prefixserve.kernels.triton.paged_attention import check_triton_device

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of one rotary program's [heads, D/2] tile: enough to hide latency, few
# enough registers per thread at 4 warps.
ROTARY_TILE = 2048
SILU_BLOCK = 1024
# FMA contraction off: ``a*b - c*d`` must round both products, as the torch chain does
# (tests/kernels/kernel_compile_check.py compiles with these options and checks the PTX).
ROTARY_LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


# --- device helpers -----------------------------------------------------------------


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``DTYPE``, returned as float32 (exact in it).

    bf16 is rounded on the bits like c10's ``round_to_nearest_even`` (NaN -> 0x7FC0):
    add 0x7FFF plus the lowest kept bit, drop the low 16 bits.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        rounded = tl.where(x != x, 0x7FC00000, rounded)
        return rounded.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _to_storage(x, DTYPE: tl.constexpr):
    """float32 ``x`` already representable in ``DTYPE`` (see :func:`_round_to`) as ``DTYPE``.

    bf16 takes the high half of the bits: exact everywhere, where the interpreter's
    cast would flush bf16 subnormals to zero.
    """
    if DTYPE == tl.bfloat16:
        return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# --- RMSNorm (with the residual add fused in) ----------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # torch: total = x + residual, a tensor of the activation dtype.
        r_ptrs = residual_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + r, residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, _to_storage(x, residual_ptr.dtype.element_ty), mask=mask)
    # Masked lanes are 0 and add nothing to the sum of squares.
    variance = tl.sum(x * x, axis=0) / hidden
    # torch: (x32 * rsqrt(var + eps)).to(x.dtype), then weight * that in the promoted dtype.
    normed = _round_to(x * tl.math.rsqrt(variance + eps), x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(w * normed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, _to_storage(y, out_ptr.dtype.element_ty), mask=mask)


def _activation_check(name: str, x: torch.Tensor) -> None:
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if x.dim():
        check_last_dim_contiguous(**{name: x})


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, hidden]``: a view when the leading dims flatten without a copy."""
    return x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    # The row lives in registers: keep it at <= 32 float32 values per thread.
    return 4 if block <= 4096 else 8 if block <= 8192 else 16


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _activation_check("x", x)
    _activation_check("weight", weight)
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(
            f"norm weight {tuple(weight.shape)} does not match hidden size {hidden} (or is not contiguous)"
        )
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {residual.dtype} {tuple(residual.shape)} does not match x {x.dtype} {tuple(x.shape)}"
            )
        _activation_check("residual", residual)
        tensors.append(residual)
    check_triton_device(*tensors)
    x2 = _rows(x)
    # The output dtype of the reference's ``weight * normed``.
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r2 = _rows(residual) if residual is not None else None
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            r2 if r2 is not None else x2,
            weight,
            out,
            hidden,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            out.stride(0),
            float(eps),
            HAS_RESIDUAL=r2 is not None,
            BLOCK=block,
            num_warps=_norm_warps(block),
        )
    return out.view(x.shape), (r2.view(x.shape) if r2 is not None else None)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight`` over the last dimension, float32 math (as ``torch_rms_norm``)."""
    return _rms_norm(x, None, weight, eps)[0]


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)`` in one pass.

    The sum is written into ``residual`` (which is also returned, reshaped like ``x``);
    if ``residual``'s rows cannot be viewed as ``[rows, hidden]`` the sum goes to a copy.
    """
    out, total = _rms_norm(x, residual, weight, eps)
    assert total is not None
    return out, total


# --- rotary (optionally with the KV-cache write) -------------------------------------


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    first_kv_head,
    num_heads,
    num_q_blocks,
    stride_xt,
    stride_xh,
    stride_cos,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_KV: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Rotate heads ``[h0, h0 + BLOCK_H)`` of token ``t`` in place (half-split layout).

    Axis 1 below ``num_q_blocks`` covers heads ``[0, first_kv_head)``; with WRITE_KV the
    blocks after it cover the K heads ``[first_kv_head, num_heads)``, whose rotated rows
    (and the same heads of ``value``) are also stored into the token's cache slot.
    Without WRITE_KV, ``first_kv_head == num_heads`` and there are no K blocks.
    """
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    is_kv = blk >= num_q_blocks
    h0 = tl.where(is_kv, first_kv_head + (blk - num_q_blocks) * BLOCK_H, blk * BLOCK_H)
    h_end = tl.where(is_kv, num_heads, first_kv_head)
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    mask = (offs_h < h_end)[:, None] & d_ok[None, :]

    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    lo_ptrs = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # torch_rotary: cat(x1*cos - x2*sin, x2*cos + x1*sin), every product and sum a tensor
    # of x's dtype. FMA contraction is disabled at launch, so fp32 rounds the same way.
    DT: tl.constexpr = x_ptr.dtype.element_ty
    o1 = _round_to(_round_to(x1 * cos, DT) - _round_to(x2 * sin, DT), DT)
    o2 = _round_to(_round_to(x2 * cos, DT) + _round_to(x1 * sin, DT), DT)
    tl.store(lo_ptrs, _to_storage(o1, DT), mask=mask)
    tl.store(lo_ptrs + HALF, _to_storage(o2, DT), mask=mask)

    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if is_kv and slot >= 0:  # negative slot: a padding token, not cached
            block = slot // CACHE_BLOCK_SIZE
            in_block = slot % CACHE_BLOCK_SIZE
            kv_h = offs_h - first_kv_head
            k_ptrs = _slot_rows(key_cache_ptr, block, in_block, kv_h, offs_d, stride_kcb, stride_kcs, stride_kch)
            _store_cache(k_ptrs, o1, k_scale, mask, FP8, FP8_MAX)
            _store_cache(k_ptrs + HALF, o2, k_scale, mask, FP8, FP8_MAX)
            v_ptrs = value_ptr + t * stride_vt + kv_h[:, None] * stride_vh + offs_d[None, :]
            vc_ptrs = _slot_rows(value_cache_ptr, block, in_block, kv_h, offs_d, stride_vcb, stride_vcs, stride_vch)
            v1 = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
            _store_cache(vc_ptrs, v1, v_scale, mask, FP8, FP8_MAX)
            _store_cache(vc_ptrs + HALF, v2, v_scale, mask, FP8, FP8_MAX)


@triton.jit
def _store_cache(ptrs, x, scale, mask, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store float32 ``x`` (a value of the activation dtype) as the reference cache write does:
    ``x.to(cache dtype)``, or for fp8 (cache passed as bytes) ``x / scale`` in e4m3."""
    if FP8:
        tl.store(ptrs, _fp8_e4m3_bits(tl.math.div_rn(x, scale), FP8_MAX), mask=mask)
    else:
        CT: tl.constexpr = ptrs.dtype.element_ty
        tl.store(ptrs, _to_storage(_round_to(x, CT), CT), mask=mask)


def triton_prepare_rotary(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, cos, sin)`` made dense once per step, shared by every layer.

    Positions are range-checked only on CPU tensors (the interpreter): on a GPU the
    check would synchronise the device every step (and break CUDA-graph capture); the
    model's positions are below ``max_model_len``, the tables' length.
    """
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a 1-D int32/int64 tensor, got {positions.dtype} {tuple(positions.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"cos and sin must be equal [max_pos, D/2] tables, got {cos.dtype} "
            f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}"
        )
    if (
        positions.device.type == "cpu"
        and positions.numel()
        and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0])
    ):
        raise ValueError(f"positions outside the rotary table of {cos.shape[0]} positions")
    return positions.contiguous(), cos.contiguous(), sin.contiguous()


def _rotary_launch_shape(heads: int, head_dim: int) -> tuple[int, int]:
    """``(HALF_PAD, BLOCK_H)`` for ``heads`` heads of ``head_dim``."""
    half_pad = triton.next_power_of_2(head_dim // 2)
    return half_pad, max(1, min(triton.next_power_of_2(heads), ROTARY_TILE // half_pad))


def _check_rotary(x: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    positions, cos, sin = prepared
    _activation_check("x", x)
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"x must be [num_tokens, heads, head_dim] with an even head_dim, got {tuple(x.shape)}")
    if positions.shape != (x.shape[0],) or cos.shape[1] * 2 != x.shape[2]:
        raise ValueError(
            f"{x.shape[0]} rows / head_dim {x.shape[2]} do not match {positions.shape[0]} "
            f"positions / table width {cos.shape[1]}"
        )
    if cos.dtype != x.dtype:
        # The reference would promote the result to the tables' dtype; the model keeps both equal.
        raise ValueError(f"rotary tables are {cos.dtype} but x is {x.dtype}; build them in x's dtype")


def _launch_rotary(
    x: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first_kv_head: int,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Run :func:`_rotary_kernel` over the checked, non-empty ``x`` ``[T, heads, D]``.

    With ``kv`` = ``(value, key_cache, value_cache, slot_mapping)``, heads from ``first_kv_head``
    on are K heads, stored with ``value`` into the cache; without it ``first_kv_head`` must be
    ``heads`` (rotation only).
    """
    positions, cos, sin = prepared
    rows, heads, head_dim = x.shape
    num_q_heads, num_kv_heads = first_kv_head, heads - first_kv_head
    half_pad, block_h = _rotary_launch_shape(max(num_q_heads, num_kv_heads), head_dim)
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    num_kv_blocks = triton.cdiv(num_kv_heads, block_h)
    if kv is None:  # no cache write: placeholders the kernel never reads
        value, key_cache, value_cache, slot_mapping = x, x, x, positions
        cache_strides: tuple[int, ...] = (0,) * 8
        fp8, fp8_max, block_size = False, 0.0, 1
    else:
        value, key_cache, value_cache, slot_mapping = kv
        fp8 = key_cache.dtype in FP8_DTYPES
        fp8_max = float(torch.finfo(key_cache.dtype).max) if fp8 else 0.0
        block_size = key_cache.shape[1]
        if fp8:  # the kernel writes the e4m3 bit patterns it computed, as cache_write does
            key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        # value's [token, head] strides, then the [block, slot, head] strides of each cache
        cache_strides = (*value.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3])
    _rotary_kernel[(rows, num_q_blocks + num_kv_blocks)](
        x,
        positions,
        cos,
        sin,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        first_kv_head,
        heads,
        num_q_blocks,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        *cache_strides,
        HALF=head_dim // 2,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        WRITE_KV=kv is not None,
        CACHE_BLOCK_SIZE=block_size,
        FP8=fp8,
        FP8_MAX=fp8_max,
        **ROTARY_LAUNCH_OPTIONS,
    )


def triton_rotary(x: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` in place (half-split layout, as ``torch_rotary``) and return it.

    Token rows and heads may be strided (e.g. q and k as a view of the fused qkv
    projection's output); the last dimension must be contiguous.
    """
    _check_rotary(x, prepared)
    check_triton_device(x, *prepared)
    if x.shape[0] and x.shape[1]:
        _launch_rotary(x, prepared, x.shape[1])
    return x


def triton_rotary_and_write_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q and k in place and store the rotated k and ``value`` into the paged cache, in one pass.

    ``qk`` is ``[T, H + KVH, D]``: the ``H`` query heads then the ``KVH`` key heads
    (``KVH = value.shape[1]``); ``value`` is ``[T, KVH, D]``. Equivalent to
    ``k = triton_rotary(qk, prepared)[:, H:]`` followed by
    :func:`prefixserve.kernels.triton.cache_write.write_kv_cache` ``(k, value, key_cache,
    value_cache, slot_mapping, k_scale=..., v_scale=...)``, bit for bit (negative slots
    are padding and skipped; an fp8 cache gets the same e4m3 bytes). Returns ``qk``.
    """
    _check_rotary(qk, prepared)
    rows, heads, head_dim = qk.shape
    if value.dim() != 3 or value.shape[0] != rows or value.shape[2] != head_dim or value.shape[1] > heads:
        raise ValueError(f"value must be [{rows}, num_kv_heads, {head_dim}], got {tuple(value.shape)}")
    num_kv_heads = value.shape[1]
    if value.dtype != qk.dtype or value.stride(-1) != 1:
        raise ValueError(f"value must be {qk.dtype} with a contiguous last dimension, got {value.dtype}")
    check_cache_pair(key_cache, value_cache, (num_kv_heads, head_dim))
    check_cache_dtype(key_cache, value_cache, CACHE_DTYPES)
    check_last_dim_contiguous(key_cache=key_cache, value_cache=value_cache)
    check_slot_mapping(slot_mapping, rows)
    check_triton_device(qk, value, *prepared, key_cache, value_cache, slot_mapping)
    if rows:
        _launch_rotary(
            qk, prepared, heads - num_kv_heads, (value, key_cache, value_cache, slot_mapping), k_scale, v_scale
        )
    return qk


# --- SiLU and multiply ---------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + inter + offs, mask=mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    # torch: F.silu(gate) (x / (1 + exp(-x)), a tensor of the activation dtype), then * up.
    act = _round_to(gate / (1.0 + tl.exp(-gate)), DT)
    tl.store(out_ptr + row * stride_o + offs, _to_storage(_round_to(act * up, DT), DT), mask=mask)


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` into a new ``[..., I]`` tensor."""
    _activation_check("gate_up", gate_up)
    check_triton_device(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    g2 = _rows(gate_up)
    out = torch.empty((g2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0] and inter:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(inter, SILU_BLOCK))](
            g2, out, inter, g2.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], inter)


TRITON_LAYER_OPS = LayerOps(
    "triton",
    triton_rms_norm,
    triton_add_rms_norm,
    triton_prepare_rotary,
    triton_rotary,
    triton_silu_and_mul,
    rotary_and_write_kv=triton_rotary_and_write_kv,
)
