"""Paged batches with their un-paged K/V, and dense attention over the latter.

The oracle here shares no code with kernels/: it keeps each sequence's K/V as a
plain ``[seq_len, num_kv_heads, head_dim]`` tensor, scatters it into a cache by a
random block assignment, and computes attention in float64 with an explicit mask.
Every cache slot no sequence owns (tails of last blocks, the block unused table
entries point at) holds NaN, so a kernel that reads past a sequence fails.

Also :func:`run_cpu`: the C kernel over a batch, in its own cache layout; and
:func:`torch_threads`: a block run on a given number of torch threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class PagedBatch:
    """Inputs of ``paged_attention`` plus the dense K/V they were built from."""

    query: torch.Tensor  # [num_tokens + padding_rows, H, D]
    key_cache: torch.Tensor  # [NB, BS, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    keys: list[torch.Tensor]  # per sequence, float64 [seq_len, KVH, D], dequantized
    values: list[torch.Tensor]
    q_lens: list[int]
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query_start_loc)


def _fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def make_paged_batch(
    seed: int,
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    fp8_kv: bool = False,
    share: tuple[int, int] | None = None,
    padding_rows: int = 0,
    spare_blocks: int = 2,
) -> PagedBatch:
    """A batch of sequences given as ``(cached_context_len, new_tokens)``.

    ``share=(i, j)``: sequence ``i`` reuses the physical blocks (and contents) of
    sequence ``j`` for the full blocks both cover, as prefix caching does.
    ``padding_rows`` extra query rows follow the last sequence's tokens.
    """
    if share is not None and share[0] <= share[1]:
        raise ValueError("share=(i, j) needs j < i so j's blocks exist first")
    gen = torch.Generator().manual_seed(seed)
    lens = [c + q for c, q in seqs]
    kv_store = FP8 if fp8_kv else dtype
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lens]
    shared_blocks = 0
    if share is not None:
        i, j = share
        shared_blocks = min(lens[i], lens[j]) // block_size
        keys[i][: shared_blocks * block_size] = keys[j][: shared_blocks * block_size]
        values[i][: shared_blocks * block_size] = values[j][: shared_blocks * block_size]
    k_scale = v_scale = 1.0
    if fp8_kv:
        # Scales that are not 1 and leave headroom, so scaling bugs show.
        k_scale = max(float(k.abs().max()) for k in keys) / (0.8 * FP8_MAX)
        v_scale = max(float(v.abs().max()) for v in values) / (0.5 * FP8_MAX)
        stored_k = [_fp8_quantize(k, k_scale) for k in keys]
        stored_v = [_fp8_quantize(v, v_scale) for v in values]
        dense_k = [k.double() * k_scale for k in stored_k]
        dense_v = [v.double() * v_scale for v in stored_v]
    else:
        stored_k = [k.to(dtype) for k in keys]
        stored_v = [v.to(dtype) for v in values]
        dense_k = [k.double() for k in stored_k]
        dense_v = [v.double() for v in stored_v]

    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) - shared_blocks + spare_blocks + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    poison, free = ids[0], iter(ids[1:])
    max_blocks = max(blocks_per_seq) + 1
    tables = [[poison] * max_blocks for _ in seqs]
    for s, nb in enumerate(blocks_per_seq):
        for b in range(nb):
            reuse = share is not None and s == share[0] and b < shared_blocks
            tables[s][b] = tables[share[1]][b] if reuse else next(free)

    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(kv_store)
    value_cache = torch.full_like(key_cache, float("nan"))
    for s, n in enumerate(lens):
        pos = torch.arange(n)
        phys = torch.tensor(tables[s])[pos // block_size]
        key_cache[phys, pos % block_size] = stored_k[s]
        value_cache[phys, pos % block_size] = stored_v[s]

    q_lens = [q for _, q in seqs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1] + padding_rows, num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        keys=dense_k,
        values=dense_v,
        q_lens=q_lens,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def dense_attention(batch: PagedBatch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """float64 causal attention from the un-paged K/V; padding rows are NaN."""
    num_heads = batch.query.shape[1]
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.float64)
    start = 0
    for q_len, k, v in zip(batch.q_lens, batch.keys, batch.values):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = batch.query[start : start + q_len].double().transpose(0, 1)  # [H, q, D]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = (scores.softmax(-1) @ v).transpose(0, 1)
        start += q_len
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` over the rows ``expected`` defines (NaN if any is missing)."""
    rows = ~torch.isnan(expected).flatten(1).any(1)
    a, e = actual[rows].double(), expected[rows].double()
    if torch.isnan(a).any():
        return float("nan")
    return float((a - e).abs().max() / e.abs().max())


def to_cpu_layout(cache: torch.Tensor, kind: str) -> torch.Tensor:
    """[NB, BS, KVH, D] -> the C kernel's layout (keys [NB, KVH, D, BS], values [NB, KVH, BS, D])."""
    return (cache.permute(0, 2, 3, 1) if kind == "key" else cache.permute(0, 2, 1, 3)).contiguous()


def run_cpu(batch: PagedBatch, query: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
    """The C kernel's attention over ``batch`` (scale 1/sqrt(head_dim) unless ``kw`` gives one) into
    an output of NaN, so that rows no sequence owns stay NaN."""
    from prefixserve.kernels.cpu import attention as cpu_attention

    query = batch.query if query is None else query
    kw.setdefault("scale", batch.query.shape[-1] ** -0.5)
    return cpu_attention.paged_attention(
        query,
        to_cpu_layout(batch.key_cache, "key"),
        to_cpu_layout(batch.value_cache, "value"),
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        out=torch.full(batch.query.shape, float("nan")),
        **kw,
    )


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch (OpenMP) threads, the count before restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
