"""Rotary position embeddings: inverse frequencies per rope type, and applying them.

Supported rope types (the ones Llama, Mistral, Qwen2 and SmolLM checkpoints use):
``default``, ``linear``, ``dynamic`` (NTK) and ``llama3``. Frequencies are computed
the way transformers computes them, so that greedy outputs match it token for token.

Dynamic NTK in transformers re-derives the base from the current sequence length,
which changes the keys already in a cache. On paged KV the base must be fixed for
the life of the engine, so it is derived once from ``max_model_len``: identical to
transformers for every sequence when ``max_model_len <= max_position_embeddings``.

Layout: the half-split ("rotate_half") convention of Hugging Face Llama weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters of a checkpoint (``rope_parameters`` / ``rope_scaling`` of its config)."""

    theta: float = 10000.0
    rope_type: str = "default"
    # Scaling parameters of the non-default types (factor, low_freq_factor, ...).
    params: dict[str, float] = field(default_factory=dict)
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_model_len: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies for ``rope``."""
    base = rope.theta
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    if rope.rope_type == "dynamic" and max_model_len > rope.max_position_embeddings:
        factor = rope.params["factor"]
        ratio = factor * max_model_len / rope.max_position_embeddings - (factor - 1)
        base = base * ratio ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.params["factor"]
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope.params)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, p: dict[str, float]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for positions ``0..max_model_len-1``; applies them by position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim, max_model_len)
        positions = torch.arange(max_model_len, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [L, D/2]
        # Only half of cos/sin is stored: the two halves of a rotate_half table are equal.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)  # [L, D/2]
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
