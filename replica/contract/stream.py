"""The items of a generate stream: what an engine replica sends back to the front end that called it.

The stream protocol of ``EngineDeployment.generate`` (replica/entrypoints/serve/deployment.py): one
:class:`StreamStart` naming the replica that took the request, then the engine's :class:`StreamDelta`
objects until every sequence has a finish reason (with logprobs asked, a :class:`TokenTexts` before each
delta that brings token ids not decoded yet). A client error ends the stream with one
:class:`StreamError` item, never an exception. Plain, picklable data (deltas cross the Ray object store,
so they stay small). Build them with keyword arguments: the field order is not part of the interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.errors import APIError
from prefixserve.replica.tool_calling.stream import ToolCallDelta, ToolCallResult


@dataclass(frozen=True)
class StreamStart:
    """First item of every generate stream: which replica took the request."""

    request_id: str
    replica: str


@dataclass(frozen=True)
class TokenTexts:
    """Decoded text of token ids the caller has not seen yet (sent only when logprobs are asked).

    Comes right before the delta that needs it, so the caller can render
    logprobs without a tokenizer of its own.
    """

    texts: dict[int, str]


@dataclass(frozen=True)
class StreamError:
    """Last item of a stream refused for a client error: the OpenAI error to answer, as plain fields.

    Only strings and numbers, so that nothing of the request outlives it.
    """

    status_code: int
    error_type: str
    code: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def of(cls, err: APIError) -> StreamError:
        return cls(err.status_code, err.error_type, err.code, err.message, err.param, err.retry_after_s)

    def to_api_error(self) -> APIError:
        """The error as the front end answers it (its status, type and code)."""
        err = APIError(self.message, param=self.param, code=self.code, retry_after_s=self.retry_after_s)
        err.status_code = self.status_code
        err.error_type = self.error_type
        return err


@dataclass
class StreamDelta:
    """New tokens of one sequence of a request, as ``AsyncEngine.stream`` yields them.

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
    # Set when the request's output is read for tool calls (replica/tool_calling/stream.py): ``text``
    # stays the raw text; ``content`` is its part for the user, ``tool_calls`` the calls' new
    # pieces, and the sequence's last delta carries the finished ``tool_result``.
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    tool_result: ToolCallResult | None = None
    # For a request that asked for retention: whether its prefix is pinned (replica/contract/retention.py).
    cache_retention: str | None = None


StreamItem = StreamStart | TokenTexts | StreamDelta | StreamError
