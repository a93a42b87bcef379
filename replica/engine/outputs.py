"""What the engine hands back: finished outputs (offline) and stream deltas (online).

Plain data, shared by the engine, the offline LLM, the HTTP server and the Ray
deployment (deltas cross the Ray object store, so they stay small and picklable).
Build them with keyword arguments: the field order is not part of the interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prefixserve.replica.tools.stream import ToolCallDelta, ToolCallResult


class FinishReason(StrEnum):
    """Why a sequence stopped (OpenAI's values; a StrEnum compares and serializes as the string).

    A request that fails is not "finished": its stream raises an exception instead
    (front ends map it to an HTTP error), so there is no "error" reason here.
    """

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client left or aborted


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


@dataclass
class StreamDelta:
    """New tokens of one sequence of a request, as ``AsyncEngine.generate`` yields them.

    ``finish_reason`` is set on the last delta of sequence ``index``; counts are
    cumulative for the whole request so the last delta carries the usage.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[dict[int, float]] | None = None
    # The request's prompt_logprobs and prompt token ids, on its first delta only (see RequestOutput).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # Set when the request's output is read for tool calls (replica/tools/stream.py): ``text``
    # stays the raw text; ``content`` is its part for the user, ``tool_calls`` the calls' new
    # pieces, and the sequence's last delta carries the finished ``tool_result``.
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    tool_result: ToolCallResult | None = None
