"""What the engine hands back offline: finished outputs.

Plain data, shared by the engine and the offline LLM; the online stream deltas are
replica/contract/stream.py's. Build them with keyword arguments: the field order is
not part of the interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.replica.contract.finish_reason import FinishReason


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    # Per generated token: {token_id: logprob} of the top-k plus the sampled one.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """A finished request (``LLM.generate`` returns one per input)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float | None = None
    prompt: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} of the top-k plus
    # that token (the first is None: nothing predicts it).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
