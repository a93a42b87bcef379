"""The C kernels for CPUs (kernels/cpu/): paged attention and cache write against the
float64 dense oracle of kernel_helpers (NaN in every slot no sequence owns, NaN in
every output row no sequence owns), the fused layer ops against their torch
reference, the packed-weight linears against F.linear, and the fallback when no C
compiler is there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import dense_attention, make_paged_batch, relative_error, run_cpu, to_cpu_layout, torch_threads

from prefixserve.kernels import reference, reference_layer_ops
from prefixserve.kernels.backends import select_backend
from prefixserve.kernels.cpu import attention as cpu_attention
from prefixserve.kernels.cpu import layer_ops as cpu_layer_ops
from prefixserve.kernels.cpu import library as cpu_library
from prefixserve.replica.entrypoints.llm import LLM

pytestmark = pytest.mark.skipif(
    not cpu_library.available()[0], reason=f"C kernels unavailable: {cpu_library.available()[1]}"
)
REPO = Path(__file__).resolve().parents[2]


def mixed(bs: int) -> list[tuple[int, int]]:
    """(cached context, new tokens): decodes on and off block boundaries, a first token,
    prefill chunks over a cached prefix, a fresh prefill, a long prefill (several query
    tiles), and a decode sharing blocks with sequence 3."""
    return [(2 * bs - 1, 1), (0, 1), (bs + 5, 1), (bs + 3, bs + 7), (0, bs), (3, 61), (2 * bs + 3, 1)]


SHAPES = [
    # heads, kv heads, head dim, block size: GQA 3 (SmolLM2), MHA, MQA with a 48-row group,
    # a head dim that is no multiple of 16, blocks smaller than a 16-key chunk, and large blocks.
    (9, 3, 64, 16),
    (4, 4, 32, 16),
    (48, 1, 16, 32),
    (6, 2, 40, 8),
    (8, 2, 64, 1),
    (4, 2, 128, 128),
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_matches_dense(seed, heads, kv_heads, head_dim, block_size, window):
    batch = make_paged_batch(
        seed,
        mixed(block_size),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        share=(6, 3),
        padding_rows=3,
    )
    out = run_cpu(batch, sliding_window=window)
    expected = dense_attention(batch, head_dim**-0.5, sliding_window=window)
    rows = batch.num_tokens
    assert torch.isnan(out[rows:]).all(), "a padding row was written"
    assert relative_error(out[:rows], expected[:rows]) < 1e-5


def test_decodes_sharing_blocks_are_grouped_and_exact(seed):
    """The cascade path: decodes sharing leading blocks (20 on one prompt, more than one
    group holds; forked twins sharing all their blocks, the last one partly filled;
    three that share one block) next to a lone decode and a prefill chunk on the prompt.
    Every slot no sequence owns is NaN; the oracle is float64 attention per sequence."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    prompt = torch.randn(40, 2, kv_heads, head_dim, generator=gen)  # K and V of a 40-token prompt
    seqs: list[tuple[torch.Tensor, int]] = []  # (K/V of the whole sequence, new tokens)
    for _ in range(20):
        own = int(torch.randint(1, 30, (1,), generator=gen))
        seqs.append((torch.cat([prompt[:32], torch.randn(own, 2, kv_heads, head_dim, generator=gen)]), 1))
    twin = torch.randn(40, 2, kv_heads, head_dim, generator=gen)
    seqs += [(twin, 1), (twin, 1)]  # forked twins: all three blocks shared, the last one 8 of 16 slots full
    other = torch.randn(16, 2, kv_heads, head_dim, generator=gen)
    for own in (5, 17, 2):
        seqs.append((torch.cat([other, torch.randn(own, 2, kv_heads, head_dim, generator=gen)]), 1))
    seqs.append((torch.randn(23, 2, kv_heads, head_dim, generator=gen), 1))  # lone decode
    seqs.append((torch.cat([prompt[:32], torch.randn(20, 2, kv_heads, head_dim, generator=gen)]), 20))  # prefill

    # Physical blocks: the prompt's first two, the twins' third and `other` are shared.
    next_block = iter(torch.randperm(200, generator=gen).tolist())
    prompt_blocks = [next(next_block) for _ in range(2)]
    twin_blocks = [next(next_block) for _ in range(3)]
    other_block = next(next_block)
    tables = []
    for i, (kv, _) in enumerate(seqs):
        nb = -(-kv.shape[0] // bs)
        if 20 <= i < 22:
            table = twin_blocks
        elif 22 <= i < 25:
            table = [other_block] + [next(next_block) for _ in range(nb - 1)]
        elif i == 25:
            table = [next(next_block) for _ in range(nb)]
        else:
            table = prompt_blocks[:2] + [next(next_block) for _ in range(nb - 2)]
        tables.append(table)
    width = max(map(len, tables))
    key_cache = torch.full((200, bs, kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    for (kv, _), table in zip(seqs, tables):
        pos = torch.arange(kv.shape[0])
        phys = torch.tensor(table)[pos // bs]
        key_cache[phys, pos % bs] = kv[:, 0]
        value_cache[phys, pos % bs] = kv[:, 1]
    q_lens = [n for _, n in seqs]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), heads, head_dim, generator=gen)
    out = cpu_attention.paged_attention(
        query,
        to_cpu_layout(key_cache, "key"),
        to_cpu_layout(value_cache, "value"),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([kv.shape[0] for kv, _ in seqs], dtype=torch.int32),
        starts,
        scale=head_dim**-0.5,
    )

    for i, (kv, q_len) in enumerate(seqs):
        k = kv[:, 0].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, L, D]
        v = kv[:, 1].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        q = query[int(starts[i]) : int(starts[i + 1])].double().transpose(0, 1)  # [H, q, D]
        scores = q @ k.transpose(1, 2) * head_dim**-0.5
        length = kv.shape[0]
        causal = torch.arange(length)[None, :] <= torch.arange(length - q_len, length)[:, None]
        expected = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        assert relative_error(out[int(starts[i]) : int(starts[i + 1])], expected) < 1e-5, f"sequence {i}"


@pytest.mark.parametrize("threads", [2, 3, 4, 8])
def test_a_group_split_into_parts_for_the_threads_gives_the_same_bits(threads):
    """Eight decodes on one prompt are one group: 3 tasks over 3 KV heads, fewer than the
    threads can balance, so the group runs in parts: the output equals the one-thread run's
    (to rounding: a part's last rows are scored outside the four-row path, summing the
    dimensions in another order) and the oracle."""
    gen = torch.Generator().manual_seed(threads)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    prompt = torch.randn(32, 2, kv_heads, head_dim, generator=gen)
    seqs = [torch.cat([prompt, torch.randn(int(n), 2, kv_heads, head_dim, generator=gen)]) for n in range(3, 11)]
    key_cache = torch.full((64, bs, kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    free = iter(range(2, 64))
    tables = [[0, 1] + [next(free) for _ in range(-(-kv.shape[0] // bs) - 2)] for kv in seqs]
    for kv, table in zip(seqs, tables):
        pos = torch.arange(kv.shape[0])
        phys = torch.tensor(table)[pos // bs]
        key_cache[phys, pos % bs], value_cache[phys, pos % bs] = kv[:, 0], kv[:, 1]
    query = torch.randn(len(seqs), heads, head_dim, generator=gen)
    args = (
        query,
        to_cpu_layout(key_cache, "key"),
        to_cpu_layout(value_cache, "value"),
        torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([kv.shape[0] for kv in seqs], dtype=torch.int32),
        torch.arange(len(seqs) + 1, dtype=torch.int32),
    )
    with torch_threads(1):
        alone = cpu_attention.paged_attention(*args, scale=head_dim**-0.5)
    with torch_threads(threads):
        split = cpu_attention.paged_attention(*args, scale=head_dim**-0.5)
    assert torch.allclose(alone, split, rtol=0, atol=1e-6)
    for i, kv in enumerate(seqs):
        k = kv[:, 0].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = kv[:, 1].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = ((query[i].double()[:, None] @ k.transpose(1, 2)).squeeze(1) * head_dim**-0.5).softmax(-1)
        assert relative_error(split[i], (expected[:, None] @ v).squeeze(1)) < 1e-5, f"sequence {i}"


def test_paged_attention_reads_strided_query_rows(seed):
    """q as a view into a wider per-token row (the fused qkv output) gives the same result."""
    batch = make_paged_batch(
        seed, mixed(16), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, share=(6, 3)
    )
    wide = torch.randn(batch.query.shape[0], 15, 64)
    wide[:, :9] = batch.query
    strided = wide[:, :9]
    assert not strided.is_contiguous()
    assert torch.equal(run_cpu(batch, query=strided), run_cpu(batch))


def test_paged_attention_rejects_what_it_cannot_run(seed):
    batch = make_paged_batch(
        seed, [(3, 2)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )
    k, v = to_cpu_layout(batch.key_cache, "key"), to_cpu_layout(batch.value_cache, "value")
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.paged_attention(batch.query.half(), k, v, *args, scale=0.25)
    with pytest.raises(ValueError, match="do not match"):
        cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, *args, scale=0.25)
    with pytest.raises(ValueError, match="fp8"):
        cpu_attention.paged_attention(batch.query, k, v, *args, scale=0.25, k_scale=2.0)


def test_write_kv_cache_matches_reference_layout(seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, bs, kvh, d = 5, 8, 2, 24
    k_ref = torch.zeros(num_blocks, bs, kvh, d)
    v_ref = torch.zeros_like(k_ref)
    kc, vc = cpu_attention.kv_cache_shape(num_blocks, bs, kvh, d)
    k_cpu, v_cpu = torch.zeros(kc), torch.zeros(vc)
    # Strided token rows, as the model passes views of its qkv output; slot -1 is padding.
    qkv = torch.randn(7, 3 * kvh * d, generator=gen)
    key = qkv[:, kvh * d : 2 * kvh * d].unflatten(1, (kvh, d))
    value = qkv[:, 2 * kvh * d :].unflatten(1, (kvh, d))
    slots = torch.tensor([0, 9, 17, -1, 39, 8, 23])
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    cpu_attention.write_kv_cache(key, value, k_cpu, v_cpu, slots)
    assert torch.equal(k_cpu, to_cpu_layout(k_ref, "key"))
    assert torch.equal(v_cpu, to_cpu_layout(v_ref, "value"))
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_attention.write_kv_cache(key, value, k_cpu, v_cpu, torch.tensor([0, 1, 2, 3, 4, 5, 40]))


# --- fused layer ops ------------------------------------------------------------------


@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 72), (300, 64)])
def test_rms_norm_and_residual_add_match_torch(seed, rows, hidden):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, hidden, generator=gen) for _ in range(2))
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(
        cpu_layer_ops.c_rms_norm(x, weight, 1e-5), reference_layer_ops.torch_rms_norm(x, weight, 1e-5)
    )
    expected_out, expected_sum = reference_layer_ops.torch_add_rms_norm(x, residual, weight, 1e-5)
    out, total = cpu_layer_ops.c_add_rms_norm(x, residual.clone(), weight, 1e-5)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(total, expected_sum)
    with pytest.raises(ValueError, match="does not match hidden size"):
        cpu_layer_ops.c_rms_norm(x, torch.ones(hidden + 1), 1e-5)


@pytest.mark.parametrize("rows, heads, head_dim", [(5, 12, 64), (70, 3, 40)])
def test_rotary_matches_torch_on_strided_rows(seed, rows, heads, head_dim):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(100, head_dim // 2, generator=gen) * 6.28
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 100, (rows,), generator=gen)
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen)
    x = qkv[:, : heads * head_dim].unflatten(1, (heads, head_dim))
    expected = reference_layer_ops.torch_rotary(
        x.clone(), reference_layer_ops.torch_prepare_rotary(positions, cos, sin)
    )
    untouched = qkv[:, heads * head_dim :].clone()
    got = cpu_layer_ops.c_rotary(x, cpu_layer_ops.c_prepare_rotary(positions, cos, sin))
    torch.testing.assert_close(got, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched), "rotation wrote outside its heads"
    with pytest.raises(ValueError, match="positions outside"):
        cpu_layer_ops.c_prepare_rotary(torch.tensor([100]), cos, sin)


@pytest.mark.parametrize("rows, inter", [(2, 1536), (9, 40)])
def test_silu_and_mul_matches_torch(seed, rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed)) * 6
    torch.testing.assert_close(cpu_layer_ops.c_silu_and_mul(gate_up), reference_layer_ops.torch_silu_and_mul(gate_up))


def test_packed_linear_equals_f_linear(seed):
    from prefixserve.replica.model.layers import ColumnParallelLinear, TPGroup, mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("torch built without MKL")
    layer = ColumnParallelLinear(96, [80], True, TPGroup(), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(80, 96, generator=gen))
    layer.bias.data.copy_(torch.randn(80, generator=gen))
    layer.pack_for_cpu()
    assert layer.packed_weight is not None
    for rows in (1, 7, 64, 130):
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (53, 37), (6, 576), (130, 16), (10, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_small_gemm_and_its_fused_swiglu_match_float64(rows, out_features, in_features, threads):
    """The decode GEMM against float64; where the weight stacks two halves (gate over up), the
    fused SwiGLU pass too, and that equals the GEMM followed by the C SwiGLU bit for bit."""
    from prefixserve.kernels.cpu.linear import c_small_linear, c_small_linear_silu_and_mul

    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5  # outputs of order 1
    bias = torch.randn(out_features, generator=gen)
    inter = out_features // 2
    with torch_threads(threads):
        for b in (None, bias):
            exact = F.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(c_small_linear(x, w, b), exact.float(), rtol=1e-5, atol=1e-5)
            if out_features % 2:
                continue
            fused = c_small_linear_silu_and_mul(x, w, b)
            assert torch.equal(fused, cpu_layer_ops.c_silu_and_mul(c_small_linear(x, w, b)))
            expected = (F.silu(exact[:, :inter]) * exact[:, inter:]).float()
            torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_small_gemm_rejects_what_it_cannot_run():
    from prefixserve.kernels.cpu.linear import SMALL_GEMM_MAX_ROWS, c_small_linear

    w = torch.randn(32, 48)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        c_small_linear(torch.randn(SMALL_GEMM_MAX_ROWS + 1, 48), w)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        c_small_linear(torch.randn(0, 48), w)
    with pytest.raises(ValueError, match="does not match a weight"):
        c_small_linear(torch.randn(2, 47), w)
    with pytest.raises(ValueError, match="contiguous float32"):
        c_small_linear(torch.randn(2, 32), w.t())
    with pytest.raises(ValueError, match="bias"):
        c_small_linear(torch.randn(2, 48), w, torch.randn(31))


def test_a_linear_takes_the_small_gemm_up_to_eight_rows_and_mkl_above():
    from prefixserve.kernels.cpu.linear import c_small_linear
    from prefixserve.replica.model.layers import RowParallelLinear, TPGroup

    layer = RowParallelLinear(64, 40, False, TPGroup(), torch.float32)
    gen = torch.Generator().manual_seed(7)
    layer.weight.data.copy_(torch.randn(40, 64, generator=gen))
    layer.pack_for_cpu()
    assert layer.small_rows
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 64, generator=gen)
        if rows <= 8:
            assert torch.equal(layer(x), c_small_linear(x, layer.weight))
        elif layer.packed_weight is not None:
            assert torch.equal(layer(x), torch.ops.mkl._mkl_linear(x, layer.packed_weight, layer.weight, None, rows))
        else:
            assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_fused_gate_up_rejects_what_it_cannot_run():
    from prefixserve.kernels.cpu.linear import SMALL_GEMM_MAX_ROWS, c_small_linear_silu_and_mul

    with pytest.raises(ValueError, match="two equal halves"):
        c_small_linear_silu_and_mul(torch.randn(2, 48), torch.randn(31, 48))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        c_small_linear_silu_and_mul(torch.randn(SMALL_GEMM_MAX_ROWS + 1, 48), torch.randn(32, 48))
    with pytest.raises(ValueError, match="bias"):
        c_small_linear_silu_and_mul(torch.randn(2, 48), torch.randn(32, 48), torch.randn(16))


def test_the_mlp_fuses_its_swiglu_at_decode_rows_only_where_it_changes_no_bit():
    from types import SimpleNamespace

    from prefixserve.replica.model.layers import TPGroup
    from prefixserve.replica.model.llama import MLP

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=40, mlp_bias=False)
    gen = torch.Generator().manual_seed(11)
    mlps = {}
    for ops in (cpu_layer_ops.C_LAYER_OPS, reference_layer_ops.TORCH_LAYER_OPS):
        mlp = MLP(cfg, TPGroup(), torch.float32, ops)
        mlp.gate_up_proj.weight.data.copy_(torch.randn(80, 64, generator=gen))
        mlp.down_proj.weight.data.copy_(torch.randn(64, 40, generator=gen))
        mlp.gate_up_proj.pack_for_cpu()
        mlp.down_proj.pack_for_cpu()
        mlps[ops.name] = mlp
    mlp = mlps["c"]
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64, generator=gen)
        two_passes = mlp.down_proj(cpu_layer_ops.c_silu_and_mul(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), two_passes)
        assert (mlp.gate_up_proj.silu_and_mul_small(x) is None) == (rows > 8)
    # Other layer ops keep their own SwiGLU; an adapter on the projection turns the fused pass off.
    torch_mlp = mlps["torch"]
    x = torch.randn(4, 64, generator=gen)
    expected = torch_mlp.down_proj(reference_layer_ops.torch_silu_and_mul(torch_mlp.gate_up_proj(x)))
    assert torch.equal(torch_mlp(x), expected)
    mlp.gate_up_proj.lora = SimpleNamespace(apply=lambda x, y: y)
    assert mlp.gate_up_proj.silu_and_mul_small(x) is None


