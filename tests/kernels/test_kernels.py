"""Paged attention and cache write: Triton (under TRITON_INTERPRET) vs torch reference vs dense.

Error bound: ``max |out - dense| / max |dense|`` per activation dtype (TOL below).
The dense float64 oracle sees the same rounded (or fp8-quantized) K/V the cache
holds, so the bound only covers the kernels' own arithmetic: fp16 probabilities
and output rounding, and for bf16 the interpreter's truncating output cast.
Every output buffer starts as NaN and every unowned cache slot holds NaN.

The interpreter runs programs one after another, so shapes are small. The fp8
quantizing store of every writer (Triton, C, reference) is checked bit for bit in
tests/kernels/test_fp8_kv.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import FP8, PagedBatch, dense_attention, make_paged_batch, relative_error

from prefixserve.kernels import reference
from prefixserve.kernels.backends import select_backend
from prefixserve.kernels.triton.cache_write import write_kv_cache as triton_write_kv_cache
from prefixserve.kernels.triton.paged_attention import (
    LaunchPlan,
    paged_attention,
    paged_attention_planned,
    plan_launch,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# The reference dequantizes fp8 to the activation dtype before SDPA (one more rounding).
REF_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def mixed_seqs(bs: int) -> list[tuple[int, int]]:
    """(cached context, new tokens): decode ending on a block boundary, a first token,
    a mid-block decode, a prefill chunk over a cached prefix, a fresh one-block
    prefill (ends on a boundary), and a decode sharing two blocks with sequence 3."""
    return [(2 * bs - 1, 1), (0, 1), (bs + 5, 1), (bs + 3, bs + 7), (0, bs), (2 * bs + 3, 1)]


MIXED_SHARE = (5, 3)


def run_triton(batch: PagedBatch, plan: LaunchPlan | None = None, **kw) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    kw = dict(scale=batch.query.shape[-1] ** -0.5, k_scale=batch.k_scale, v_scale=batch.v_scale, out=out, **kw)
    if plan is None:
        result = paged_attention(*batch.args(), **kw)
    else:
        result = paged_attention_planned(plan, *batch.args(), **kw)
    assert result is out
    return out


def run_reference(batch: PagedBatch, **kw) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    reference.paged_attention(
        *batch.args(), scale=batch.query.shape[-1] ** -0.5, k_scale=batch.k_scale, v_scale=batch.v_scale, out=out, **kw
    )
    return out


def check(out: torch.Tensor, batch: PagedBatch, dtype: torch.dtype, sliding_window=None, tol: dict = TOL) -> None:
    dense = dense_attention(batch, batch.query.shape[-1] ** -0.5, sliding_window)
    err = relative_error(out, dense)
    assert err <= tol[dtype], f"relative error {err:.3g} > {tol[dtype]:.1g}"
    # Rows past the last sequence are not outputs: they keep the poison.
    assert torch.isnan(out[batch.num_tokens :]).all()


def small_plan(batch: PagedBatch, splits: int = 1) -> LaunchPlan:
    """The narrowest legal tiles (16 keys per step), so tile edges fall inside blocks."""
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    return LaunchPlan(
        block_m=max(16, 1 << (group - 1).bit_length()),
        tile_n=16,
        num_kv_splits=splits,
        upcast_bf16=batch.query.dtype == torch.bfloat16,
    )


# ----------------------------------------------------------------------------- Triton attention


@pytest.mark.parametrize(
    "head_dim,block_size,num_heads,num_kv_heads,dtype",
    [
        (64, 16, 2, 2, torch.float32),
        (128, 32, 8, 2, torch.float16),
        (64, 32, 6, 2, torch.bfloat16),
        (128, 16, 8, 1, torch.float32),
    ],
)
def test_triton_mixed_batch(seed, head_dim, block_size, num_heads, num_kv_heads, dtype):
    batch = make_paged_batch(
        seed,
        mixed_seqs(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        share=MIXED_SHARE,
        padding_rows=2,
    )
    ref = run_reference(batch)
    check(ref, batch, dtype, tol=REF_TOL)
    for plan in (None, small_plan(batch)):  # prefill tiles from the heuristic, then decode-sized tiles
        out = run_triton(batch, plan)
        check(out, batch, dtype)
        assert relative_error(out, ref) <= REF_TOL[dtype]


@pytest.mark.parametrize("num_heads,num_kv_heads,splits", [(8, 2, 1), (8, 2, 4), (6, 2, 3), (4, 4, 8)])
def test_triton_decode_batch_and_split_kv(seed, num_heads, num_kv_heads, splits):
    bs = 16
    # A 1-token sequence leaves most splits empty; 5 * bs ends on a block boundary.
    seqs = [(0, 1), (5 * bs - 1, 1), (3 * bs + 6, 1), (40, 1)]
    batch = make_paged_batch(
        seed,
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=bs,
        dtype=torch.float16,
        padding_rows=1,
    )
    out = run_triton(batch, small_plan(batch, splits))
    check(out, batch, torch.float16)
    assert relative_error(out, run_reference(batch)) <= REF_TOL[torch.float16]


@pytest.mark.parametrize("window,splits,num_kv_heads", [(19, 1, 1), (1, 1, 2), (19, 3, 2), (40, 2, 4)])
def test_triton_sliding_window(seed, window, splits, num_kv_heads):
    bs = 16
    batch = make_paged_batch(
        seed,
        mixed_seqs(bs),
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=bs,
        dtype=torch.float32,
        share=MIXED_SHARE,
    )
    ref = run_reference(batch, sliding_window=window)
    check(ref, batch, torch.float32, sliding_window=window)
    out = run_triton(batch, small_plan(batch, splits), sliding_window=window)
    check(out, batch, torch.float32, sliding_window=window)


@pytest.mark.parametrize(
    "dtype,head_dim,block_size,num_heads,num_kv_heads,decode_split",
    [
        (torch.float16, 64, 16, 8, 2, 0),
        (torch.float32, 128, 32, 2, 2, 2),
        (torch.bfloat16, 64, 32, 8, 1, 0),
    ],
)
def test_triton_fp8_kv(seed, dtype, head_dim, block_size, num_heads, num_kv_heads, decode_split):
    seqs = [(3 * block_size, 1), (0, 1), (block_size + 9, 1)] if decode_split else mixed_seqs(block_size)
    batch = make_paged_batch(
        seed,
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        fp8_kv=True,
        share=None if decode_split else MIXED_SHARE,
    )
    assert batch.key_cache.dtype == FP8 and batch.k_scale != 1.0 and batch.v_scale != batch.k_scale
    ref = run_reference(batch)
    check(ref, batch, dtype, tol=REF_TOL)
    plan = small_plan(batch, decode_split) if decode_split else None
    out = run_triton(batch, plan)
    check(out, batch, dtype)
    assert relative_error(out, ref) <= REF_TOL[dtype]


def test_triton_group_wider_than_16_rows(seed):
    """24 query heads on one KV head: 32-row tiles holding one token each."""
    batch = make_paged_batch(
        seed, [(20, 1), (0, 3), (33, 1)], num_heads=24, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    out = run_triton(batch)
    check(out, batch, torch.float32)


def test_triton_single_sequence_prefill_chunk(seed):
    batch = make_paged_batch(
        seed, [(40, 24)], num_heads=8, num_kv_heads=2, head_dim=128, block_size=32, dtype=torch.float16
    )
    check(run_triton(batch), batch, torch.float16)


def test_triton_empty_query_sequence(seed):
    """A sequence with no new tokens in the batch produces nothing and disturbs nothing."""
    batch = make_paged_batch(
        seed, [(20, 1), (30, 0), (5, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    check(run_triton(batch), batch, torch.float32)
    check(run_reference(batch), batch, torch.float32)


def test_triton_reads_leading_two_cache(seed):
    """A [2, NB, BS, KVH, D] cache passed as its two halves (strided views)."""
    batch = make_paged_batch(
        seed, [(17, 1), (3, 6)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    kv = torch.stack([batch.key_cache, batch.value_cache])
    split = dataclasses.replace(batch, key_cache=kv[0], value_cache=kv[1])
    check(run_triton(split), batch, torch.float16)


def test_plan_launch_heuristic():
    decode = plan_launch(32, 32, 32, 8, 128, 4096, torch.float16, torch.device("cpu"))
    assert (decode.block_m, decode.num_kv_splits) == (16, 1)  # no splits off-GPU
    prefill = plan_launch(600, 4, 32, 8, 128, 4096, torch.bfloat16, torch.device("cpu"))
    assert prefill.block_m == 64 and prefill.tile_n % 16 == 0
    assert plan_launch(3, 3, 40, 1, 64, 512, torch.float32, torch.device("cpu")).block_m == 64
    with pytest.raises(ValueError, match="query-head group"):
        LaunchPlan(block_m=16, tile_n=16).check(group=24)
    with pytest.raises(ValueError, match="tile_n"):
        LaunchPlan(block_m=16, tile_n=24).check(group=2)


def _bad_inputs():
    def block_tables_int64(a):
        a["block_tables"] = a["block_tables"].long()

    def head_dim_mismatch(a):
        a["query"] = a["query"][..., :32]

    def ragged_heads(a):
        a["query"] = a["query"][:, :3]

    def non_contiguous_query(a):
        a["query"] = a["query"].transpose(1, 2).contiguous().transpose(1, 2)

    def cache_dtype(a):
        a["key_cache"] = a["key_cache"].half()
        a["value_cache"] = a["value_cache"].half()

    def block_size_24(a):
        a["key_cache"] = a["key_cache"][:, :24]
        a["value_cache"] = a["value_cache"][:, :24]

    def short_query_start_loc(a):
        a["query_start_loc"] = a["query_start_loc"][:-1]

    def wrong_out(a):
        a["out"] = torch.empty(a["query"].shape, dtype=torch.float16)

    return [
        (block_tables_int64, "block_tables"),
        (head_dim_mismatch, "head_dim"),
        (ragged_heads, "multiple of num_kv_heads"),
        (non_contiguous_query, "contiguous"),
        (cache_dtype, "KV cache"),
        (block_size_24, "multiple of 16"),
        (short_query_start_loc, "query_start_loc"),
        (wrong_out, "out must match"),
    ]


@pytest.mark.parametrize("mutate,message", _bad_inputs(), ids=lambda x: getattr(x, "__name__", ""))
def test_triton_rejects_bad_inputs(seed, mutate, message):
    batch = make_paged_batch(
        seed, [(10, 2)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float32
    )
    args = dict(
        zip(["query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc"], batch.args()),
        out=None,
    )
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, scale=0.125)


def test_kernels_compile_for_gpu():
    """Every variant lowers to an sm_90 cubin (no GPU needed); see kernel_compile_check.py."""
    script = Path(__file__).with_name("kernel_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(script), "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok attention") == 9 and proc.stdout.count("ok cache write") == 4


# ----------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,window,fp8",
    [
        (torch.float32, 4, 4, None, False),
        (torch.float32, 6, 2, 7, False),
        (torch.float16, 8, 2, None, False),
        (torch.bfloat16, 8, 1, 20, False),
        (torch.float16, 8, 2, None, True),
        (torch.float32, 3, 1, 33, True),
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_matches_dense(seed, dtype, num_heads, num_kv_heads, window, fp8, block_size):
    batch = make_paged_batch(
        seed,
        mixed_seqs(block_size) + [(3 * block_size, 2)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        fp8_kv=fp8,
        share=MIXED_SHARE,
        padding_rows=1,
    )
    check(run_reference(batch, sliding_window=window), batch, dtype, sliding_window=window, tol=REF_TOL)


# ----------------------------------------------------------------------------- cache write

WRITERS = {"triton": triton_write_kv_cache, "reference": reference.write_kv_cache}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize(
    "cache_dtype,key_dtype,slot_dtype",
    [
        (torch.float32, torch.float32, torch.int64),
        (torch.float16, torch.float16, torch.int32),
        (torch.bfloat16, torch.bfloat16, torch.int64),
        (torch.float16, torch.float32, torch.int32),
    ],
)
def test_write_kv_cache(seed, writer, cache_dtype, key_dtype, slot_dtype):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, bs, kvh, d, tokens = 6, 16, 3, 64, 21
    cache = [torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=cache_dtype) for _ in range(2)]
    # K and V as strided slices of one fused projection output, as a model produces them.
    qkv = torch.randn(tokens, 2 * kvh + 4, d, generator=gen).to(key_dtype)
    key, value = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:5]] = -1  # padding tokens
    WRITERS[writer](key, value, cache[0], cache[1], slots.to(slot_dtype))
    kept = slots >= 0
    flat_k, flat_v = cache[0].view(-1, kvh, d), cache[1].view(-1, kvh, d)
    assert torch.equal(flat_k[slots[kept]], key[kept].to(cache_dtype))
    assert torch.equal(flat_v[slots[kept]], value[kept].to(cache_dtype))
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_triton_write_kv_cache_rejects_bad_inputs():
    cache = torch.zeros(2, 16, 2, 64)
    key = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_write_kv_cache(key, key, cache, cache, torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        triton_write_kv_cache(
            torch.zeros(3, 4, 64), torch.zeros(3, 4, 64), cache, cache, torch.zeros(3, dtype=torch.int64)
        )


def test_reference_fp8_quantizing_store(seed):
    gen = torch.Generator().manual_seed(seed)
    kvh, d, tokens = 2, 64, 12
    key = torch.randn(tokens, kvh, d, generator=gen)
    value = torch.randn(tokens, kvh, d, generator=gen)
    k_scale = reference.fp8_scale_for(key) * 0.5  # half the range: the largest values saturate
    v_scale = reference.fp8_scale_for(value)
    cache = [torch.zeros(2, 16, kvh, d, dtype=FP8) for _ in range(2)]
    slots = torch.arange(tokens) * 2
    slots[3] = -1
    reference.write_kv_cache(key, value, cache[0], cache[1], slots, k_scale=k_scale, v_scale=v_scale)
    stored_k = cache[0].view(-1, kvh, d)[slots[slots >= 0]].float()
    stored_v = cache[1].view(-1, kvh, d)[slots[slots >= 0]].float()
    k, v = key[slots >= 0] / k_scale, value[slots >= 0] / v_scale
    saturated = k.abs() > 448
    assert saturated.any() and torch.equal(stored_k[saturated], 448 * k[saturated].sign())
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values.
    normal = ~saturated & (k.abs() >= 2**-6)
    assert ((stored_k[normal] - k[normal]).abs() <= k[normal].abs() * 2**-4).all()
    assert torch.equal(stored_v, v.to(FP8).float())  # in range: torch's own round-to-nearest-even
    assert (cache[0].view(-1, kvh, d)[6].float() == 0).all()  # the padding token's slot is untouched


def test_fp8_scale_for():
    x = torch.tensor([[-3.0, 1.0], [2.0, 0.5]])
    assert reference.fp8_scale_for(x) == pytest.approx(3.0 / 448)
    assert reference.fp8_scale_for(torch.zeros(3)) == 1.0


def test_select_backend():
    assert select_backend("torch", "cpu").name == "torch"
    triton_backend = select_backend("triton", "cpu")
    assert triton_backend.paged_attention is paged_attention
    assert triton_backend.write_kv_cache is triton_write_kv_cache
    with pytest.raises(ValueError, match="backend"):
        select_backend("cuda", "cpu")
