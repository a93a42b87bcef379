"""The engine request and what a front end may ask of an engine: the ingress<->engine contract's request side.

* :class:`EngineRequest`: one generation request, as a front end hands it to an engine (and as the Ray
  ingress sends it to an engine replica).
* :class:`ModelInfo`, :class:`EngineStream` and :class:`EngineClient`: what a front end may ask of an
  engine (model info, health, open a stream of ``StreamDelta``; closing an unfinished stream aborts its
  request).

The headers and roles the routing key reads are replica/contract/routing.py's.

Plain data: no HTTP framework, no Ray, no torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixserve.replica.contract.continuation import Continuation
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.tool_calling.choice import ToolCallMode

# A request's priority (vLLM's field; lower runs first under the "priority" scheduling policy):
# a 32-bit signed integer, so any value a client gets accepted survives every wire it crosses.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def priority_error(priority: int, scheduling_policy: str) -> str | None:
    """Why an engine running ``scheduling_policy`` refuses ``priority`` (None: it takes it).

    Outside [PRIORITY_MIN, PRIORITY_MAX] always; not 0 unless the policy is "priority", in
    vLLM's words.
    """
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        return f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority}"
    if priority != 0 and scheduling_policy != "priority":
        return f"Got priority {priority} but Priority scheduling is not enabled."
    return None


@dataclass
class EngineRequest:
    """One generation request as a front end hands it to an engine.

    Exactly one of ``prompt`` (text or token ids, completions) and ``messages``
    (chat; ``[{"role", "content"}]`` with string contents, plus ``tool_calls`` /
    ``tool_call_id`` on tool turns, rendered by the engine's chat template with
    ``tools``) is set. ``tool_mode`` says how the output is read for tool calls
    (None: plain content). ``sampling.max_tokens`` is what the client
    asked for; when the client asked nothing, ``max_tokens_default`` is set and
    the engine host, which knows the prompt's length, applies the one rule of
    ``fit_max_tokens`` (replica/engine/input_processor.py).
    """

    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_mode: ToolCallMode | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_default: int | None = None
    cache_salt: str | None = None
    # Contract 1's key (router/routing_key.py), computed by the ingress; None = no affinity.
    routing_key: str | None = None
    # The W3C trace context (traceparent, tracestate) the request's spans hang under
    # (common/tracing.py); the router replaces it with its route span's.
    trace_headers: dict[str, str] | None = None
    # A conversation turn (is_conversation_turn): its answer returns in the next prompt.
    conversation: bool = False
    # Who sent it, for the per-client shares of shared work (the grammar compile pool): a digest of
    # the request's API key when the server checks keys, else the client's address; None = unknown.
    client: str | None = None
    # vLLM's priority: under the engine's "priority" scheduling policy a lower value is admitted
    # first and preempted last; must be 0 under "fcfs" (priority_error).
    priority: int = 0
    # The served LoRA adapter the request runs with (the name its ``model`` gave); None = the base model.
    lora_name: str | None = None
    # The served base model it runs on (ModelInfo.model_name): a front end over several models
    # sends it to that model's engines. None: the only one.
    model: str | None = None
    # The tenant the front end's tenant table says sent it (router/flow_control/); None = no tenants.
    tenant: str | None = None
    # OpenAI's prompt_cache_retention (replica/contract/retention.py): "24h" pins its prefix blocks
    # on the replica; None or "in_memory" = the prefix cache as it is.
    cache_retention: str | None = None
    # The engine replica (its ring name) that holds the conversation this request continues (a
    # /v1/responses continuation: where its previous response was answered). The router sends it
    # there first, and routes it as any other request when that replica is gone.
    home_replica: str | None = None
    # Engine replicas (ring names) the router sends it to only when no other can take it: those that
    # failed it already (a resend, a migrated stream).
    avoid_replicas: tuple[str, ...] = ()
    # A stream moved here from a replica that stopped serving it (replica/contract/continuation.py):
    # what its client already has, which this replica replays rather than sends.
    continuation: Continuation | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("an EngineRequest needs exactly one of prompt and messages")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1 or None, got {self.max_tokens_default}")


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to know of the served model."""

    model_name: str  # the name clients use
    model: str  # where it was loaded from (also accepted as a name)
    max_model_len: int
    # Chats of more messages cannot fit (InputProcessor.max_messages), refused before parsing them
    # further; None when the chat template gives no bound.
    max_messages: int | None = None
    # The most tools a request may carry (EngineConfig.max_tools_per_request), refused before they are
    # validated; None = no bound.
    max_tools: int | None = None
    # The most nodes the tools' parameter schemas may have together (EngineConfig.max_tool_schema_nodes):
    # what bounds the front end's schema checks; None = no bound.
    max_tool_schema_nodes: int | None = None
    # The engine's --tool-call-parser and --enable-auto-tool-choice (tool_choice="auto" needs both).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # The engine's --scheduling-policy ("fcfs" or "priority"): whether a request's priority counts.
    scheduling_policy: str = "fcfs"
    # The LoRA adapters served by name (name -> path), each a model a request may name.
    adapters: tuple[tuple[str, str], ...] = ()

    def serves(self, name: str) -> bool:
        return name in (self.model_name, self.model) or self.adapter(name) is not None

    def adapter(self, name: str | None) -> str | None:
        """``name`` when it names a served adapter, else None."""
        return name if name is not None and any(a == name for a, _ in self.adapters) else None


class EngineStream(Protocol):
    """The deltas of one engine request.

    ``aclose`` aborts the request when it is unfinished (its KV blocks are
    freed); ``token_text`` renders a token id this stream produced (logprobs);
    ``response_headers`` say where the request ran (empty when the host's own
    headers say it already).
    """

    def __aiter__(self) -> EngineStream: ...

    async def __anext__(self) -> StreamDelta: ...

    async def aclose(self) -> None: ...

    def token_text(self, token_id: int) -> str: ...

    def response_headers(self) -> dict[str, str]: ...


class EngineClient(Protocol):
    """An engine as a front end sees it: model info, health, and streams.

    A client may front several base models (the Ray ingress over one engine deployment per
    model): ``model_info(name)`` is then the info of the model a request naming ``name`` runs
    on, and a request's ``model`` field says which one ``open_stream`` sends it to.
    """

    async def model_info(self, name: str | None = None) -> ModelInfo:
        """The served model's info; with several, the one serving ``name`` (base name, path or
        adapter; None or a name none serves: the first, whose check then refuses the name)."""
        ...

    async def models(self) -> list[ModelInfo]:
        """Every model served (``/v1/models``), the default first."""
        ...

    async def is_healthy(self) -> bool: ...

    def open_stream(self, request: EngineRequest) -> EngineStream: ...
