"""Test helpers for LoRA: random PEFT adapters on a tiny checkpoint, and peft's greedy output.

An adapter is written by peft itself (``get_peft_model`` with random A and B, then
``save_pretrained``), so the engine reads exactly what a user's training run leaves behind.
B is scaled up so that an adapter visibly changes greedy tokens on the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from model_helpers import hf_greedy

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fresh_hf_model(base: str):
    """A new transformers model of ``base`` (peft injects its layers in place: never the cached one)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def make_adapter(
    base: str,
    path: Path,
    *,
    targets: list[str],
    rank: int = 8,
    alpha: int = 16,
    seed: int = 0,
    use_rslora: bool = False,
    b_scale: float = 20.0,
) -> str:
    """A random LoRA adapter for the checkpoint at ``base``, saved in PEFT's format at ``path``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    model = get_peft_model(fresh_hf_model(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(path)
    return str(path)


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations with ``adapter`` applied by peft (None: the base model)."""
    from peft import PeftModel

    model = fresh_hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]
