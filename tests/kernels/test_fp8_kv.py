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

import numpy as np
import pytest
import torch
from kernel_helpers import FP8, dense_attention, make_paged_batch, relative_error, run_cpu

from prefixserve.kernels import reference
from prefixserve.kernels.cpu import attention as cpu_attention
from prefixserve.kernels.cpu import library as cpu_library
from prefixserve.kernels.triton.cache_write import write_kv_cache as triton_write_kv_cache

C_KERNELS = pytest.mark.skipif(
    not cpu_library.available()[0], reason=f"C kernels unavailable: {cpu_library.available()[1]}"
)


# --- a pure-Python oracle -------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 15, code & 7
    v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
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
    out += [448.0, 449.0, 464.0, 464.0001, 479.0, 480.0, 1e6, 3e38, 2.0**-10, 2.0**-11, 1e-30, 0.0]
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
    padded[: len(values)] = values
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
    key, value = _rows(x[: len(x) // 2]), _rows(x[len(x) // 2 :])
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


@C_KERNELS
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 64, 32)])
@pytest.mark.parametrize("window", [None, 13])
def test_c_attention_reads_fp8_cache(seed, heads, kv_heads, head_dim, block_size, window):
    bs = block_size
    seqs = [(2 * bs - 1, 1), (0, 1), (bs + 5, 1), (bs + 3, bs + 7), (0, bs), (3, 29), (2 * bs + 3, 1)]
    batch = make_paged_batch(
        seed,
        seqs,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=bs,
        dtype=torch.float32,
        fp8_kv=True,
        share=(6, 3),
        padding_rows=2,
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=window, k_scale=batch.k_scale, v_scale=batch.v_scale)
    out = run_cpu(batch, **kw)
    rows = batch.num_tokens
    assert torch.isnan(out[rows:]).all()
    dense = dense_attention(batch, head_dim**-0.5, sliding_window=window)
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
        cpu_attention.write_kv_cache(
            key, key, torch.zeros(kc, dtype=FP8), torch.zeros(vc, dtype=FP8), torch.zeros(1), k_scale=0.0
        )


# --- the engine with kv_cache_dtype="fp8" ---------------------------------------------------


def _engine_prompts(seed: int) -> list[list[int]]:
    from model_helpers import random_prompts

    shared = random_prompts(np.random.default_rng(seed), 1, 40, 41)[0]
    return random_prompts(np.random.default_rng(seed + 1), 6, 5, 50, shared_prefix=shared)


def _greedy(llm, prompts) -> list[list[int]]:
    from prefixserve.replica.sampling_params import SamplingParams

    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]


def test_fp8_cache_holds_four_times_the_fp32_blocks(ckpt):
    from prefixserve.replica.entrypoints.llm import LLM

    budget = 3 << 20
    full = LLM(str(ckpt), kv_cache_memory_bytes=budget).engine.runner
    fp8 = LLM(str(ckpt), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8").engine.runner
    assert fp8.k_cache.dtype == fp8.v_cache.dtype == torch.float8_e4m3fn
    assert fp8.kv_bytes_per_block * 4 == full.kv_bytes_per_block  # float32 activations on CPU
    assert (fp8.num_blocks, full.num_blocks) == (budget // fp8.kv_bytes_per_block, budget // full.kv_bytes_per_block)
    assert fp8.k_cache.numel() * 1 + fp8.v_cache.numel() <= budget
    assert fp8.num_blocks >= 4 * full.num_blocks - 3


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=C_KERNELS)])
def test_fp8_engine_equals_fake_quantized_fp32_engine(ckpt, backend):
    """The fp8 engine computes exactly attention over K/V quantized with its scales: an fp32
    engine whose cache write rounds through fp8 and back (same scales) gives the same tokens."""
    import dataclasses

    from prefixserve.replica.entrypoints.llm import LLM

    prompts = _engine_prompts(3)
    fp8 = LLM(str(ckpt), num_kv_blocks=64, kv_cache_dtype="fp8", calculate_kv_scales=True, attention_backend=backend)
    got = _greedy(fp8, prompts)
    scales = fp8.engine.runner.model.kv_scales
    assert all(k != 1.0 and v != 1.0 and k > 0 and v > 0 for k, v in scales)

    fake = LLM(str(ckpt), num_kv_blocks=64, attention_backend="torch")

    def fake_write(key, value, key_cache, value_cache, slots, *, k_scale, v_scale):
        key = reference.quantize_fp8(key, k_scale).float() * k_scale
        value = reference.quantize_fp8(value, v_scale).float() * v_scale
        reference.write_kv_cache(key, value, key_cache, value_cache, slots)

    for layer, (k_scale, v_scale) in zip(fake.engine.runner.model.layers, scales, strict=True):
        attn = layer.self_attn
        attn.backend = dataclasses.replace(attn.backend, write_kv_cache=fake_write)
        attn.k_scale, attn.v_scale = k_scale, v_scale
    assert _greedy(fake, prompts) == got


