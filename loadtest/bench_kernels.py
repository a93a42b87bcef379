"""Paged-attention and fused layer kernel benchmark for one CUDA GPU.

``python -m prefixserve.loadtest.bench_kernels`` runs, in one process, and prints one markdown
table (and writes results/bench_kernels.json):

1. Correctness first: the Triton kernels against the torch reference on the GPU
   (fp16, bf16, fp8 KV, sliding window, forced flash-decoding splits, a varlen
   batch mixing decode and prefill chunks), and the cache write, whose fp8
   quantizing store must match the reference bit for bit (the CPU interpreter
   cannot check that cast).
2. The machine's ceilings: device-to-device copy bandwidth and the fp16/bf16
   matmul rate.
3. Decode (one token per sequence, batches 32 and 256, contexts 1k..32k, fp16,
   bf16 and fp8 KV): achieved GB/s of K/V (+ query/output) traffic, as a share of
   the copy bandwidth; the same attention through torch SDPA over contiguous K/V
   (the non-paged baseline) as a speed ratio; flash-attn and FlashInfer if importable.
4. Prefill chunks over a cached prefix: TFLOP/s (visible keys only) as a share of
   the matmul rate, against SDPA with a lower-right causal mask.
5. The fused layer kernels (kernels/triton/layer_ops.py), checked first against the
   torch reference (rotary and the fp8 cache bytes bit for bit), then one row per
   kernel at 64 decode rows and a 4096-token prefill of Llama-3.2-1B's shape (hidden
   2048, 32/8 heads of 64, intermediate 8192, bf16): GB/s of the bytes the operation
   must move, against the torch reference chain on the same bytes.

Attention model shape: 32 query heads, 8 KV heads, head_dim 128, block size 16
(Llama-3-8B). Block tables are random permutations, so every sequence's blocks are
scattered. ``--layers-only`` runs parts 1 (layer checks), 2 and 5; ``--json`` prints
nothing and only writes the JSON. On a machine without CUDA it says so and exits
with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixserve.loadtest.harness.report import markdown_table, write_json

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", FP8: "fp8"}
# Triton vs the fp32 reference: fp16/bf16 probabilities and output rounding.
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 5e-5}


@dataclass
class Row:
    """One line of the table."""

    part: str
    case: str
    triton: str
    of_peak: str = ""
    sdpa: str = ""
    ratio: str = ""
    flash_attn: str = ""
    flashinfer: str = ""
    note: str = ""


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


# --- inputs ------------------------------------------------------------------------------


def _fill_random(t: torch.Tensor, gen: torch.Generator, chunk: int = 1 << 26) -> torch.Tensor:
    """Uniform(-1, 1) values, filled in chunks so fp8 never needs a full fp32 copy."""
    flat = t.view(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk]
        src = torch.empty(part.shape, dtype=torch.float16, device=t.device).uniform_(-1, 1, generator=gen)
        part.copy_(src.to(t.dtype))
    return t


@dataclass
class PagedInputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    q_lens: list[int]
    lens: list[int]
    k_scale: float
    v_scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query_start_loc)


def make_inputs(
    seqs: Sequence[tuple[int, int]], act: torch.dtype, kv: torch.dtype, device: torch.device, seed: int
) -> PagedInputs:
    """A paged batch of ``(cached_context, new_tokens)`` sequences with scattered blocks."""
    num_heads, num_kv_heads, head_dim, block_size = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [c + q for c, q in seqs]
    q_lens = [q for _, q in seqs]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = _fill_random(torch.empty(cache_shape, dtype=kv, device=device), gen)
    value_cache = _fill_random(torch.empty(cache_shape, dtype=kv, device=device), gen)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros((len(seqs), max(per_seq)), dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = perm[start : start + nb]
        start += nb
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.empty((starts[-1], num_heads, head_dim), dtype=act, device=device).uniform_(-1, 1, generator=gen)
    fp8 = kv == FP8
    return PagedInputs(
        query,
        key_cache,
        value_cache,
        tables,
        torch.tensor(lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        q_lens,
        lens,
        k_scale=0.75 if fp8 else 1.0,
        v_scale=1.25 if fp8 else 1.0,
    )


def contiguous_kv(inp: PagedInputs, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as ``[B, L, KVH, D]`` in the activation dtype (dequantized), equal-length sequences."""
    length = inp.lens[0]
    out = []
    for cache, scale in ((inp.key_cache, inp.k_scale), (inp.value_cache, inp.v_scale)):
        blocks = cache[inp.block_tables.long()]  # [B, nb, BS, KVH, D]
        dense = blocks.flatten(1, 2)[:, :length].to(act)
        del blocks
        if cache.dtype == FP8:
            dense.mul_(scale)
        out.append(dense.contiguous())
        del dense
    return out[0], out[1]


