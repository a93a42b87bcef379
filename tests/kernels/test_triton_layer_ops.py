"""The Triton layer kernels (kernels/triton/layer_ops.py) under TRITON_INTERPRET against the torch reference.

conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported, so the kernels
run on CPU tensors here; tests/kernels/kernel_compile_check.py compiles the same kernels for sm_90.

Tolerances. The kernels round to the activation dtype at the same points as the torch
chain (see the module docstring), so:
  * rotary and rotary + KV-cache write are compared bit for bit: every rounding is the
    same IEEE operation on the same values (products of two fp16/bf16 values are exact
    in float32), and the fp8 store is the cache write's e4m3 rounding;
  * the add of add_rms_norm is one rounding of the same sum: bit for bit;
  * RMSNorm's fp32 sum of squares is summed in another order (both pairwise-like,
    relative difference ~log2(hidden) fp32 ulps) and its rsqrt is numpy's, not torch's;
    SiLU's exp is numpy's, not torch's (each within ~1 fp32 ulp). A perturbation of a
    few fp32 ulps can move the normalised value (or silu(gate)) to the neighbouring
    fp16/bf16 value, 1 ulp = eps relative, and the following product rounds once more:
    at most 2 * eps of the dtype, relative. In fp32 itself the perturbation stays
    under 1e-5 (rms_norm) / 1e-6 (silu) relative. Outputs below the dtype's normal
    range are allowed its smallest normal as absolute error.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from prefixserve.kernels import reference, reference_layer_ops
from prefixserve.kernels.backends import select_backend
from prefixserve.kernels.reference_layer_ops import TORCH_LAYER_OPS
from prefixserve.kernels.triton.layer_ops import (
    TRITON_LAYER_OPS,
    triton_add_rms_norm,
    triton_prepare_rotary,
    triton_rms_norm,
    triton_rotary,
    triton_rotary_and_write_kv,
    triton_silu_and_mul,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = torch.float8_e4m3fn


def _tol(dtype: torch.dtype, fp32_rtol: float) -> dict[str, float]:
    """assert_close tolerances: two roundings in a 16-bit dtype, ``fp32_rtol`` in fp32 (see docstring)."""
    finfo = torch.finfo(dtype)
    rtol = fp32_rtol if dtype == torch.float32 else 2 * finfo.eps
    return dict(rtol=rtol, atol=finfo.tiny)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: compares NaN poison and fp8 codes exactly."""
    return t.contiguous().view(torch.uint8)


# --- RMSNorm ----------------------------------------------------------------------------------------

