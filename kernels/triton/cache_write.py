"""Triton store of new tokens' K and V into the paged cache.

One program per token: it reads ``slot_mapping[t]`` (``block_id * block_size +
offset``; negative = padding, the program does nothing) and writes that token's
``[num_kv_heads, head_dim]`` K and V rows into the slot. Into an fp8 (e4m3) cache
it stores ``x / scale`` rounded to nearest-even and saturated to +-448, as
:func:`prefixserve.kernels.reference.write_kv_cache` does, bit for bit: the division is
IEEE-rounded float32 (``div_rn``; the reference divides by a device tensor, never by
a reciprocal), and the fp32 -> e4m3 rounding is written out in integer ops
(:func:`_fp8_e4m3_bits`, the algorithm of torch's c10 ``fp8e4m3fn_from_fp32_value``, also
in kernels/cpu/paged_attention.c) and stored as bytes. Not relying on the hardware
cast makes the store identical on every GPU generation and under the Triton
interpreter (whose fp32 -> fp8 cast has no carry and no saturation), so CPU tests
check it against the reference.

Imports torch and triton only.
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
from prefixserve.kernels.reference import FP8_DTYPES
from prefixserve.kernels.triton.paged_attention import check_triton_device

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES


@triton.jit
def _fp8_e4m3_bits(y, FP8_MAX: tl.constexpr):
    """fp32 ``y`` -> e4m3fn bit patterns (uint8): saturate to +-FP8_MAX, round to nearest even.

    c10's fp8e4m3fn_from_fp32_value: below 2^-6 (subnormal) adding 2^14 rounds the
    magnitude to a multiple of 2^-9 in float arithmetic; above, the fp32 bits are
    rounded at mantissa bit 20 and rebiased (exponent 127 -> 7). NaN -> 0x7f.
    """
    is_nan = y != y
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    bits = y.to(tl.int32, bitcast=True)
    negative = bits < 0
    mag = bits & 0x7FFFFFFF
    sub = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    odd = (mag >> 20) & 1
    norm = (mag + (((7 - 127) << 23) + 0x7FFFF) + odd) >> 20
    r = tl.where(mag < (121 << 23), sub, norm)
    r = tl.where(is_nan, 0x7F, r)
    r = r | tl.where(negative, 0x80, 0)
    return r.to(tl.uint8)


@triton.jit
def _slot_rows(cache_ptr, block, in_block, heads, offs_d, stride_cb, stride_cs, stride_ch):
    """Pointers to the ``[heads, offs_d]`` rows of one cache slot (``in_block`` of ``block``)."""
    return cache_ptr + block * stride_cb + in_block * stride_cs + heads[:, None] * stride_ch + offs_d[None, :]


@triton.jit
def _store_rows(
    src_ptr,
    cache_ptr,
    t,
    block,
    in_block,
    scale,
    stride_t,
    stride_h,
    stride_cb,
    stride_cs,
    stride_ch,
    offs_h,
    offs_d,
    mask,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    x = tl.load(src_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask)
    if FP8:  # the cache is passed as bytes (uint8)
        x = _fp8_e4m3_bits(tl.math.div_rn(x.to(tl.float32), scale), FP8_MAX)
    tl.store(
        _slot_rows(cache_ptr, block, in_block, offs_h, offs_d, stride_cb, stride_cs, stride_ch),
        x.to(cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    _store_rows(
        key_ptr,
        key_cache_ptr,
        t,
        block,
        in_block,
        k_scale,
        stride_kt,
        stride_kh,
        stride_kcb,
        stride_kcs,
        stride_kch,
        offs_h,
        offs_d,
        mask,
        FP8,
        FP8_MAX,
    )
    _store_rows(
        value_ptr,
        value_cache_ptr,
        t,
        block,
        in_block,
        v_scale,
        stride_vt,
        stride_vh,
        stride_vcb,
        stride_vcs,
        stride_vch,
        offs_h,
        offs_d,
        mask,
        FP8,
        FP8_MAX,
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
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots.

    Same contract as :func:`prefixserve.kernels.reference.write_kv_cache`. ``k_scale``/``v_scale``
    are used only by an fp8 cache.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_cache_pair(key_cache, value_cache)
    if tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key rows {tuple(key.shape[1:])} do not match the cache's "
            f"[num_kv_heads, head_dim] {tuple(key_cache.shape[2:])}"
        )
    check_cache_dtype(key_cache, value_cache, CACHE_DTYPES)
    if key.dtype not in (torch.float32, torch.float16, torch.bfloat16) or value.dtype != key.dtype:
        raise ValueError(f"key and value must share a float dtype, got {key.dtype} and {value.dtype}")
    check_slot_mapping(slot_mapping, key.shape[0])
    check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    check_triton_device(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype in FP8_DTYPES
    fp8_max = float(torch.finfo(key_cache.dtype).max) if fp8 else 0.0
    if fp8:  # the kernel writes the e4m3 bit patterns it computed
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        num_kv_heads,
        head_dim,
        *key.stride()[:2],
        *value.stride()[:2],
        # [block, slot, head] strides of each cache
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8,
        FP8_MAX=fp8_max,
        num_warps=4,
    )
