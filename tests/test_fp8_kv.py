"""fp8 (e4m3) KV cache: the quantizing store of every writer (Triton under the
interpreter, the C kernel, the torch reference) bit for bit against a pure-Python
round-to-nearest-even oracle, and the C kernel's fp8 attention against the float64
dense oracle and the torch reference.

The store's test data is built from the e4m3 grid itself (every tie between two
neighbours, the floats just either side of it, subnormals, saturation) plus random
values under random scales: not data any of the writers was tuned on.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from prefixserve.kernels import cpu_attention, cpu_library, reference
from prefixserve.kernels.cache_write import write_kv_cache as triton_write_kv_cache
from tests.kernel_helpers import FP8, dense_attention, make_paged_batch, relative_error

C_KERNELS = pytest.mark.skipif(not cpu_library.available()[0],
                               reason=f"C kernels unavailable: {cpu_library.available()[1]}")


@pytest.fixture
def seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


# --- a pure-Python oracle -------------------------------------------------------------

def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 15, code & 7
    v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if code & 0x80 else v


POSITIVE_CODES = list(range(0x7F))  # 0x7f is NaN; 0x7e = 448 is the largest finite value
POSITIVE_VALUES = [_e4m3_value(c) for c in POSITIVE_CODES]


def oracle_code(y: float) -> int:
    """e4m3fn code of float ``y``: saturate to +-448, nearest value, ties to the even code."""
    if y != y:
        return 0x7F
    sign = 0x80 if (y < 0 or (y == 0 and struct.pack(">f", y)[0] & 0x80)) else 0
    a = min(abs(y), 448.0)
    best = min(POSITIVE_CODES, key=lambda c: (abs(POSITIVE_VALUES[c] - a), c & 1))
    return best | sign


def grid_probe_values() -> np.ndarray:
    """Every tie between neighbouring e4m3 values, the float32 neighbours of each tie,
    every e4m3 value itself, values past the range, signed."""
    f32 = np.float32
    out: list[float] = []
    for lo, hi in zip(POSITIVE_VALUES, POSITIVE_VALUES[1:], strict=False):
        mid = f32((lo + hi) / 2)
        out += [lo, mid, np.nextafter(mid, f32(0)), np.nextafter(mid, f32(1e9))]
    out += [448.0, 449.0, 464.0, 464.0001, 479.0, 480.0, 1e6, 3e38, 2.0 ** -10, 2.0 ** -11, 1e-30, 0.0]
    values = np.array(out, dtype=np.float32)
    return np.concatenate([values, -values])


def random_values(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-12, 8, n))).astype(np.float32)


# --- the writers, with one cache layout each ------------------------------------------

def _store(writer: str, key: torch.Tensor, value: torch.Tensor, k_scale: float, v_scale: float):
    """Store [T, KVH, D] rows in slots 0..T-1 of fresh fp8 caches; return the K and V bytes [T, KVH, D]."""
    t, kvh, d = key.shape
    if writer == "c":
        # block_size 1: the C layouts [NB, KVH, D, 1] / [NB, KVH, 1, D] are [T, KVH, D] in memory.
        kc, vc = cpu_attention.kv_cache_shape(t, 1, kvh, d)
        caches = torch.zeros(kc, dtype=FP8), torch.zeros(vc, dtype=FP8)
        cpu_attention.write_kv_cache(key, value, *caches, torch.arange(t), k_scale=k_scale, v_scale=v_scale)
    else:
        caches = torch.zeros(t, 1, kvh, d, dtype=FP8), torch.zeros(t, 1, kvh, d, dtype=FP8)
        fn = triton_write_kv_cache if writer == "triton" else reference.write_kv_cache
        fn(key, value, *caches, torch.arange(t), k_scale=k_scale, v_scale=v_scale)
    return tuple(c.view(torch.uint8).reshape(t, kvh, d) for c in caches)


def _rows(values: np.ndarray, kvh: int = 2, d: int = 64) -> torch.Tensor:
    per_token = kvh * d
    padded = np.zeros(-(-len(values) // per_token) * per_token, dtype=np.float32)
    padded[:len(values)] = values
    return torch.from_numpy(padded).view(-1, kvh, d)


WRITERS = ["reference", "triton", pytest.param("c", marks=C_KERNELS)]


@pytest.mark.parametrize("writer", WRITERS)
def test_fp8_store_rounds_ties_to_even_and_saturates(writer):
    probes = grid_probe_values()
    key = _rows(probes)
    value = -key
    k_bytes, v_bytes = _store(writer, key, value, 1.0, 1.0)
    expected_k = torch.tensor([oracle_code(float(y)) for y in key.flatten()], dtype=torch.uint8)
    expected_v = torch.tensor([oracle_code(float(y)) for y in value.flatten()], dtype=torch.uint8)
    assert torch.equal(k_bytes.flatten(), expected_k)
    assert torch.equal(v_bytes.flatten(), expected_v)


@pytest.mark.parametrize("writer", WRITERS)
def test_fp8_store_with_scales_matches_oracle(seed, writer):
    x = random_values(seed, 2 * 2 * 64 * 6)
    key, value = _rows(x[: len(x) // 2]), _rows(x[len(x) // 2:])
    rng = np.random.default_rng(seed + 1)
    k_scale, v_scale = float(rng.uniform(1e-3, 3)), float(rng.uniform(1e-3, 3))
    k_bytes, v_bytes = _store(writer, key, value, k_scale, v_scale)
    for stored, rows, scale in ((k_bytes, key, k_scale), (v_bytes, value, v_scale)):
        y = rows.numpy().flatten() / np.float32(scale)  # float32 IEEE division, as every writer does
        expected = torch.tensor([oracle_code(float(v)) for v in y], dtype=torch.uint8)
        assert torch.equal(stored.flatten(), expected)


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16])
def test_triton_fp8_store_from_half_inputs_equals_reference(seed, src_dtype):
    gen = torch.Generator().manual_seed(seed)
    key = (torch.randn(9, 3, 32, generator=gen) * 40).to(src_dtype)
    value = torch.randn(9, 3, 32, generator=gen).to(src_dtype)
    ours = _store("triton", key, value, 0.07, 0.003)
    ref = _store("reference", key, value, 0.07, 0.003)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


# --- the C kernel's fp8 attention ---------------------------------------------------------

def _cpu_layout(cache: torch.Tensor, kind: str) -> torch.Tensor:
    return (cache.permute(0, 2, 3, 1) if kind == "key" else cache.permute(0, 2, 1, 3)).contiguous()


@C_KERNELS
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 64, 32)])
@pytest.mark.parametrize("window", [None, 13])
def test_c_attention_reads_fp8_cache(seed, heads, kv_heads, head_dim, block_size, window):
    bs = block_size
    seqs = [(2 * bs - 1, 1), (0, 1), (bs + 5, 1), (bs + 3, bs + 7), (0, bs), (3, 29), (2 * bs + 3, 1)]
    batch = make_paged_batch(seed, seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             block_size=bs, dtype=torch.float32, fp8_kv=True, share=(6, 3), padding_rows=2)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, k_scale=batch.k_scale, v_scale=batch.v_scale)
    out = torch.full(batch.query.shape, float("nan"))
    cpu_attention.paged_attention(batch.query, _cpu_layout(batch.key_cache, "key"),
                                  _cpu_layout(batch.value_cache, "value"), batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, out=out, **kw)
    rows = batch.num_tokens
    assert torch.isnan(out[rows:]).all()
    dense = dense_attention(batch, head_dim ** -0.5, sliding_window=window)
    assert relative_error(out[:rows], dense[:rows]) < 1e-5
    ref = reference.paged_attention(*batch.args(), **kw)
    assert relative_error(out[:rows], ref[:rows].double()) < 1e-5


@C_KERNELS
def test_c_fp8_refuses_mixed_or_unscaled_caches():
    kc, vc = cpu_attention.kv_cache_shape(2, 16, 1, 16)
    key = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="share one dtype"):
        cpu_attention.write_kv_cache(key, key, torch.zeros(kc, dtype=FP8), torch.zeros(vc), torch.zeros(1))
    with pytest.raises(ValueError, match="positive"):
        cpu_attention.write_kv_cache(key, key, torch.zeros(kc, dtype=FP8), torch.zeros(vc, dtype=FP8),
                                     torch.zeros(1), k_scale=0.0)