# (rows, hidden): one row, an odd hidden size, a full Llama-1B row, a row block padded
# 3000 -> 4096, and enough rows for several programs.
NORM_SHAPES = [(1, 64), (3, 77), (2, 2048), (5, 3000), (33, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", NORM_SHAPES)
def test_rms_norm_matches_torch(seed, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales: the norm must not be a no-op on the test data.
    x = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    x_before = x.clone()
    got = triton_rms_norm(x, weight, 1e-6)
    expected = reference_layer_ops.torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **_tol(dtype, 1e-5))
    assert torch.equal(x, x_before), "rms_norm wrote into its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", NORM_SHAPES)
def test_add_rms_norm_writes_the_sum_into_residual(seed, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    expected_out, expected_sum = reference_layer_ops.torch_add_rms_norm(x, residual, weight, 1e-5)
    out, total = triton_add_rms_norm(x, residual, weight, 1e-5)
    # One rounding of the same sum, in place: the residual stream itself now holds it.
    assert torch.equal(total, expected_sum)
    assert total.data_ptr() == residual.data_ptr() and torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, expected_out, **_tol(dtype, 1e-5))


def test_rms_norm_strided_rows_3d_input_and_promoted_weight(seed):
    """Rows that are a view into a wider tensor, leading dims [2, 3], and an fp32 weight
    on bf16 activations (the reference's output is then fp32)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 10:106].reshape(2, 3, 96)  # row stride 200
    residual = torch.randn(2, 3, 96, generator=gen).to(torch.bfloat16)
    weight = torch.randn(96, generator=gen)
    expected = reference_layer_ops.torch_rms_norm(x, weight, 1e-5)
    got = triton_rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 96)
    torch.testing.assert_close(got, expected, **_tol(torch.bfloat16, 1e-5))
    expected_out, expected_sum = reference_layer_ops.torch_add_rms_norm(x, residual, weight, 1e-5)
    out, total = triton_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_sum) and torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, expected_out, **_tol(torch.bfloat16, 1e-5))


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="does not match hidden size"):
        triton_rms_norm(x, torch.ones(65), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        triton_add_rms_norm(x, torch.randn(2, 64, dtype=torch.float16), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        triton_rms_norm(torch.randn(64, 2).t(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="must be one of"):
        triton_rms_norm(x.double(), torch.ones(64, dtype=torch.float64), 1e-5)


# --- rotary -----------------------------------------------------------------------------------------


def _rotary_tables(gen: torch.Generator, head_dim: int, dtype: torch.dtype, max_pos: int = 100):
    # Angles over several turns, as long contexts produce: every sign of cos/sin occurs.
    angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 40
    return angles.cos().to(dtype), angles.sin().to(dtype)


# (rows, heads, head_dim): a single token, q + k of Llama-1B (40 heads of 64), more heads
# than one program's tile (70 x 64, 40 x 80 with the half padded 40 -> 64), head_dim 96,
# 128 and the non-power-of-two 80.
ROTARY_SHAPES = [(1, 4, 64), (9, 40, 64), (5, 70, 64), (4, 40, 80), (3, 10, 96), (2, 3, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, heads, head_dim", ROTARY_SHAPES)
def test_rotary_is_bit_identical_to_torch_on_strided_rows(seed, dtype, rows, heads, head_dim):
    gen = torch.Generator().manual_seed(seed)
    cos, sin = _rotary_tables(gen, head_dim, dtype)
    positions = torch.randint(0, cos.shape[0], (rows,), generator=gen)
    # q and k as the model passes them: a view of the qkv projection, v's columns after it.
    qkv = (torch.randn(rows, (heads + 2) * head_dim, generator=gen) * 3).to(dtype)
    x = qkv[:, : heads * head_dim].unflatten(1, (heads, head_dim))
    untouched = qkv[:, heads * head_dim :].clone()
    expected = reference_layer_ops.torch_rotary(
        x.clone(), reference_layer_ops.torch_prepare_rotary(positions, cos, sin)
    )
    got = triton_rotary(x, triton_prepare_rotary(positions, cos, sin))
    assert got.data_ptr() == x.data_ptr(), "rotary is documented to rotate in place"
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched), "rotation wrote outside its heads"


def test_rotary_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    cos, sin = _rotary_tables(gen, 64, torch.float32)
    x = torch.randn(3, 2, 64)
    prepared = triton_prepare_rotary(torch.arange(3), cos, sin)
    with pytest.raises(ValueError, match="positions outside"):
        triton_prepare_rotary(torch.tensor([100]), cos, sin)
    with pytest.raises(ValueError, match="build them in x's dtype"):
        triton_rotary(x.half(), prepared)
    with pytest.raises(ValueError, match="do not match"):
        triton_rotary(torch.randn(3, 2, 32), prepared)
    with pytest.raises(ValueError, match="do not match"):
        triton_rotary(torch.randn(4, 2, 64), prepared)


# --- rotary + KV-cache write ------------------------------------------------------------------------


def _poisoned_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """NaN everywhere (0xff bytes: NaN in e4m3fn, fp32, fp16 and bf16), so stray writes show."""
    return torch.full((*shape[:-1], shape[-1] * dtype.itemsize), 0xFF, dtype=torch.uint8).view(dtype)


# (rows, heads, kv_heads, head_dim, block_size): one decode token, Llama-1B's 32/8 x 64,
# more query heads than one tile, MHA with head_dim 80, MQA with head_dim 96.
FUSED_SHAPES = [(1, 4, 2, 64, 16), (12, 32, 8, 64, 16), (7, 70, 2, 64, 8), (5, 6, 6, 80, 4), (9, 8, 1, 96, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, block_size", FUSED_SHAPES)
def test_rotary_and_write_kv_equals_rotary_then_reference_cache_write(
    seed, dtype, cache, rows, heads, kv_heads, head_dim, block_size
):
    _check_fused(seed, dtype, dtype if cache == "same" else FP8, rows, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16)],
    ids=str,
)
def test_rotary_and_write_kv_into_a_cache_of_another_dtype(seed, dtype, cache_dtype):
    _check_fused(seed, dtype, cache_dtype, 6, 8, 2, 64, 16, slot_dtype=torch.int32)


def _check_fused(
    seed: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    slot_dtype: torch.dtype = torch.int64,
) -> None:
    """The fused op vs ``torch_rotary`` + ``reference.write_kv_cache``: q, k and every cache byte."""
    gen = torch.Generator().manual_seed(seed)
    cos, sin = _rotary_tables(gen, head_dim, dtype)
    positions = torch.randint(0, cos.shape[0], (rows,), generator=gen)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].unflatten(1, (heads + kv_heads, head_dim))
    value = qkv[:, (heads + kv_heads) * head_dim :].unflatten(1, (kv_heads, head_dim))
    num_blocks = -(-rows // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[1::3] = -1  # padding tokens: rotated like the others, never cached
    slots = slots.to(slot_dtype)

    expected_qk = reference_layer_ops.torch_rotary(
        qk.clone(), reference_layer_ops.torch_prepare_rotary(positions, cos, sin)
    )
    shape = (num_blocks, block_size, kv_heads, head_dim)
    expected_caches = _poisoned_cache(shape, cache_dtype), _poisoned_cache(shape, cache_dtype)
    k_scale = v_scale = 1.0
    if cache_dtype == FP8:
        # Scales that saturate the largest K values and use all of V's range.
        k_scale = reference.fp8_scale_for(expected_qk[:, heads:]) * 0.6
        v_scale = reference.fp8_scale_for(value)
    reference.write_kv_cache(expected_qk[:, heads:], value, *expected_caches, slots, k_scale=k_scale, v_scale=v_scale)

    caches = _poisoned_cache(shape, cache_dtype), _poisoned_cache(shape, cache_dtype)
    v_before = value.clone()
    got = triton_rotary_and_write_kv(
        qk, value, triton_prepare_rotary(positions, cos, sin), *caches, slots, k_scale=k_scale, v_scale=v_scale
    )
    assert got.data_ptr() == qk.data_ptr()
    assert torch.equal(qk, expected_qk)
    assert torch.equal(value, v_before)
    for name, ours, ref in zip(("key", "value"), caches, expected_caches):
        mismatched = int((_bits(ours) != _bits(ref)).sum())
        assert mismatched == 0, f"{mismatched} {name} cache bytes differ from the reference"
    # The data is not degenerate: every cached token landed, and fp8 saturated some K.
    written = int((slots >= 0).sum())
    assert written > 0
    assert int((~torch.isnan(caches[0].float())).sum()) == written * kv_heads * head_dim
    if cache_dtype == FP8:
        assert (caches[0].float().abs() == 448).any()


def test_rotary_and_write_kv_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    cos, sin = _rotary_tables(gen, 64, torch.float32)
    prepared = triton_prepare_rotary(torch.arange(3), cos, sin)
    qk, value = torch.randn(3, 6, 64), torch.randn(3, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="key_cache and value_cache must both be"):
        triton_rotary_and_write_kv(
            qk, value, prepared, torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64), torch.arange(3)
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_rotary_and_write_kv(qk, value, prepared, cache, cache.clone(), torch.arange(4))
    with pytest.raises(ValueError, match="value must be"):
        triton_rotary_and_write_kv(qk, value.half(), prepared, cache, cache.clone(), torch.arange(3))
    with pytest.raises(ValueError, match="share one dtype"):
        triton_rotary_and_write_kv(qk, value, prepared, cache, cache.half(), torch.arange(3))


# --- SiLU and multiply ------------------------------------------------------------------------------

# (leading shape, intermediate): one row, an odd width, two column blocks with a masked
# tail (1100 = 1024 + 76), and [2, 3] leading dims.
SILU_SHAPES = [((1,), 64), ((7,), 45), ((4,), 1100), ((2, 3), 160)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, inter", SILU_SHAPES)
def test_silu_and_mul_matches_torch(seed, dtype, lead, inter):
    gen = torch.Generator().manual_seed(seed)
    # Gates well into both tails of the sigmoid (|x| up to ~25), as real activations reach.
    gate_up = (torch.randn(*lead, 2 * inter, generator=gen) * 6).to(dtype)
    got = triton_silu_and_mul(gate_up)
    expected = reference_layer_ops.torch_silu_and_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **_tol(dtype, 1e-6))


def test_silu_and_mul_reads_strided_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(5, 300, generator=gen).to(torch.float16) * 4
    gate_up = wide[:, :200]  # row stride 300
    torch.testing.assert_close(
        triton_silu_and_mul(gate_up), reference_layer_ops.torch_silu_and_mul(gate_up), **_tol(torch.float16, 1e-6)
    )


# --- dispatch and the model -------------------------------------------------------------------------


def test_each_backend_carries_its_layer_ops():
    triton_backend = select_backend("triton", "cpu", torch.bfloat16)
    assert triton_backend.layer_ops is TRITON_LAYER_OPS
    assert TRITON_LAYER_OPS.rotary_and_write_kv is triton_rotary_and_write_kv
    assert select_backend("torch", "cpu").layer_ops is TORCH_LAYER_OPS
    assert select_backend("auto", "cpu", torch.bfloat16).layer_ops is TORCH_LAYER_OPS
    assert TORCH_LAYER_OPS.rotary_and_write_kv is None


def test_cpu_backends_import_without_triton():
    """CPU-only installs: the dispatch, the torch backend and the C layer ops must not import triton."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # any 'import triton' now raises ImportError\n"
        "from prefixserve.kernels.backends import select_backend\n"
        "import prefixserve.kernels.cpu.layer_ops\n"
        "assert select_backend('torch').layer_ops.name == 'torch'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_with_triton_layer_ops_matches_torch_layer_ops(seed, dtype):
    """A 2-layer Llama (80-wide heads, GQA) on the Triton attention backend: a prefill step and a
    decode step with the Triton layer ops give the torch ops' hidden states and KV cache."""
    from transformers import LlamaConfig

    from prefixserve.replica.model.llama import AttentionMetadata, LlamaForCausalLM, ModelConfig

    hf = LlamaConfig(
        vocab_size=300,
        hidden_size=160,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=80,
        max_position_embeddings=256,
    )
    cfg = ModelConfig.from_hf(hf)
    backend = select_backend("triton", "cpu", dtype)
    gen = torch.Generator().manual_seed(seed)
    state = None
    results = {}
    for ops in (TORCH_LAYER_OPS, TRITON_LAYER_OPS):
        model = LlamaForCausalLM(cfg, max_model_len=256, backend=backend, dtype=dtype, ops=ops)
        if state is None:
            state = {
                name: (torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0)).to(dtype)
                for name, p in model.named_parameters()
            }
        model.load_state_dict(state, strict=False)
        shape = (8, 16, cfg.num_kv_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(2)]
        model.bind_kv_cache([k for k, _ in caches], [v for _, v in caches])
        # Step 1: prefill of two sequences (5 and 19 tokens); step 2: one decode token each.
        prefill = AttentionMetadata(
            slot_mapping=torch.cat([torch.arange(16, 21), torch.arange(48, 67)]),
            block_tables=torch.tensor([[1, 0], [3, 4]], dtype=torch.int32),
            seq_lens=torch.tensor([5, 19], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 5, 24], dtype=torch.int32),
        )
        ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(seed))
        positions = torch.cat([torch.arange(5), torch.arange(19)])
        with torch.no_grad():
            h1 = model(ids, positions, prefill)
            decode = AttentionMetadata(
                slot_mapping=torch.tensor([21, 67]),
                block_tables=prefill.block_tables,
                seq_lens=torch.tensor([6, 20], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            )
            h2 = model(ids[:2], torch.tensor([5, 19]), decode)
        results[ops.name] = (h1, h2, caches)
    (t1, t2, t_caches), (r1, r2, r_caches) = results["torch"], results["triton"]
    # Layer ops that differ by an ulp (see the module docstring) compound through two layers:
    # compare against the size of the hidden states, as the attention tests do.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for ours, ref in ((r1, t1), (r2, t2)):
        assert float((ours.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())
    for (rk, rv), (tk, tv) in zip(r_caches, t_caches):
        for ours, ref in ((rk, tk), (rv, tv)):
            assert float((ours.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())