def kv_bytes(inp: PagedInputs, kv_element_size: int | None = None) -> int:
    """Bytes a decode step must move: every visible K and V element, the query and the output."""
    elem = kv_element_size or inp.key_cache.element_size()
    kv = sum(inp.lens) * inp.key_cache.shape[2] * inp.key_cache.shape[3] * elem * 2
    return kv + 2 * inp.query.numel() * inp.query.element_size()


def attention_flops(q_lens: Sequence[int], lens: Sequence[int], num_heads: int, head_dim: int) -> float:
    """2 matmuls x 2 FLOPs per multiply-add over the causally visible keys only."""
    visible = 0
    for q, n in zip(q_lens, lens):
        ctx = n - q
        visible += q * ctx + q * (q + 1) // 2
    return 4.0 * visible * num_heads * head_dim


# --- 1. correctness ----------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).abs().max() / b.abs().max())


def correctness(device: torch.device, seed: int, scale_down: int = 1) -> list[dict]:
    """Triton vs the torch reference (fp32 math on the same stored values) on ``device``."""
    from prefixserve.kernels import reference
    from prefixserve.kernels.triton.paged_attention import paged_attention, paged_attention_planned, plan_launch

    bs = BLOCK_SIZE
    mixed = [
        (2 * bs - 1, 1),
        (0, 1),
        (700 // scale_down, 1),
        (300 // scale_down, 200 // scale_down),
        (0, 3 * bs),
        (5000 // scale_down, 1),
        (1000 // scale_down, 37),
    ]
    decode = [(n // scale_down, 1) for n in (1, 16, 999, 4096, 8191, 20000, 5, 12345)]
    cases = [
        ("mixed", mixed, torch.float16, torch.float16, None, None),
        ("mixed", mixed, torch.bfloat16, torch.bfloat16, None, None),
        ("mixed", mixed, torch.float16, FP8, None, None),
        ("mixed", mixed, torch.bfloat16, FP8, None, None),
        ("mixed window=256", mixed, torch.float16, torch.float16, 256 // scale_down, None),
        ("mixed fp32", mixed, torch.float32, torch.float32, None, None),
        ("decode", decode, torch.bfloat16, torch.bfloat16, None, None),
        ("decode splits=7", decode, torch.float16, torch.float16, None, 7),
        ("decode fp8 splits=16", decode, torch.bfloat16, FP8, None, 16),
        ("decode window=1000 splits=5", decode, torch.float16, torch.float16, 1000 // scale_down, 5),
    ]
    results = []
    for i, (name, seqs, act, kv, window, splits) in enumerate(cases):
        inp = make_inputs(seqs, act, kv, device, seed + i)
        kw = dict(scale=HEAD_DIM**-0.5, sliding_window=window, k_scale=inp.k_scale, v_scale=inp.v_scale)
        if splits is None:
            out = paged_attention(*inp.args(), **kw)
        else:
            plan = plan_launch(
                len(inp.query),
                len(seqs),
                NUM_HEADS,
                NUM_KV_HEADS,
                HEAD_DIM,
                inp.block_tables.shape[1] * bs,
                act,
                device,
            )
            out = paged_attention_planned(dataclasses.replace(plan, num_kv_splits=splits), *inp.args(), **kw)
        ref_caches = (inp.key_cache, inp.value_cache) if kv == FP8 else (inp.key_cache.float(), inp.value_cache.float())
        ref = reference.paged_attention(inp.query.float(), *ref_caches, *inp.args()[3:], **kw)
        err = _rel_err(out, ref)
        results.append(
            {
                "case": f"{name} {DTYPE_NAMES[act]}/{DTYPE_NAMES[kv]} KV",
                "rel_err": err,
                "tol": TOL[act],
                "ok": err <= TOL[act],
            }
        )
    results.extend(_cache_write_checks(device, seed))
    return results


def _cache_write_checks(device: torch.device, seed: int) -> list[dict]:
    from prefixserve.kernels import reference
    from prefixserve.kernels.triton.cache_write import write_kv_cache

    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    tokens, num_blocks = 300, 64
    for act, kv in (
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, FP8),
        (torch.bfloat16, FP8),
        (torch.float32, FP8),
    ):
        key = torch.randn((tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=device).to(act) * 3
        value = torch.randn((tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=device).to(act)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:tokens]
        slots[::7] = -1
        # Scales that make some values saturate and most land mid-range.
        k_scale, v_scale = reference.fp8_scale_for(key) * 0.6, reference.fp8_scale_for(value)
        caches = {}
        for name, fn in (("triton", write_kv_cache), ("reference", reference.write_kv_cache)):
            kc = torch.zeros((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=kv, device=device)
            vc = torch.zeros_like(kc)
            fn(key, value, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
            caches[name] = (kc.view(torch.uint8) if kv == FP8 else kc, vc.view(torch.uint8) if kv == FP8 else vc)
        mismatched = sum(int((a != b).sum()) for a, b in zip(caches["triton"], caches["reference"]))
        out.append(
            {
                "case": f"cache write {DTYPE_NAMES[act]} -> {DTYPE_NAMES[kv]} (bitwise)",
                "rel_err": float(mismatched),
                "tol": 0.0,
                "ok": mismatched == 0,
                "note": f"{mismatched} differing elements",
            }
        )
    return out


# --- 2. ceilings -------------------------------------------------------------------------


def ceilings(device: torch.device, timer: Callable) -> dict:
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9
    res = {"copy_GBps": copy_gbs}
    m = 8192
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.randn((m, m), device=device).to(dtype)
        b = torch.randn((m, m), device=device).to(dtype)
        res[f"matmul_{DTYPE_NAMES[dtype]}_TFLOPs"] = 2 * m**3 / (timer(lambda a=a, b=b: a @ b) * 1e-3) / 1e12
    return res


# --- peers (optional) --------------------------------------------------------------------


def _try_import(name: str):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - an optional peer that does not import is simply absent
        return None


def _peer(fn: Callable[[], float | None]) -> tuple[float | None, str]:
    """Run an optional peer's measurement; a failure is reported, never fatal."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {str(exc)[:80]}"


def _flashinfer_decode(flashinfer, inp: PagedInputs, act: torch.dtype, timer: Callable) -> float:
    b, nb = inp.block_tables.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inp.query.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(b + 1, dtype=torch.int32, device=inp.query.device) * nb
    indices = inp.block_tables.flatten()
    last = torch.full((b,), inp.lens[0] - (nb - 1) * BLOCK_SIZE, dtype=torch.int32, device=inp.query.device)
    wrapper.plan(
        indptr,
        indices,
        last,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        q_data_type=act,
        kv_data_type=inp.key_cache.dtype,
    )
    kv = (inp.key_cache, inp.value_cache)
    return timer(lambda: wrapper.run(inp.query, kv, k_scale=inp.k_scale, v_scale=inp.v_scale))


# --- 3. decode ---------------------------------------------------------------------------


def bench_decode(
    batch: int,
    context: int,
    act: torch.dtype,
    kv: torch.dtype,
    device: torch.device,
    seed: int,
    timer: Callable,
    peaks: dict,
) -> Row:
    from prefixserve.kernels.triton.paged_attention import paged_attention, paged_attention_planned, plan_launch

    case = f"B={batch} ctx={context / 1024:g}k {DTYPE_NAMES[act]}/{DTYPE_NAMES[kv]} KV"
    elem_kv = torch.finfo(kv).bits // 8
    need = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (elem_kv + torch.finfo(act).bits // 8)
    if device.type == "cuda" and need > 0.85 * torch.cuda.mem_get_info(device)[0]:
        return Row("decode", case, "skipped", note=f"needs {need / 1e9:.0f} GB")
    inp = make_inputs([(context - 1, 1)] * batch, act, kv, device, seed)
    scale = HEAD_DIM**-0.5
    kw = dict(scale=scale, k_scale=inp.k_scale, v_scale=inp.v_scale, out=torch.empty_like(inp.query))
    plan = plan_launch(batch, batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, context, act, device)
    nbytes = kv_bytes(inp)
    t = timer(lambda: paged_attention(*inp.args(), **kw))
    t_nosplit = None
    if plan.num_kv_splits > 1:
        flat = dataclasses.replace(plan, num_kv_splits=1)
        t_nosplit = timer(lambda: paged_attention_planned(flat, *inp.args(), **kw))
    gbs = nbytes / (t * 1e-3) / 1e9

    k, v = contiguous_kv(inp, act)  # [B, L, KVH, D]
    group = NUM_HEADS // NUM_KV_HEADS
    # One query token per sequence: the group's heads become SDPA's query rows, no mask needed.
    q4 = inp.query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kt, vt, scale=scale)  # noqa: E731
    t_sdpa = timer(sdpa)
    # The baseline must be the same attention: compare once (it never is for a wrong layout).
    same = _rel_err(kw["out"], sdpa().reshape(kw["out"].shape))
    sdpa_bytes = kv_bytes(inp, kv_element_size=k.element_size())
    row = Row(
        "decode",
        case,
        f"{gbs:.0f} GB/s ({t:.3f} ms, splits={plan.num_kv_splits})",
        of_peak=f"{gbs / peaks['copy_GBps']:.0%} of copy",
        sdpa=f"{sdpa_bytes / (t_sdpa * 1e-3) / 1e9:.0f} GB/s ({t_sdpa:.3f} ms)",
        ratio=f"{t_sdpa / t:.2f}x",
    )
    if t_nosplit is not None:
        row.note = f"no split: {nbytes / (t_nosplit * 1e-3) / 1e9:.0f} GB/s"
    if not same <= TOL[act]:
        row.note += f" SDPA output differs by {same:.1e}"
    fa = _try_import("flash_attn")
    if fa is not None:
        seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q_fa = inp.query.view(batch, 1, NUM_HEADS, HEAD_DIM)
        t_fa, err = _peer(
            lambda: timer(
                lambda: fa.flash_attn_with_kvcache(q_fa, k, v, cache_seqlens=seqlens, softmax_scale=scale, causal=True)
            )
        )
        row.flash_attn = f"{t_fa / t:.2f}x ({t_fa:.3f} ms)" if t_fa else err
    fi = _try_import("flashinfer")
    if fi is not None:
        t_fi, err = _peer(lambda: _flashinfer_decode(fi, inp, act, timer))
        row.flashinfer = f"{t_fi / t:.2f}x ({t_fi:.3f} ms)" if t_fi else err
    return row


# --- 4. prefill over a cached prefix -----------------------------------------------------


def bench_prefill(
    batch: int,
    prefix: int,
    chunk: int,
    act: torch.dtype,
    kv: torch.dtype,
    device: torch.device,
    seed: int,
    timer: Callable,
    peaks: dict,
) -> Row:
    from torch.nn.attention.bias import causal_lower_right

    from prefixserve.kernels.triton.paged_attention import paged_attention, plan_launch

    case = f"B={batch} prefix={prefix} chunk={chunk} {DTYPE_NAMES[act]}/{DTYPE_NAMES[kv]} KV"
    inp = make_inputs([(prefix, chunk)] * batch, act, kv, device, seed)
    scale = HEAD_DIM**-0.5
    kw = dict(scale=scale, k_scale=inp.k_scale, v_scale=inp.v_scale, out=torch.empty_like(inp.query))
    plan = plan_launch(
        len(inp.query), batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, inp.block_tables.shape[1] * BLOCK_SIZE, act, device
    )
    flops = attention_flops(inp.q_lens, inp.lens, NUM_HEADS, HEAD_DIM)
    t = timer(lambda: paged_attention(*inp.args(), **kw))
    tflops = flops / (t * 1e-3) / 1e12
    peak = peaks[f"matmul_{DTYPE_NAMES[act]}_TFLOPs"]

    k, v = contiguous_kv(inp, act)  # [B, L, KVH, D]
    group = NUM_HEADS // NUM_KV_HEADS
    q = inp.query.view(batch, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    # SDPA's fused kernels want equal head counts: expand K/V once, outside the timing.
    kx = k.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()  # [B, H, L, D]
    vx = v.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    mask = causal_lower_right(chunk, prefix + chunk)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, kx, vx, attn_mask=mask, scale=scale)

    t_sdpa = timer(sdpa)
    same = _rel_err(kw["out"], sdpa().transpose(1, 2).reshape(kw["out"].shape))
    row = Row(
        "prefill",
        case,
        f"{tflops:.0f} TFLOP/s ({t:.3f} ms, block_m={plan.block_m})",
        of_peak=f"{tflops / peak:.0%} of matmul",
        sdpa=f"{flops / (t_sdpa * 1e-3) / 1e12:.0f} TFLOP/s ({t_sdpa:.3f} ms)",
        ratio=f"{t_sdpa / t:.2f}x",
        note="" if same <= TOL[act] else f"SDPA output differs by {same:.1e}",
    )
    fa = _try_import("flash_attn")
    if fa is not None:
        q_fa = inp.query.view(batch, chunk, NUM_HEADS, HEAD_DIM)
        t_fa, err = _peer(lambda: timer(lambda: fa.flash_attn_func(q_fa, k, v, softmax_scale=scale, causal=True)))
        row.flash_attn = f"{t_fa / t:.2f}x ({t_fa:.3f} ms)" if t_fa else err
    return row


# --- 5. fused layer kernels --------------------------------------------------------------

# Llama-3.2-1B: hidden 2048, 32 query / 8 KV heads of 64, intermediate 8192, bf16.
LAYER_HIDDEN, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM, LAYER_INTER = 2048, 32, 8, 64, 8192
LAYER_DTYPE = torch.bfloat16
LAYER_TOKENS = (64, 4096)  # a decode batch, a prefill chunk
LAYER_EPS = 1e-5


@dataclass
class LayerInputs:
    """One step's activations for every layer op, and a paged cache holding its tokens."""

    x: torch.Tensor  # [T, hidden]
    residual: torch.Tensor  # [T, hidden]
    weight: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [T, (H + 2 KVH) * D], the qkv projection's output
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [max_pos, D/2]
    sin: torch.Tensor
    gate_up: torch.Tensor  # [T, 2 * inter]
    slot_mapping: torch.Tensor  # [T] int64, scattered slots
    num_blocks: int
    heads: int = LAYER_HEADS
    kv_heads: int = LAYER_KV_HEADS
    head_dim: int = LAYER_HEAD_DIM

    @property
    def qk(self) -> torch.Tensor:
        """q and k heads as the model rotates them: a strided view of ``qkv``."""
        return self.qkv[:, : (self.heads + self.kv_heads) * self.head_dim].unflatten(
            1, (self.heads + self.kv_heads, self.head_dim)
        )

    @property
    def value(self) -> torch.Tensor:
        return self.qkv[:, (self.heads + self.kv_heads) * self.head_dim :].unflatten(1, (self.kv_heads, self.head_dim))

    def caches(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
        return (
            torch.zeros(shape, dtype=dtype, device=self.x.device),
            torch.zeros(shape, dtype=dtype, device=self.x.device),
        )


def make_layer_inputs(
    tokens: int, dtype: torch.dtype, device: torch.device, seed: int, max_pos: int = 8192
) -> LayerInputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, LAYER_HEAD_DIM, 2, device=device).float() / LAYER_HEAD_DIM))
    angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    num_blocks = -(-tokens // BLOCK_SIZE) + 8
    return LayerInputs(
        x=randn(tokens, LAYER_HIDDEN, scale=4),
        residual=randn(tokens, LAYER_HIDDEN),
        weight=randn(LAYER_HIDDEN, scale=0.1) + 1,
        qkv=randn(tokens, (LAYER_HEADS + 2 * LAYER_KV_HEADS) * LAYER_HEAD_DIM, scale=3),
        positions=torch.randint(0, max_pos, (tokens,), generator=gen, device=device),
        cos=angles.cos().to(dtype),
        sin=angles.sin().to(dtype),
        gate_up=randn(tokens, 2 * LAYER_INTER, scale=4),
        slot_mapping=torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:tokens],
        num_blocks=num_blocks,
    )


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def layer_correctness(device: torch.device, seed: int) -> list[dict]:
    """Each Triton layer kernel against the torch reference on ``device``.

    RMSNorm and SiLU may differ by the two roundings to the dtype after an fp32 value
    that differs in its last bits (rtol 2 eps of the dtype; see tests/kernels/test_triton_layer_ops.py);
    the residual sum, rotary and everything the fused op stores must be identical.
    """
    from prefixserve.kernels import reference, reference_layer_ops
    from prefixserve.kernels.triton.layer_ops import TRITON_LAYER_OPS as T

    out = []

    def close(case: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
        finfo = torch.finfo(dtype)
        rtol = 1e-5 if dtype == torch.float32 else 2 * finfo.eps
        rel = float(((got.float() - ref.float()).abs() / (ref.float().abs() + finfo.tiny)).max())
        ok = torch.allclose(got.float(), ref.float(), rtol=rtol, atol=finfo.tiny)
        out.append({"case": case, "rel_err": rel, "tol": rtol, "ok": ok})

    def exact(case: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bad = sum(_mismatches(a, b) for a, b in pairs)
        out.append(
            {
                "case": case + " (bitwise)",
                "rel_err": float(bad),
                "tol": 0.0,
                "ok": bad == 0,
                "note": f"{bad} differing elements",
            }
        )

    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
        name = DTYPE_NAMES[dtype]
        inp = make_layer_inputs(300, dtype, device, seed + i, max_pos=4096)
        close(
            f"rms_norm {name}",
            T.rms_norm(inp.x, inp.weight, LAYER_EPS),
            reference_layer_ops.torch_rms_norm(inp.x, inp.weight, LAYER_EPS),
            dtype,
        )
        ref_out, ref_sum = reference_layer_ops.torch_add_rms_norm(inp.x, inp.residual, inp.weight, LAYER_EPS)
        got_out, got_sum = T.add_rms_norm(inp.x, inp.residual.clone(), inp.weight, LAYER_EPS)
        close(f"add_rms_norm {name}", got_out, ref_out, dtype)
        exact(f"add_rms_norm residual sum {name}", [(got_sum, ref_sum)])
        close(
            f"silu_and_mul {name}",
            T.silu_and_mul(inp.gate_up),
            reference_layer_ops.torch_silu_and_mul(inp.gate_up),
            dtype,
        )
        ref_qk = reference_layer_ops.torch_rotary(
            inp.qk.clone(), reference_layer_ops.torch_prepare_rotary(inp.positions, inp.cos, inp.sin)
        )
        prepared = T.prepare_rotary(inp.positions, inp.cos, inp.sin)
        exact(f"rotary {name}", [(T.rotary(inp.qk.clone(), prepared), ref_qk)])
        slots = inp.slot_mapping.clone()
        slots[::7] = -1  # padding tokens
        for cache_dtype in (dtype, FP8):
            k_scale = reference.fp8_scale_for(ref_qk[:, LAYER_HEADS:]) * 0.6 if cache_dtype == FP8 else 1.0
            v_scale = reference.fp8_scale_for(inp.value) if cache_dtype == FP8 else 1.0
            ref_caches, caches = inp.caches(cache_dtype), inp.caches(cache_dtype)
            reference.write_kv_cache(
                ref_qk[:, LAYER_HEADS:], inp.value, *ref_caches, slots, k_scale=k_scale, v_scale=v_scale
            )
            qk = inp.qk.clone()
            T.rotary_and_write_kv(qk, inp.value, prepared, *caches, slots, k_scale=k_scale, v_scale=v_scale)
            exact(
                f"rotary + KV write {name} -> {DTYPE_NAMES[cache_dtype]}",
                [(qk, ref_qk), (caches[0], ref_caches[0]), (caches[1], ref_caches[1])],
            )
    return out


def bench_layer_ops(tokens: int, device: torch.device, seed: int, timer: Callable, peaks: dict) -> list[Row]:
    """One row per fused layer kernel at ``tokens`` rows: Triton vs the torch reference chain."""
    from prefixserve.kernels import reference, reference_layer_ops
    from prefixserve.kernels.triton.cache_write import write_kv_cache
    from prefixserve.kernels.triton.layer_ops import TRITON_LAYER_OPS as T

    dtype = LAYER_DTYPE
    inp = make_layer_inputs(tokens, dtype, device, seed)
    e = torch.finfo(dtype).bits // 8
    hidden, heads, kvh, dim, inter = LAYER_HIDDEN, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM, LAYER_INTER
    qk, value = inp.qk, inp.value
    prepared = T.prepare_rotary(inp.positions, inp.cos, inp.sin)
    torch_prepared = reference_layer_ops.torch_prepare_rotary(inp.positions, inp.cos, inp.sin)
    # Bytes each operation must move at least (the norm weight and int64 index reads included).
    rotary_bytes = 2 * tokens * (heads + kvh) * dim * e + tokens * (8 + dim * e)
    cases: list[tuple[str, int, Callable[[], object], Callable[[], object], str]] = [
        (
            "rms_norm",
            2 * tokens * hidden * e + hidden * e,
            lambda: T.rms_norm(inp.x, inp.weight, LAYER_EPS),
            lambda: reference_layer_ops.torch_rms_norm(inp.x, inp.weight, LAYER_EPS),
            "",
        ),
        # Triton writes the running sum into the residual it is given: it grows each call (bf16: no overflow).
        (
            "add_rms_norm",
            4 * tokens * hidden * e + hidden * e,
            lambda: T.add_rms_norm(inp.x, inp.residual, inp.weight, LAYER_EPS),
            lambda: reference_layer_ops.torch_add_rms_norm(inp.x, inp.residual, inp.weight, LAYER_EPS),
            "",
        ),
        (
            "rotary q+k",
            rotary_bytes,
            lambda: T.rotary(qk, prepared),
            lambda: reference_layer_ops.torch_rotary(qk, torch_prepared),
            "",
        ),
        (
            "silu_and_mul",
            3 * tokens * inter * e,
            lambda: T.silu_and_mul(inp.gate_up),
            lambda: reference_layer_ops.torch_silu_and_mul(inp.gate_up),
            "",
        ),
    ]
    for cache_dtype in (dtype, FP8):
        caches = inp.caches(cache_dtype)
        scales = dict(k_scale=0.05, v_scale=0.02) if cache_dtype == FP8 else {}
        ec = torch.finfo(cache_dtype).bits // 8
        nbytes = rotary_bytes + tokens * kvh * dim * (e + 2 * ec) + 8 * tokens

        def fused(caches=caches, scales=scales) -> None:
            T.rotary_and_write_kv(qk, value, prepared, *caches, inp.slot_mapping, **scales)

        def torch_chain(caches=caches, scales=scales) -> None:
            k = reference_layer_ops.torch_rotary(qk, torch_prepared)[:, heads:]
            reference.write_kv_cache(k, value, *caches, inp.slot_mapping, **scales)

        def unfused(caches=caches, scales=scales) -> None:  # the CUDA model's path without the fused op
            k = reference_layer_ops.torch_rotary(qk, torch_prepared)[:, heads:]
            write_kv_cache(k, value, *caches, inp.slot_mapping, **scales)

        cases.append((f"rotary + KV write -> {DTYPE_NAMES[cache_dtype]}", nbytes, fused, torch_chain, unfused))
    rows = []
    for op, nbytes, ours, ref, extra in cases:
        t, t_ref = timer(ours), timer(ref)
        gbs = nbytes / (t * 1e-3) / 1e9
        row = Row(
            "layer",
            f"T={tokens} {op} {DTYPE_NAMES[dtype]}",
            f"{gbs:.0f} GB/s ({t:.3f} ms)",
            of_peak=f"{gbs / peaks['copy_GBps']:.0%} of copy",
            sdpa=f"{nbytes / (t_ref * 1e-3) / 1e9:.0f} GB/s ({t_ref:.3f} ms)",
            ratio=f"{t_ref / t:.2f}x",
        )
        if extra:
            t_extra = timer(extra)
            row.note = f"torch rotary + Triton cache write: {t_extra:.3f} ms ({t_extra / t:.2f}x)"
        rows.append(row)
    return rows


# --- driver ------------------------------------------------------------------------------


def render(rows: list[Row]) -> str:
    # Every ratio is the peer's time over Triton's: above 1 means Triton is faster. The
    # baseline is SDPA over non-paged K/V for attention, the torch reference chain for layer ops.
    header = (
        "part | case | Triton | vs ceiling | baseline: SDPA non-paged / torch ops | baseline / Triton time"
        " | flash-attn / Triton time | FlashInfer / Triton time | note"
    )
    # A "|" inside a cell would split it: the cells' own bars become slashes.
    cells = [[c.replace("|", "/") for c in dataclasses.astuple(r)] for r in rows]
    return markdown_table(header, cells)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.bench_kernels", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="batch 32 only, contexts 1k and 8k, one prefill case")
    ap.add_argument(
        "--layers-only",
        action="store_true",
        help="only the fused layer kernels (their checks, the ceilings, their rows)",
    )
    ap.add_argument("--json", action="store_true", help="print nothing; only write the JSON to --out")
    ap.add_argument("--out", type=Path, default=Path("results/bench_kernels.json"))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_kernels: TRITON_INTERPRET is set; unset it, this benchmark measures a real GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "bench_kernels: no CUDA device here; run it on a machine with an NVIDIA GPU "
            "(the kernels' CPU tests are tests/kernels/test_kernels.py)",
            file=sys.stderr,
        )
        return 2
    from tqdm import tqdm

    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    started = time.time()
    rows: list[Row] = []
    checks = [] if args.layers_only else correctness(device, args.seed)
    checks += layer_correctness(device, args.seed)
    for c in checks:
        verdict = "PASS" if c["ok"] else "FAIL"
        shown = c.get("note") or f"rel err {c['rel_err']:.2e} (tol {c['tol']:.0e})"
        rows.append(Row("correctness", c["case"], f"{verdict}: {shown}"))
    peaks = ceilings(device, _time_ms)
    rows.append(Row("ceiling", "device-to-device copy", f"{peaks['copy_GBps']:.0f} GB/s"))
    for name in ("fp16", "bf16"):
        rows.append(Row("ceiling", f"matmul 8192^3 {name}", f"{peaks[f'matmul_{name}_TFLOPs']:.0f} TFLOP/s"))

    batches = (32,) if args.quick else (32, 256)
    contexts = (1024, 8192) if args.quick else (1024, 4096, 16384, 32768)
    kv_kinds = ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8))
    decode_cases = [(b, c, a, k) for b in batches for c in contexts for a, k in kv_kinds]
    prefill_cases = [(1, 0, 4096), (4, 4096, 1024), (8, 16384, 512)]
    if args.quick:
        prefill_cases = prefill_cases[1:2]
    prefill_kinds = ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, FP8))
    work = [("decode", c) for c in decode_cases] + [
        ("prefill", (b, p, ch, a, k)) for b, p, ch in prefill_cases for a, k in prefill_kinds
    ]
    if args.layers_only:
        work = []
    work += [("layer", (tokens,)) for tokens in LAYER_TOKENS]
    for i, (kind, case) in enumerate(tqdm(work, desc="bench_kernels", unit="case", disable=args.json)):
        try:
            if kind == "layer":
                rows.extend(bench_layer_ops(*case, device=device, seed=args.seed + i, timer=_time_ms, peaks=peaks))
            else:
                fn = bench_decode if kind == "decode" else bench_prefill
                rows.append(fn(*case, device=device, seed=args.seed + i, timer=_time_ms, peaks=peaks))
        except torch.cuda.OutOfMemoryError:
            rows.append(Row(kind, str(case), "skipped", note="out of memory"))
        torch.cuda.empty_cache()

    table = render(rows)
    if not args.json:
        print(
            f"\n{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"triton {__import__('triton').__version__}, {time.time() - started:.0f} s\n"
        )
        print(table)
    write_json(
        args.out,
        {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "seed": args.seed,
            "shape": {
                "num_heads": NUM_HEADS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
            },
            "layer_shape": {
                "hidden": LAYER_HIDDEN,
                "num_heads": LAYER_HEADS,
                "num_kv_heads": LAYER_KV_HEADS,
                "head_dim": LAYER_HEAD_DIM,
                "intermediate": LAYER_INTER,
                "tokens": list(LAYER_TOKENS),
                "dtype": DTYPE_NAMES[LAYER_DTYPE],
            },
            "layers_only": args.layers_only,
            "correctness": checks,
            "ceilings": peaks,
            "rows": [dataclasses.asdict(r) for r in rows],
        },
        default=str,
        announce=not args.json,
    )
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
