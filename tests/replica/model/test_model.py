"""The model half of the engine: config validation, RoPE, loading, the sampler, and
greedy outputs identical to transformers on tiny random checkpoints and on SmolLM2."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest
import torch
from model_helpers import SMOLLM2_GGUF, hf_greedy, hf_model, random_prompts, smollm2_folder, tiny_checkpoint

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.model import loader
from prefixserve.replica.model.rope import RopeConfig, inverse_frequencies
from prefixserve.replica.model.startup import PHASES
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.worker.sampler import SampleSpec, sample

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


# --- config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs, fragment",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"distributed_timeout_s": 0}, "distributed_timeout_s"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
        ({"calculate_kv_scales": True}, "calculate_kv_scales"),
        ({"preemption_mode": "swap"}, "swap_space_gb > 0"),
        ({"swap_space_gb": 4.0}, "preemption_mode='swap'"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"block_size": 12}, "block_size"),
        ({"prefix_hash_algo": "md5"}, "prefix_hash_algo"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"enable_chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 1024}, "chunked prefill"),
        ({"max_waiting_requests": 0}, "max_waiting_requests"),
    ],
)
def test_config_refuses_bad_and_unimplemented_knobs(knobs, fragment):
    with pytest.raises(ValueError) as info:
        EngineConfig(**knobs)
    assert fragment in str(info.value)


def test_config_cli_and_dict_round_trip():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            "/m/x.gguf",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "512",
            "--num-kv-blocks",
            "100",
        ]
    )
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.max_model_len, cfg.num_kv_blocks) == (32, False, 512, 100)
    assert cfg.model_name == "x"
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown engine config keys"):
        EngineConfig.from_dict({"modle": "smollm2"})


def test_resolve_model_sources(tmp_path):
    src = loader.resolve("smollm2")
    assert src.gguf_file == SMOLLM2_GGUF and (src.folder / SMOLLM2_GGUF).exists()
    assert loader.resolve(str(src.folder / SMOLLM2_GGUF)) == src
    with pytest.raises(ValueError, match="short name"):
        loader.resolve(str(tmp_path / "nothing-here"))


def test_startup_phases_are_logged_and_exported(tmp_path, caplog):
    path = tiny_checkpoint(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="prefixserve.startup"):
        llm = LLM(str(path), num_kv_blocks=16)
    phases = {
        s.labels["phase"]: s.value
        for family in llm.engine.metrics.registry.collect()
        if family.name == "prefixserve:engine_startup_seconds"
        for s in family.samples
    }
    assert set(phases) == set(PHASES) and all(seconds >= 0 for seconds in phases.values())
    assert f"engine {llm.engine.model_name} started in" in caplog.text


# --- RoPE ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope_type, params",
    [
        ("default", {}),
        ("linear", {"factor": 4.0}),
        ("dynamic", {"factor": 2.0}),
        (
            "llama3",
            {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ],
)
def test_rope_frequencies_match_transformers(rope_type, params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 5000.0, "rope_type": rope_type, **params},
    )
    ours = RopeConfig(5000.0, rope_type, params, 256)
    if rope_type == "default":
        expected = 1.0 / (5000.0 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
        assert torch.equal(inverse_frequencies(ours, 32, 256), expected)
        return
    fn = ROPE_INIT_FUNCTIONS[rope_type]
    # Dynamic NTK is fixed at max_model_len; transformers derives it from the sequence length.
    for max_len in (256, 1024):
        expected, _ = fn(cfg, "cpu", seq_len=max_len)
        assert torch.allclose(inverse_frequencies(ours, 32, max_len), expected, rtol=1e-6, atol=0)


# --- sampler ------------------------------------------------------------------------------


def test_sampler_greedy_topk_topp_and_seeds():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen) * 3
    argmax = logits.argmax(-1).tolist()
    specs = [
        SampleSpec(SamplingParams(temperature=0.0), None),
        SampleSpec(SamplingParams(temperature=1.0, top_k=1), None),
        SampleSpec(SamplingParams(temperature=1.5, top_p=1e-6), None),
        SampleSpec(SamplingParams(temperature=1.0, logprobs=3), torch.Generator().manual_seed(7)),
    ]
    out = sample(logits.clone(), specs, torch.Generator().manual_seed(1))
    assert [r.token_id for r in out[:3]] == argmax[:3]
    assert len(out[3].logprobs) in (3, 4) and out[3].token_id in out[3].logprobs
    # A seeded row samples the same token whatever shares its batch.
    alone = SampleSpec(specs[3].params, torch.Generator().manual_seed(7))
    again = sample(logits[3:].clone(), [alone], torch.Generator().manual_seed(99))
    assert again[0].token_id == out[3].token_id


def test_sampler_follows_the_distribution_and_bans():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]])).repeat(4000, 1)
    spec = SampleSpec(SamplingParams(temperature=1.0), None)
    tokens = [r.token_id for r in sample(logits.clone(), [spec] * 4000, torch.Generator().manual_seed(3))]
    freq = np.bincount(tokens, minlength=4) / 4000
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and freq[3] == 0
    nucleus = SampleSpec(SamplingParams(temperature=1.0, top_p=0.75), None)
    tokens = [r.token_id for r in sample(logits[:500].clone(), [nucleus] * 500, torch.Generator().manual_seed(4))]
    assert set(tokens) == {0, 1}
    banned = SampleSpec(SamplingParams(temperature=0.0), None, banned_ids=(0,))
    assert sample(logits[:1].clone(), [banned], torch.Generator())[0].token_id == 1


# --- greedy equality with transformers ------------------------------------------------------

VARIANTS = {
    # name: tiny_checkpoint kwargs (head dims 16/32/64, GQA 2, MQA, MHA, tied/untied, rope scaling, Qwen2 bias)
    "llama-gqa2-hd16": dict(hidden=64, heads=4, kv_heads=2),
    "llama-mqa-hd32-tied-llama3": dict(
        hidden=96,
        heads=6,
        kv_heads=1,
        head_dim=32,
        tie=True,
        rope={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-mha-hd64-linear": dict(
        hidden=64, heads=2, kv_heads=2, head_dim=64, rope={"rope_type": "linear", "factor": 2.0}
    ),
    "llama-gqa4-dynamic": dict(hidden=128, heads=8, kv_heads=2, rope={"rope_type": "dynamic", "factor": 2.0}),
    "qwen2-gqa2-bias": dict(arch="qwen2", hidden=64, heads=4, kv_heads=2),
}


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers_on_tiny_checkpoints(variant, attention_backend, tmp_path):
    """``auto`` is the C kernels (attention, fused layer ops, packed GEMMs) wherever a
    compiler is present, as in CI; ``torch`` is the pure-torch reference path."""
    seed = sorted(VARIANTS).index(variant)
    path = tiny_checkpoint(tmp_path / variant, seed=seed, **VARIANTS[variant])
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(17, 40000, 37)]
    prompts = random_prompts(rng, 4, 3, 30, shared_prefix=prefix)
    expected = [hf_greedy(hf_model(str(path)), p, 16) for p in prompts]
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64, attention_backend=attention_backend)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The shared 37-token prefix is two full blocks: later prompts hit them.
    assert max(o.num_cached_tokens for o in outs) == 32
    assert llm.engine.kv_manager.usage == 0.0


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_on_chats_sharing_a_system_prompt():
    system = (
        "You are the support assistant of a small hardware store. Answer in one or two short "
        "sentences, mention a product when it helps, and never invent prices."
    )
    questions = [
        "What is a claw hammer for?",
        "How do I stop a faucet from dripping?",
        "Which screws hold best in drywall?",
    ]
    llm = LLM("smollm2")
    prompts = [
        llm.engine.input_processor.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    outs = llm.generate(prompts, GREEDY)
    hf = hf_model(str(smollm2_folder()), SMOLLM2_GGUF)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, True]
    assert all(o.outputs[0].text for o in outs)
