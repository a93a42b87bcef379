"""Request and sequence state: what the scheduler schedules and the engine updates.

A ``Request`` is what a client sent (prompt, SamplingParams, salt); it owns ``n``
``Sequence``s, one per output. Until its prompt is prefilled a request has a single
sequence; after the prefill with ``n > 1`` the engine forks the children, which share
the prompt's KV blocks. A sequence is the unit of scheduling and of KV ownership
(its ``seq_id`` keys the KV manager).

Token regions of a sequence (``num_computed_tokens`` <= ``num_tokens``)::

    | prompt ............ | outputs ...... |
    | computed (KV in cache)      | to compute |
    0                    num_computed      num_tokens

Pure Python, no torch (the generator is held opaquely for the sampler).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from prefixserve.replica.contract.routing import STATIC_ROLES
from prefixserve.replica.engine.outputs import FinishReason
from prefixserve.replica.sampling_params import SamplingParams


def static_prefix_messages(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The leading run of system/developer messages: the static prefix Contract 1 keys on."""
    out: list[dict[str, Any]] = []
    for m in messages or ():
        if not isinstance(m, dict) or m.get("role") not in STATIC_ROLES:
            break
        out.append(m)
    return out


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at the first admission (None before it).
    num_cached_tokens: int | None = None
    # When the scheduler first took it (monotonic): its queue time ends here.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # True once the n > 1 children exist (they are forked after the prompt's prefill).
    forked: bool = False
    # The W3C trace context it arrived with (common/tracing.py); None = untraced.
    trace_headers: dict[str, str] | None = None
    # A conversation turn: its answer returns in the next turn's prompt, so its generated
    # blocks keep their place in the eviction order (SchedulerConfig.evict_generated_first).
    conversation: bool = False
    # Leading prompt tokens that are its static prefix (the system prompt's): their blocks are
    # released as reused content (SchedulerConfig.protect_static_prefix; BlockPool.mark_reused).
    static_prefix_tokens: int = 0
    # ``params.bad_words`` as token ids (LLMEngine.bad_words_token_ids).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # With ``params.prompt_logprobs``: one entry per prompt token computed so far (the first
    # is None, as vLLM's: nothing predicts it). Complete once it has one per prompt token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The rank of each prompt token among its position's logprobs (None for the first).
    prompt_logprob_ranks: list[int | None] = field(default_factory=lambda: [None])
    # Whether a stream delta has carried ``prompt_logprobs`` (only the first one does).
    prompt_logprobs_sent: bool = False

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still lack their logprobs (such a prompt skips prefix-cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    # How the output is read for tool calls (replica/tools/choice.py ToolCallMode); None = plain content.
    tool_mode: Any = None
    # The compiled grammar of its structured_outputs constraint (replica/structured_output/); None = free.
    grammar: Any = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.status is SeqStatus.FINISHED for s in self.seqs)

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    # torch.Generator of a seeded request (seed + index), else None.
    generator: Any = None
    finish_reason: FinishReason | None = None
    text: str = ""
    # Characters of ``text`` already handed out in stream deltas.
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    detok: Any = None  # IncrementalDetokenizer
    # Reads the text for tool calls (replica/tools/stream.py ToolCallStream) when the request has a
    # tool mode; its last result stays here for the request's metrics and span.
    tool_stream: Any = None
    tool_result: Any = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    # Its matcher when the request is constrained (structured_output.state.SequenceGrammar).
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def awaits_fork(self) -> bool:
        """The single sequence of an n > 1 request whose children do not exist yet."""
        return self.request.params.n > 1 and not self.request.forked
