"""Torch reference implementations of the paged-attention kernels.

These are the CPU path of the engine and the oracle the Triton kernels are tested
against, so they favour clarity and vectorised gathers over speed tricks. Both
functions share their signatures with the Triton versions in this package.

Layouts (the contract every kernel in this package follows):
  query            [num_tokens, num_heads, head_dim]       tokens of all sequences, packed
  key/value cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables     [num_seqs, max_blocks] int32            logical -> physical block
  seq_lens         [num_seqs] int32                        total tokens of each sequence,
                                                           the new (query) tokens included
  query_start_loc  [num_seqs + 1] int32                    query rows of sequence s are
                                                           query_start_loc[s]:query_start_loc[s+1]
The new tokens of a sequence are its last ``q_len`` positions, so the query at row
``i`` of sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends to
keys ``0..position`` (``position - sliding_window < key`` with a window).

No torch.distributed, no knowledge of requests: pure tensor functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn,)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``x / scale`` rounded to nearest-even in ``dtype``, saturated to its finite range.

    The division is float32 ``x / scale`` correctly rounded on every device: the scale is
    a tensor on ``x``'s device, since CUDA torch turns division by a CPU scalar into a
    multiplication by its reciprocal (a different rounding, which made one element of
    the Triton store differ from this reference on a GPU). The Triton and C stores
    round exactly like this.
    """
    fp8_max = float(torch.finfo(dtype).max)
    divisor = torch.full((), float(scale), dtype=torch.float32, device=x.device)
    return torch.div(x.float(), divisor).clamp(-fp8_max, fp8_max).to(dtype)


def fp8_scale_for(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Per-tensor scale that maps ``max |x|`` onto the fp8 range (1.0 for an all-zero ``x``)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / float(torch.finfo(dtype).max) if amax > 0 else 1.0


def _dequantize(cache_rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if cache_rows.dtype in FP8_DTYPES:
        return (cache_rows.to(torch.float32) * scale).to(dtype)
    return cache_rows.to(dtype)


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
    """Store new tokens' K/V ([num_tokens, num_kv_heads, head_dim]) into their slots.

    ``slot = block_id * block_size + offset_in_block``; negative slots are padding
    and are skipped. An fp8 cache stores ``x / scale`` saturated to the fp8 range.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    if key_cache.dtype in FP8_DTYPES:
        key = quantize_fp8(key, k_scale, key_cache.dtype)
        value = quantize_fp8(value, v_scale, value_cache.dtype)
    flat_k[slots] = key.to(key_cache.dtype)
    flat_v[slots] = value.to(value_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence, ``[length, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    # index_select, not advanced indexing: several times faster on CPU for a few rows.
    blocks = cache.index_select(0, block_row[:num_blocks].long())  # [nb, bs, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


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
    """Causal attention of packed queries over paged K/V; returns ``[num_tokens, num_heads, head_dim]``.

    One SDPA call per sequence over exactly its own context (no padding, so slots
    past a sequence's end are never read). GQA folds each KV head's group of query
    heads into the query-length axis (``[KVH, G*q, D]`` against ``[KVH, L, D]``):
    K/V are never expanded, and the 4-D call takes CPU SDPA's fused kernel, which
    ``enable_gqa`` and 3-D inputs do not. A one-token query without a window
    needs no mask at all (it sees its whole context).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    dtype = query.dtype
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.long()
    for s, length in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _dequantize(_gather_kv(key_cache, tables[s], length), k_scale, dtype).transpose(0, 1)  # [KVH, L, D]
        v = _dequantize(_gather_kv(value_cache, tables[s], length), v_scale, dtype).transpose(0, 1)
        # [q, H, D] -> [KVH, G*q, D], rows ordered (g, i): query head h = kvh * G + g.
        q = query[q_start:q_end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(1, num_kv_heads, group * q_len, head_dim)
        mask = None
        if q_len > 1 or sliding_window is not None:
            q_pos = torch.arange(length - q_len, length, device=query.device).unsqueeze(1)
            k_pos = torch.arange(length, device=query.device).unsqueeze(0)
            mask = k_pos <= q_pos  # [q, L]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            mask = mask.repeat(group, 1)  # [G*q, L], matching the folded rows
        o = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale)
        # [1, KVH, G*q, D] -> [q, H, D]
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim)
    return out