def test_fp8_scales_from_the_checkpoint(ckpt, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from prefixserve.replica.entrypoints.llm import LLM

    with_scales = tmp_path / "with_scales"
    shutil.copytree(ckpt, with_scales)
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
            "model.layers.1.self_attn.kv_scale": torch.tensor([0.125]),
        },
        with_scales / "zz_kv_scales.safetensors",
    )
    fp8 = LLM(str(with_scales), num_kv_blocks=16, kv_cache_dtype="fp8_e4m3").engine.runner.model
    assert fp8.kv_scales == [(0.5, 0.25), (0.125, 0.125)]
    # calculate_kv_scales wins over the checkpoint (vLLM); an unquantized cache ignores them.
    calc = LLM(str(with_scales), num_kv_blocks=16, kv_cache_dtype="fp8", calculate_kv_scales=True)
    _greedy(calc, _engine_prompts(1)[:1])
    assert calc.engine.runner.model.kv_scales[0] != (0.5, 0.25)
    assert LLM(str(with_scales), num_kv_blocks=16).engine.runner.model.kv_scales == [(1.0, 1.0), (1.0, 1.0)]
    # No scales anywhere: 1.0.
    assert LLM(str(ckpt), num_kv_blocks=16, kv_cache_dtype="fp8").engine.runner.model.kv_scales == [(1.0, 1.0)] * 2


@C_KERNELS
def test_fp8_prefix_hits_and_copy_on_write(ckpt):
    """Prefix-cache hits and n > 1 forks (block copies of an fp8 cache) give the tokens of a fresh run."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    prompts = _engine_prompts(5)
    cold = _greedy(LLM(str(ckpt), num_kv_blocks=64, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts)
    warm = LLM(str(ckpt), num_kv_blocks=64, kv_cache_dtype="fp8")
    first = _greedy(warm, prompts)
    again = _greedy(warm, prompts)
    assert first == again == cold
    assert all(o.num_cached_tokens > 0 for o in warm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2)))
    forks = warm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=12, n=2))
    assert [[c.token_ids for c in o.outputs] for o in forks] == [[t, t] for t in cold[:2]]


@C_KERNELS
def test_c_fp8_cascade_decodes_sharing_blocks(seed):
    """Decodes sharing leading blocks are scored together (cascade) over fp8 blocks too."""
    bs = 16
    batch = make_paged_batch(
        seed,
        [(2 * bs + 5, 1), (2 * bs + 9, 1), (bs + 2, 1)],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=bs,
        dtype=torch.float32,
        fp8_kv=True,
        share=(1, 0),
    )
    assert torch.equal(batch.block_tables[0, :2], batch.block_tables[1, :2])
    out = run_cpu(batch, scale=64**-0.5, k_scale=batch.k_scale, v_scale=batch.v_scale)
    assert relative_error(out, dense_attention(batch, 64**-0.5)) < 1e-5
