"""Random Llama-family checkpoints for benchmarks and tests: their config fields and weights.

The benchmarks (loadtest/bench_engine_gpu.py) and the tests (tests/model_helpers.py) build
models of a given shape with random weights; both use these two pieces, so a model of one
shape and seed is the same in both. Torch and transformers load only when called.
"""

from __future__ import annotations

from typing import Any


def llama_config_fields(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_pos: int,
    tie: bool,
    **extra: Any,
) -> dict[str, Any]:
    """The config fields of a Llama-family model of this shape (SmolLM2's special token ids), plus ``extra``."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **extra,
    )


def sharpened_random_model(model_class: Any, config: Any, seed: int) -> Any:
    """``model_class(config)`` with weights drawn from ``seed``, sharpened so that greedy has clear winners.

    Random init is near-uniform over the vocabulary: every output would look alike.
    """
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 if "embed" in name else 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
    return model
