"""SamplingParams (what a request asks of the sampler) and the sampler itself.

SamplingParams is plain data, validated on construction so that every front end
(offline LLM, HTTP server, Ray ingress) refuses the same bad values with the same
message. The sampler (torch) lives below it in this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_N = 16


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's names and defaults).

    ``temperature == 0`` is greedy. ``top_k`` of None (or -1, as vLLM spells it)
    keeps every token. ``seed`` makes sampling reproducible per request; with
    ``n > 1`` child ``i`` uses ``seed + i`` so that it equals a separate request
    sent with that seed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = None
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or -1 (disabled), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
