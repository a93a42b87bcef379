"""Triton kernels of the segmented LoRA matmul (CUDA; any float dtype, float32 accumulation).

``triton_add_lora(y, x, a, b, token_slots)`` does what ``kernels.reference_lora.add_lora``
does, reading each row's adapter slot from ``token_slots`` (-1: the base model, untouched)
instead of grouping rows on the host, in two launches (punica's BGMV shape):

  * shrink: one program per (row, block of ranks): ``h[t] = a[slot_t] x[t]`` (float32);
  * expand: one program per (row, block of output features):
    ``y[t] += b[slot_t] h[t]``, rounded once to ``y``'s dtype.

Both reduce with ``tl.sum`` over tiles (no ``tl.dot``: a decode row is one vector, and the
ranks are small), so any rank and feature count compiles. Imports torch and triton only;
the model loads this module only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixserve.kernels.triton.paged_attention import check_triton_device

BLOCK_R = 16
BLOCK_K = 128
BLOCK_N = 64


@triton.jit
def _shrink(
    x_ptr, a_ptr, h_ptr, slots_ptr, K, R, stride_x, stride_as, stride_ar, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            tile = tl.load(
                a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                mask=(r[:, None] < R) & (k[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(tile * xv[None, :], axis=1)
        tl.store(h_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def _expand(
    h_ptr, b_ptr, y_ptr, slots_ptr, N, R, stride_y, stride_bs, stride_bn, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            hv = tl.load(h_ptr + t * R + r, mask=r < R, other=0.0)
            tile = tl.load(
                b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(tile * hv[None, :], axis=1)
        out = y_ptr + t * stride_y + n
        prev = tl.load(out, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out, (prev + acc).to(y_ptr.dtype.element_ty), mask=n < N)


def triton_add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``y[t] += (x[t] a[s]^T) b[s]^T`` with ``s = token_slots[t]`` for every row with ``s >= 0``;
    returns ``y`` (updated in place). ``x`` ``[T, K]``, ``y`` ``[T, N]``, ``a`` ``[S, R, K]``,
    ``b`` ``[S, N, R]``, ``token_slots`` ``[T]`` int64; inner dims contiguous."""
    check_triton_device(y, x, a, b, token_slots)
    num_tokens, k = x.shape
    _, rank, _ = a.shape
    n = y.shape[1]
    if y.shape[0] != num_tokens or token_slots.numel() != num_tokens or a.shape[2] != k or b.shape[1:] != (n, rank):
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, token_slots {tuple(token_slots.shape)}"
        )
    for name, t in (("x", x), ("y", y), ("a", a), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if a.stride(1) != k or b.stride(1) != rank:
        raise ValueError("a and b must be contiguous per slot")
    if num_tokens == 0:
        return y
    h = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    slots = token_slots.contiguous()
    _shrink[(num_tokens, triton.cdiv(rank, BLOCK_R))](
        x, a, h, slots, k, rank, x.stride(0), a.stride(0), a.stride(1), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K
    )
    _expand[(num_tokens, triton.cdiv(n, BLOCK_N))](
        h, b, y, slots, n, rank, y.stride(0), b.stride(0), b.stride(1), BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R
    )
    return y
