"""Request and sequence state: what the scheduler schedules and the engine updates.

A ``PreparedRequest`` is what a client sent, tokenized, validated and fitted once by the
engine's input processor (replica/engine/input_processor.py), and immutable from then on. A
``Request`` is the engine's state for one: it holds its PreparedRequest and reads the request's
fields through it, and owns ``n`` ``Sequence``s, one per output. Until its prompt is prefilled a request has a single
sequence; after the prefill with ``n > 1`` the engine forks the children, which share
the prompt's KV blocks. A sequence is the unit of scheduling and of KV ownership
(its ``seq_id`` keys the KV manager).

Token regions of a sequence (``num_computed_tokens`` <= ``num_tokens``)::

    | prompt ............ | outputs ...... |
    | computed (KV in cache)      | to compute |
    0                    num_computed      num_tokens

With asynchronous scheduling a sequence may also have ``num_placeholders`` tokens past
``num_tokens`` that a step in flight samples; the scheduler plans with both.

Pure Python, no torch (the generator is held opaquely for the sampler).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixserve.replica.contract.continuation import Continuation
from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.contract.routing import STATIC_ROLES
from prefixserve.replica.kv.hashing import BlockKeys
from prefixserve.replica.lora.request import LoRARequest
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


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """One request ready for the engine core: tokenized, validated and fitted, built once.

    The input processor builds it from an EngineRequest (``InputProcessor.build``, its one factory:
    replica/engine/input_processor.py); the async engine queues it as it is, and the engine core
    keeps a reference in its ``Request``. Nothing after the input processor changes it or checks
    it again.
    """

    request_id: str
    # Copied once from the tokenizer's list; each sequence extends its own list from it.
    prompt_token_ids: tuple[int, ...]
    # Fitted to the prompt (replica/engine/input_processor.py fit_max_tokens) and validated.
    params: SamplingParams
    cache_salt: str | None
    # When the engine host received it (time.monotonic()): its queue time starts here.
    arrival_time: float
    # The text prompt, reported back in the RequestOutput; None for token-id prompts.
    prompt: str | None = None
    # The W3C trace context it arrived with (common/tracing.py); None = untraced.
    trace_headers: Mapping[str, str] | None = None
    # A conversation turn: its answer returns in the next turn's prompt, so its generated
    # blocks keep their place in the eviction order (SchedulerConfig.evict_generated_first).
    conversation: bool = False
    # Leading prompt tokens that are its static prefix (the system prompt's): their blocks are
    # released as reused content (SchedulerConfig.protect_static_prefix; BlockPool.mark_reused).
    static_prefix_tokens: int = 0
    # ``params.bad_words`` as token ids (InputProcessor.bad_words_token_ids).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # How the output is read for tool calls (replica/tool_calling/choice.py ToolCallMode); None = plain content.
    tool_mode: Any = None
    # The compiled grammar of ``params.structured_outputs`` (replica/structured_output/); None = free.
    grammar: Any = None
    # vLLM's request priority: under the "priority" scheduling policy a lower value is admitted
    # first and preempted last (replica/core/request_queue.py); always 0 under "fcfs".
    priority: int = 0
    # The LoRA adapter it runs with (EngineConfig.enable_lora); None = the base model.
    lora_request: LoRARequest | None = None
    # Who pins its prefix blocks when it asked for retention (prompt_cache_retention "24h": the
    # tenant, else the client; replica/kv/pins.py); None = no retention asked.
    retention_owner: str | None = None
    # What its client already has when it continues a stream another replica served
    # (replica/contract/continuation.py), checked against its prompt; None for a new request.
    continuation: Continuation | None = None


@dataclass(eq=False)
class Request:
    """The engine's state for one PreparedRequest: its sequences, timings and prompt logprobs."""

    prepared: PreparedRequest
    seqs: list[Sequence] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at the first admission (None before it).
    num_cached_tokens: int | None = None
    # When the scheduler first took it (monotonic): its queue time ends here.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # True once the n > 1 children exist (they are forked after the prompt's prefill).
    forked: bool = False
    # The order the scheduler received it in (Scheduler.add): it breaks ties of (priority,
    # arrival_time), so the priority policy's order is total.
    arrival_order: int = 0
    # With ``params.prompt_logprobs``: one entry per prompt token computed so far (the first
    # is None, as vLLM's: nothing predicts it). Complete once it has one per prompt token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The rank of each prompt token among its position's logprobs (None for the first).
    prompt_logprob_ranks: list[int | None] = field(default_factory=lambda: [None])
    # Whether a stream delta has carried ``prompt_logprobs`` (only the first one does).
    prompt_logprobs_sent: bool = False
    # For a request that asked for retention, decided at its admission: RETENTION_PINNED when the
    # pin budget held its prompt's blocks (pinned when it finishes), else RETENTION_UNPINNED.
    cache_retention: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_logprobs is None and self.prepared.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.prepared.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.prepared.params

    @property
    def cache_salt(self) -> str | None:
        return self.prepared.cache_salt

    @property
    def lora_name(self) -> str | None:
        """Its adapter's name (None: the base model)."""
        lora = self.prepared.lora_request
        return None if lora is None else lora.lora_name

    @property
    def block_keys(self) -> str | BlockKeys | None:
        """What besides its tokens enters its block hashes (KVCacheManager's ``cache_salt``): the
        salt alone for the base model; with an adapter, the adapter's name as an extra key on
        every block (Contract 2), so requests of different adapters never share a block."""
        name = self.lora_name
        return self.cache_salt if name is None else BlockKeys(self.cache_salt, (name,))

    @property
    def arrival_time(self) -> float:
        return self.prepared.arrival_time

    @property
    def priority(self) -> int:
        return self.prepared.priority

    @property
    def prompt(self) -> str | None:
        return self.prepared.prompt

    @property
    def trace_headers(self) -> Mapping[str, str] | None:
        return self.prepared.trace_headers

    @property
    def conversation(self) -> bool:
        return self.prepared.conversation

    @property
    def static_prefix_tokens(self) -> int:
        return self.prepared.static_prefix_tokens

    @property
    def retention_owner(self) -> str | None:
        return self.prepared.retention_owner

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        return self.prepared.bad_words_token_ids

    @property
    def tool_mode(self) -> Any:
        return self.prepared.tool_mode

    @property
    def grammar(self) -> Any:
        return self.prepared.grammar

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still lack their logprobs (such a prompt skips prefix-cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

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
    # Reads the text for tool calls (replica/tool_calling/stream.py ToolCallStream) when the request has a
    # tool mode; its last result stays here for the request's metrics and span.
    tool_stream: Any = None
    tool_result: Any = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    # Its matcher when the request is constrained (structured_output.state.SequenceGrammar).
    grammar: Any = None
    # Tokens a step still in flight samples for it, not yet in ``token_ids`` (asynchronous
    # scheduling, replica/engine/step_pipeline.py; always 0 without it). The scheduler counts
    # them as known tokens: the next step computes the placeholder's KV.
    num_placeholders: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus placeholders: what the scheduler plans with."""
        return len(self.token_ids) + self.num_placeholders

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