# --- backend choice and fallback ------------------------------------------------------


def test_select_backend_auto_on_cpu():
    backend = select_backend("auto", "cpu", torch.float32)
    assert backend.name == "cpu"
    assert backend.kv_cache_shape(3, 16, 2, 64) == ((3, 2, 64, 16), (3, 2, 16, 64))
    assert backend.layer_ops is cpu_layer_ops.C_LAYER_OPS
    assert backend.paged_attention is cpu_attention.paged_attention
    assert backend.write_kv_cache is cpu_attention.write_kv_cache
    assert select_backend("auto", "cpu", torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="float32"):
        select_backend("cpu", "cpu", torch.float16)


@pytest.mark.parametrize(
    "name, attention, layer_ops",
    [
        ("auto", cpu_attention.paged_attention, cpu_layer_ops.C_LAYER_OPS),
        ("torch", reference.paged_attention, reference_layer_ops.TORCH_LAYER_OPS),
    ],
    ids=["auto", "torch"],
)
def test_the_engine_runs_one_backends_attention_and_layer_ops(ckpt, name, attention, layer_ops):
    """The shard's one select_backend call decides both: every attention layer runs the backend's
    attention, every norm, rotary and MLP its layer ops."""
    with LLM(ckpt, num_kv_blocks=16, attention_backend=name) as llm:
        shard = llm.engine.runner.shard
        assert shard.backend.paged_attention is attention
        modules = list(shard.model.modules())
        assert {id(m.backend) for m in modules if hasattr(m, "backend")} == {id(shard.backend)}
        ops = [m.ops for m in modules if hasattr(m, "ops")]
        assert len(ops) > 3 and all(o is layer_ops for o in ops)


def test_without_a_compiler_auto_falls_back_to_torch(tmp_path):
    """No compiler and an empty kernel cache: 'auto' gives the torch backend (with a
    warning naming the cause), and forcing 'cpu' fails with that cause."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from prefixserve.kernels.backends import select_backend\n"
        "from prefixserve.kernels.cpu.library import CPUKernelUnavailable\n"
        "print('AUTO', select_backend('auto', 'cpu', torch.float32).name)\n"
        "try:\n"
        "    select_backend('cpu', 'cpu', torch.float32)\n"
        "except CPUKernelUnavailable as exc:\n"
        "    print('FORCED', exc)\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PREFIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "AUTO torch" in proc.stdout
    assert "FORCED no C compiler" in proc.stdout
    assert "CPU attention kernel unavailable" in proc.stderr
