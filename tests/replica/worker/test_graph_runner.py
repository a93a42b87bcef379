"""The decode static-buffer path (replica/worker/graph_runner.py) run eagerly on CPU: the same
bucketing, padding and buffer refills CUDA graphs replay on a GPU, checked against the
eager engine; and an engine's release of its model and cache at shutdown."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.errors import EngineDeadError
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.worker.graph_runner import PAD_SLOT, graph_batch_sizes
from prefixserve.replica.worker.step_inputs import StepInputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Preemption, chunked prefill and prefix hits (as in test_tensor_parallel.py), and decode
# batches of 1 to 5 sequences: padded to 1, 2, 4 and 8.
KNOBS = dict(block_size=4, num_kv_blocks=20, max_num_seqs=5, max_num_batched_tokens=16)


def prompts(count: int) -> list[list[int]]:
    prefix = [(29 * i + 3) % 4000 + 100 for i in range(16)]
    return [prefix + [(41 * i + 5 * j) % 4000 + 100 for j in range(10 + i)] for i in range(count)]


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [
        (1, (1,)),
        (5, (1, 2, 4, 8)),
        (32, (1, 2, 4, 8, 16, 32)),
        (64, (1, 2, 4, 8, 16, 32, 64)),
        (100, (1, 2, 4, 8, 16, 32, 64, 96, 128)),
    ],
)
def test_the_default_ladder_doubles_to_32_then_steps_by_32_past_max_num_seqs(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_cuda_graph_sizes_override_the_ladder_and_bad_ones_are_refused():
    assert graph_batch_sizes(64, [8, 1, 8, 3]) == (1, 3, 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        LLM("unused", cuda_graph_sizes=[0, 4])
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        LLM("unused", cuda_graph_sizes=[])


@pytest.mark.parametrize(
    "extra", [{}, {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}, {"cuda_graph_sizes": [3, 5]}]
)
def test_static_path_gives_the_eager_engines_tokens_under_hits_chunking_and_preemption(ckpt, extra):
    batch = prompts(7)
    with LLM(ckpt, **KNOBS, **extra) as eager:
        expected = [o.outputs[0].token_ids for o in eager.generate(batch, GREEDY)]
        assert eager.engine.runner.shard.graph_runner is None  # CPU default: eager
    with LLM(ckpt, enforce_eager=False, **KNOBS, **extra) as static:
        got = [o.outputs[0].token_ids for o in static.generate(batch, GREEDY)]
        stats = static.engine.stats()
        graphs = static.engine.runner.shard.graph_runner
        assert graphs is not None and not graphs.capture
        assert graphs.num_eager_static_runs > 0  # decode steps did take the static path
    assert got == expected
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def decode_inputs(block_tables: list[list[int]], lengths: list[int], block_size: int) -> StepInputs:
    """A decode step: each sequence's next token at position length - 1."""
    width = max(map(len, block_tables))
    positions = torch.tensor([n - 1 for n in lengths])
    slots = torch.tensor(
        [
            t[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for t, n in zip(block_tables, lengths, strict=True)
        ]
    )
    return StepInputs(
        input_ids=torch.tensor([200 + i for i in range(len(lengths))]),
        positions=positions,
        slot_mapping=slots,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        query_start_loc=torch.arange(len(lengths) + 1, dtype=torch.int32),
        sample_rows=torch.arange(len(lengths)),
        copy_ops=torch.zeros((0, 2), dtype=torch.long),
    )


def written_slots(shard, before_v: torch.Tensor) -> set[int]:
    """Cache slots (block * block_size + offset) whose V rows changed in any layer."""
    # V layout: [layers, blocks, kv_heads, block_size, dim] (C kernel) or [layers, blocks, block_size, kv_heads, dim].
    heads_dim = 2 if shard.backend.name == "cpu" else 3
    changed = (shard.v_cache != before_v).any(-1).any(heads_dim).any(0)  # [blocks, block_size]
    return {int(i) for i in changed.flatten().nonzero().flatten()}


def test_padding_rows_never_reach_the_kv_cache_and_refills_match_eager(ckpt):
    with LLM(ckpt, enforce_eager=False, **KNOBS) as llm:
        shard = llm.engine.runner.shard
        graphs = shard.graph_runner
        torch.manual_seed(0)
        shard.k_cache.normal_()
        shard.v_cache.normal_()
        # Three sequences (padded to 4), then two (padded to 2), then five (padded to 8):
        # each refill must leave no trace of the step before it.
        steps = [
            ([[3, 4], [5], [6, 7, 8]], [6, 3, 10]),
            ([[9, 10]], [8]),
            ([[1], [2], [11, 12], [13], [14, 15, 16]], [2, 4, 7, 1, 12]),
        ]
        for tables, lengths in steps:
            inputs = decode_inputs(tables, lengths, 4)
            before_k, before_v = shard.k_cache.clone(), shard.v_cache.clone()
            graphs_before = graphs.num_eager_static_runs
            static_logits = shard.run(inputs)
            assert graphs.num_eager_static_runs == graphs_before + 1
            assert graphs.padded_size(len(lengths)) >= len(lengths)
            assert (graphs.buffers.slot_mapping[len(lengths) : graphs.padded_size(len(lengths))] == PAD_SLOT).all()
            assert written_slots(shard, before_v) == {int(s) for s in inputs.slot_mapping}, (
                "a padding row wrote into the cache"
            )
            # The same step eagerly over the cache as it was: the same logits, cache and greedy tokens. Not bit
            # for bit: the eager step multiplies fewer rows than the padded one, and a CPU's GEMM may
            # block its reductions by row count (AMD EPYC with AVX-512: 4.5e-6 apart in fp32).
            after_k, after_v = shard.k_cache.clone(), shard.v_cache.clone()
            shard.k_cache.copy_(before_k)
            shard.v_cache.copy_(before_v)
            shard.graph_runner = None
            eager_logits = shard.run(inputs)
            shard.graph_runner = graphs
            torch.testing.assert_close(static_logits, eager_logits)
            assert torch.equal(static_logits.argmax(-1), eager_logits.argmax(-1))
            torch.testing.assert_close(shard.k_cache, after_k)
            torch.testing.assert_close(shard.v_cache, after_v)


def test_shutdown_releases_the_model_and_cache_and_refuses_further_steps(ckpt):
    llm = LLM(ckpt, enforce_eager=False, **KNOBS)
    model = weakref.ref(llm.engine.runner.model)
    cache = weakref.ref(llm.engine.runner.k_cache)
    llm.generate(prompts(1), GREEDY)
    llm.shutdown()
    llm.shutdown()  # idempotent
    gc.collect()
    assert model() is None and cache() is None
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(prompts(1), GREEDY)
