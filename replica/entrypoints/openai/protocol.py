"""OpenAI protocol models and the error mapping every front end shares.

Job: parse and validate OpenAI ``/v1/chat/completions`` and ``/v1/completions``
bodies, turn them into :class:`SamplingParams`, build the response and SSE chunk
bodies, and map our exceptions to one OpenAI error body and status code, so the
standalone replica server (``replica/entrypoints/openai/server.py``) and the Ray ingress
(``router/serve/ingress.py``) answer the same request the same way.

Invariants:
* Validation errors are HTTP 400 with the OpenAI error body
  ``{"error": {"message", "type", "param", "code"}}`` (never FastAPI's 422);
  every 4xx carries a non-null ``code``.
* ``usage.prompt_tokens_details.cached_tokens`` is always present (0 when nothing
  was cached).
* Every request model derives from :class:`RequestModel`: a field that is not
  in the schema below is refused (400, code ``unknown_parameter``, the field
  named), and so are NaN/Infinity and integers outside int64, so no torch or
  Python overflow text ever reaches a client. The HTTP front end drops unknown
  *top-level* fields before validation unless the server is strict, as vLLM
  ignores them (replica/entrypoints/openai/request_fields.py).
* Fields OpenAI (or vLLM) defines that this engine does not implement are
  refused (400, code ``unsupported_parameter`` / ``unsupported_value``) when set
  to a value that would change the answer, never silently ignored:
  ``functions`` (non-empty), ``function_call``, ``audio``, ``modalities`` other than ``["text"]``,
  ``prediction``, ``web_search_options``, ``reasoning_effort``, ``verbosity``,
  ``moderation``, ``store: true``, ``service_tier`` other than ``auto`` /
  ``default`` (``flex`` and ``priority`` are accepted when the engine runs the
  priority scheduling policy: below); completions' ``suffix`` and ``best_of`` != ``n``.
  So are vLLM's extensions that would change the answer unless at vLLM's default:
  ``use_beam_search``, ``truncate_prompt_tokens``, ``priority`` other than 0 unless
  the engine runs the priority scheduling policy (vLLM's message otherwise),
  ``logits_processors``, ``return_tokens_as_token_ids``, ``return_token_ids``,
  ``guided_whitespace_pattern``; chat's ``echo``, ``add_generation_prompt: false``,
  ``continue_final_message``, ``add_special_tokens: true``, ``documents``,
  ``chat_template``, ``chat_template_kwargs``; completions' ``add_special_tokens:
  false`` and ``prompt_embeds``. vLLM extensions with no effect here
  (``request_id``, ``kv_transfer_params``, ``length_penalty``, ...) are unknown fields.
* Sampling fields with vLLM's names and ranges (``SamplingParams`` checks them):
  ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_p``,
  ``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ``spaces_between_special_tokens``, ``prompt_logprobs``
  (not with ``stream`` unless 0, as vLLM; answered as vLLM's ``prompt_logprobs``:
  per prompt token, null first, ``{token_id: {logprob, rank, decoded_token}}``) and
  completions' ``echo`` (the prompt before the output; with ``logprobs``, the prompt
  tokens' logprobs first, null for the first token).
* Harmless fields real clients send are accepted and ignored, as vLLM does:
  ``user``, ``safety_identifier``, ``metadata``, ``prompt_cache_key`` (the
  routers key by it: router/routing_key.py; the replica's prefix cache is
  automatic), ``prompt_cache_options`` (caching hints), ``store: false``, ``service_tier: "auto"`` / ``"default"``,
  ``stream_options.include_obfuscation`` (padding that hides event sizes;
  events go unpadded).
* A chat's ``prompt_cache_retention`` is OpenAI's: ``"in_memory"`` (the cache as it is) or
  ``"24h"``, which pins the prompt's blocks on the replica within its pin budget
  (replica/contract/retention.py); another value is a 400.
* ``logit_bias`` (token id strings to a bias in [-100, 100]) maps onto
  ``SamplingParams.logit_bias``.
* Priority (vLLM's ``priority``, an integer in [-2**31, 2**31 - 1], lower first; the
  engine's ``--scheduling-policy``, which ``validate_request`` is told): under
  ``priority`` a chat's ``service_tier`` shifts it (``SERVICE_TIER_SHIFTS``: ``priority``
  -1, ``flex`` +1, ``auto`` / ``default`` 0, saturating at the range's ends) and
  ``scheduling_priority`` is what the engine gets; under ``fcfs`` any other priority
  than 0 is vLLM's 400 and the tiers stay refused.
* Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
  ``tool_calls`` and ``tool`` messages) is checked here as vLLM checks it
  (``check_tool_usage``): duplicate tool names, a ``tool_choice`` without tools or
  naming an unknown tool, a parameters schema that is not a valid JSON Schema, and
  a ``tool`` message whose ``tool_call_id`` no earlier assistant call has are 400s
  naming the field. What depends on the server (``auto`` needs
  ``--enable-auto-tool-choice``) is ``replica/tool_calling/choice.py``'s.
* Structured output, on both endpoints: ``response_format`` (``text``,
  ``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` and
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  map onto ``SamplingParams.structured_outputs`` (at most one of them;
  replica/structured_output/openai_fields.py).

Pure data: pydantic and the replica's plain types only; must not import an HTTP
framework, Ray or torch.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError, from_json

from prefixserve.replica.contract.continuation import Continuation
from prefixserve.replica.contract.request import PRIORITY_MAX, PRIORITY_MIN
from prefixserve.replica.contract.retention import PROMPT_CACHE_RETENTIONS
from prefixserve.replica.errors import (
    APIError,
    BadRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InternalServerError,
    OverloadedError,
    PromptTooLongError,
    RequestFailedError,
    RequestRejected,
    ServiceUnavailableError,
)
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.openai_fields import StructuredOutputFieldError, StructuredOutputFields
from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.tool_calling.choice import ToolCallMode, named_schema, required_schema

# Completions' legacy default (OpenAI documents 16); chat defaults to "what fits".
DEFAULT_COMPLETION_MAX_TOKENS = 16

Role = Literal["system", "developer", "user", "assistant", "tool"]

# Integers are bounded where they are parsed, so an absurd value is a clean 400 here
# and never an overflow inside torch (seeds) or the sampler (token ids). The bound
# spans int64 and uint64 (seeds are uint64); SamplingParams checks the real ranges.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1
Int = Annotated[int, Field(ge=INT_MIN, le=INT_MAX)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]

# OpenAI's service tiers a chat may name under the priority scheduling policy, as a shift of the
# request's priority (lower runs first): "priority" ahead of its equals, "flex" behind them.
SERVICE_TIER_SHIFTS = {"auto": 0, "default": 0, "priority": -1, "flex": 1}


def _scheduling_policy(info: ValidationInfo) -> str:
    """The engine's scheduling policy, from the validation context (``validate_request``); fcfs without one."""
    context = info.context
    return context.get("scheduling_policy", "fcfs") if isinstance(context, Mapping) else "fcfs"


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# Pydantic error types that carry their own OpenAI code.
_CODED_ERRORS = {"unsupported_parameter", "unsupported_value", "unknown_parameter"}


def _format_validation_error(exc: ValidationError) -> BadRequestError:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    messages = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            messages.append(f"unknown field {where!r}: not a parameter this server accepts")
        else:
            messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    kind = "unknown_parameter" if first.get("type") == "extra_forbidden" else first.get("type")
    code = kind if kind in _CODED_ERRORS else "invalid_value"
    return BadRequestError("; ".join(messages), param=loc or None, code=code)


def error_from_exception(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to the error to answer.

    400: bad parameters (``ValidationError``, ``ValueError`` incl.
    ``RequestRejected``), prompt too long (code ``context_length_exceeded``);
    429 + Retry-After: ``EngineOverloadedError``; 503: ``EngineDeadError``;
    anything else: 500.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return _format_validation_error(exc)
    if isinstance(exc, PromptTooLongError):
        return BadRequestError(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestRejected | ValueError):
        return BadRequestError(str(exc), code="invalid_value")
    if isinstance(exc, EngineOverloadedError):
        return OverloadedError(str(exc), code="queue_full", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc) or "engine is not running", code="engine_dead", retry_after_s=1.0)
    if isinstance(exc, RequestFailedError):  # its message is written for clients; the cause is chained
        return InternalServerError(str(exc))
    # The exception's own text stays in the server's log (error_response logs it):
    # library internals are no message for a client.
    return InternalServerError(f"the server failed to process the request ({type(exc).__name__}); see its log")


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


class RequestModel(BaseModel):
    """Base of every request model: the one place the strict parsing policy is set.

    ``extra="forbid"``: an unknown field is a 400 naming it (a typo must not be
    silently ignored). ``allow_inf_nan=False``: NaN and Infinity are not numbers
    a request may carry.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _unsupported(name: str, why: str = "") -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_parameter", "{name} is not supported by this server{why}", {"name": name, "why": why}
    )


def _refuse_unless(info: ValidationInfo, value: Any, harmless: Callable[[Any], bool], allowed: str) -> Any:
    """Let ``value`` through when ``harmless(value)``, else refuse field ``info.field_name`` (400)."""
    if value is None or harmless(value):
        return value
    raise _unsupported(str(info.field_name), f"; send {allowed} or omit it")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(RequestModel):
    """A tool's function: ``parameters`` is a JSON Schema of its arguments object.

    That it is a valid schema is checked by ``ChatCompletionRequest.check_tool_schemas``, not
    while parsing: a request may carry many large schemas, and the front ends run that check
    off their event loop.
    """

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A called function: ``arguments`` is the JSON text of its arguments object."""

    name: str
    arguments: str


class MessageToolCall(RequestModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    """One chat message; ``content`` is a string or a list of text content parts.

    An assistant message may carry ``tool_calls`` (its content may then be null); a
    ``tool`` message answers one of them by ``tool_call_id``. Audio and the
    deprecated ``function_call`` are refused (the engine renders text turns only).
    """

    role: Role
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return value

    @field_validator("function_call", "audio", "refusal", mode="before")
    @classmethod
    def _no_function_call_or_audio_turns(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == [], "null")

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The message's text; content parts are joined by ``"\\n"`` (as Contract 1 does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template reads it: role and content text, plus tool fields when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


def json_nodes(value: Any, stop: int) -> int:
    """The nodes of a JSON value (each object, array and value counts one), counted up to ``stop``."""
    count, stack = 0, [value]
    while stack and count < stop:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def check_json_schema(schema: Any) -> None:
    """Raise ValueError unless ``schema`` is a valid JSON Schema (its meta-schema's check, jsonschema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ValueError("a JSON Schema must be an object")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}") from None
    except (jsonschema.exceptions.UnknownType, jsonschema.exceptions.RefResolutionError) as exc:
        raise ValueError(f"not a valid JSON Schema: {exc}") from None


class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: events go unpadded


class StreamContinuation(RequestModel):
    """``prefixserve_continuation``: the part of a stream its client already has, which this replica
    replays and goes on from (replica/contract/continuation.py; prefixserve's own field)."""

    id: str = Field(min_length=1, max_length=256)
    output_token_ids: list[TokenId]
    emitted_chars: Int = Field(ge=0)
    num_prompt_tokens: Int = Field(ge=1)
    tool_call_ids: list[str] = Field(default_factory=list)
    migrations: Int = Field(default=1, ge=1)

    def continuation(self) -> Continuation:
        return Continuation(
            output_token_ids=tuple(self.output_token_ids),
            emitted_chars=self.emitted_chars,
            num_prompt_tokens=self.num_prompt_tokens,
            tool_call_ids=tuple(self.tool_call_ids),
            migrations=self.migrations,
        )


class _SamplingRequest(RequestModel):
    """Fields both endpoints share (OpenAI's names plus vLLM's extensions)."""

    # The answer's id is ``<id_prefix>-<hex>`` (OpenAI's ``chatcmpl-`` / ``cmpl-``).
    id_prefix: ClassVar[str]

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None  # vLLM extension; -1 disables
    min_tokens: Int = 0  # vLLM extension
    n: Int = 1
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    logit_bias: dict[TokenId, Bias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM extensions of the sampler.
    repetition_penalty: float | None = None
    min_p: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Int | None = None
    cache_salt: str | None = None  # vLLM extension: isolates the prefix cache per tenant
    user: str | None = None
    # Structured output (replica/structured_output/openai_fields.py checks them in to_sampling_params).
    response_format: Any = None
    structured_outputs: Any = None  # vLLM extension
    guided_json: Any = None  # vLLM's older extensions
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's request priority (lower first): taken under the engine's priority scheduling policy.
    priority: int = 0
    # vLLM extensions this engine does not implement: declared so that they are never ignored
    # as unknown fields, and refused when set to a value that would change the answer.
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    # A stream another replica started, continued here (StreamContinuation); streams of one sequence only.
    prefixserve_continuation: StreamContinuation | None = None

    @field_validator("use_beam_search", "return_tokens_as_token_ids", "return_token_ids", mode="before")
    @classmethod
    def _vllm_switches_off(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v is False, "false")

    @field_validator("truncate_prompt_tokens", "logits_processors", "guided_whitespace_pattern", mode="before")
    @classmethod
    def _vllm_unset(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == [], "null")

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"priority must be an integer, got {value!r}")
        if not PRIORITY_MIN <= value <= PRIORITY_MAX:
            raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value}")
        if value != 0 and _scheduling_policy(info) != "priority":
            # vLLM's words; unsupported_parameter as for the other fields this server refuses.
            raise PydanticCustomError(
                "unsupported_parameter",
                "Got priority {priority} but Priority scheduling is not enabled.",
                {"priority": value},
            )
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string or omitted")
        return value

    @field_validator("prefixserve_continuation")
    @classmethod
    def _continuation_of_one_stream(
        cls, value: StreamContinuation | None, info: ValidationInfo
    ) -> StreamContinuation | None:
        if value is not None and not (info.data.get("stream") and info.data.get("n", 1) == 1):
            raise ValueError("a continuation continues a stream of one sequence: stream true and n 1")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # vLLM's rule: options of a stream are an error on a request that does not stream
        # (``stream`` is declared first, so it is validated by now).
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def scheduling_priority(self) -> int:
        """The priority the engine schedules this request at (0 unless the engine's policy is priority)."""
        return self.priority

    def cache_retention(self) -> str | None:
        """OpenAI's prompt_cache_retention of this request (None: not asked)."""
        return None

    def requested_max_tokens(self) -> int | None:
        """The client's limit on generated tokens; None when it set none."""
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, *, default_max_tokens: int, max_model_len: int | None = None) -> SamplingParams:
        """The engine's SamplingParams for this request.

        ``default_max_tokens`` applies when the request sets no limit (callers pass
        ``self.default_max_tokens(max_model_len)``; the engine host lowers it to
        what fits once the prompt's length is known). A requested ``max_tokens``
        above ``max_model_len`` can never fit and is refused here; whether prompt
        plus ``max_tokens`` fits is the engine's check. Raises ValueError (HTTP
        400) for any out-of-range value.
        """
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_model_len is not None and max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens is {max_tokens} but the model's context length (max_model_len) is "
                f"{max_model_len}; ask for at most {max_model_len} tokens"
            )
        if max_tokens is None:
            max_tokens = max(1, default_max_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields = StructuredOutputFields(
            self.response_format,
            self.structured_outputs,
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
        )
        try:
            constraint = fields.constraint()
        except StructuredOutputFieldError as exc:
            raise BadRequestError(str(exc), param=exc.param, code="invalid_value") from None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self._logprobs(),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            bad_words=list(self.bad_words or []),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            prompt_logprobs=self._prompt_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=constraint,
        )


class ChatCompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    # Accepted and ignored (see the module docstring).
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this engine does not implement: refused unless harmless.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    # vLLM's chat extensions this engine does not implement (the template is the server's,
    # rendered with the generation prompt): refused unless set to vLLM's default.
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None

    id_prefix: ClassVar[str] = "chatcmpl"

    @field_validator("echo", "continue_final_message", "add_special_tokens", mode="before")
    @classmethod
    def _vllm_chat_switches_off(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v is False, "false")

    @field_validator("add_generation_prompt", mode="before")
    @classmethod
    def _generation_prompt_added(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v is True, "true")

    @field_validator("documents", "chat_template", "chat_template_kwargs", mode="before")
    @classmethod
    def _server_template_only(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == {} or v == [], "null (the server's --chat-template applies)")

    @field_validator("functions", mode="before")
    @classmethod
    def _no_functions(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == [], "an empty list (use tools)")

    @field_validator("function_call", mode="before")
    @classmethod
    def _no_function_call(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == "none", '"none" (use tool_choice)')

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_modality_only(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v == ["text"], '["text"]')

    @field_validator(
        "audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "moderation", mode="before"
    )
    @classmethod
    def _not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: False, "null")

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError(
                "unsupported_value",
                "store=true is not supported: this server keeps no completions; send false or omit it",
            )
        return value

    @field_validator("prompt_cache_retention")
    @classmethod
    def _known_retention(cls, value: str | None) -> str | None:
        if value is None or value in PROMPT_CACHE_RETENTIONS:
            return value
        raise PydanticCustomError(
            "unsupported_value",
            "prompt_cache_retention {value} is not supported; send {allowed} or omit it",
            {"value": repr(value), "allowed": " or ".join(repr(v) for v in PROMPT_CACHE_RETENTIONS)},
        )

    def cache_retention(self) -> str | None:
        return self.prompt_cache_retention

    @field_validator("service_tier")
    @classmethod
    def _known_tier(cls, value: str | None, info: ValidationInfo) -> str | None:
        by_priority = _scheduling_policy(info) == "priority"
        if value is None or value in ("auto", "default") or (by_priority and value in SERVICE_TIER_SHIFTS):
            return value
        allowed = '"auto", "default", "flex", "priority"' if by_priority else '"auto", "default"'
        raise PydanticCustomError(
            "unsupported_value",
            "service_tier {tier} is not supported; send {allowed} or omit it",
            {"tier": repr(value), "allowed": allowed},
        )

    def scheduling_priority(self) -> int:
        """``priority`` shifted by the service tier (SERVICE_TIER_SHIFTS), kept within the priority range."""
        shifted = self.priority + SERVICE_TIER_SHIFTS.get(self.service_tier or "auto", 0)
        return min(PRIORITY_MAX, max(PRIORITY_MIN, shifted))

    def requested_max_tokens(self) -> int | None:
        # The newer OpenAI name wins when a client sends both.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def default_max_tokens(self, max_model_len: int) -> int:
        """The limit when the client sets none, before the prompt is known: whatever fits."""
        return max_model_len

    def prompt_fields(self) -> dict[str, Any]:
        """``{"messages": ...}`` (and ``tools`` when there are some): the prompt as ``EngineRequest`` takes it."""
        fields: dict[str, Any] = {"messages": self.chat_messages()}
        if self.tools:
            fields["tools"] = self.tool_dicts()
        return fields

    # -- tool calling (vLLM's check_tool_usage; replica/tool_calling/choice.py) --------------------

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as the chat template renders them (unset optional fields left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def effective_tool_choice(self) -> str:
        """ "none", "auto", "required" or "named": vLLM's default is "auto" with tools, "none" without."""
        choice = self.tool_choice
        if not self.tools:
            return "named" if isinstance(choice, NamedToolChoice) else "none"
        if choice is None:
            return "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def tool_call_mode(self) -> ToolCallMode | None:
        """How the engine host reads this request's output for tool calls; None: plain content."""
        choice = self.effective_tool_choice()
        if choice == "none":
            return None
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        parallel = self.parallel_tool_calls is not False
        return ToolCallMode(choice, name, parallel)  # type: ignore[arg-type]

    def tool_call_schema(self) -> dict[str, Any] | None:
        """The JSON schema ``required`` or a named function constrains the output to; None otherwise."""
        choice = self.effective_tool_choice()
        tools = [(t.function.name, t.function.parameters) for t in self.tools or ()]
        if choice == "required":
            return required_schema(tools, parallel=self.parallel_tool_calls is not False)
        if choice == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            return named_schema(dict(tools)[self.tool_choice.function.name])
        return None

    def check(self, *, tool_schemas: bool = True) -> None:
        """The checks across fields: tool names unique, tool_choice among the tools, tool results answer calls.

        ``tool_schemas``: also ``check_tool_schemas`` (CPU work proportional to the tools' size,
        which a front end runs in a worker thread instead: pass False there).
        """
        names = [t.function.name for t in self.tools or ()]
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise BadRequestError(
                    f"tools[{i}] is a second function named {name!r}: tool names must be unique",
                    param=f"tools.{i}.function.name",
                    code="invalid_value",
                )
            seen.add(name)
        choice = self.tool_choice
        if choice is not None and choice != "none" and self.tools is None:
            raise BadRequestError(
                "When using `tool_choice`, `tools` must be set.", param="tool_choice", code="invalid_value"
            )
        if choice == "required" and not self.tools:
            # Otherwise an empty list would silently mean "none" (OpenAI and vLLM refuse it too).
            raise BadRequestError(
                '`tool_choice` "required" needs at least one tool in `tools`', param="tools", code="invalid_value"
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise BadRequestError(
                f"The tool specified in `tool_choice` ({choice.function.name!r}) does not match "
                f"any of the specified `tools` ({', '.join(names) or 'none'})",
                param="tool_choice",
                code="invalid_value",
            )
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                called.update(c.id for c in m.tool_calls)
            if m.role == "tool" and m.tool_call_id not in called:
                raise BadRequestError(
                    f"messages[{i}] is a tool result for tool_call_id {m.tool_call_id!r}, which "
                    "no earlier assistant message called",
                    param=f"messages.{i}.tool_call_id",
                    code="invalid_value",
                )
        if tool_schemas:
            self.check_tool_schemas()

    def check_tool_schemas(self, max_nodes: int | None = None) -> None:
        """Each tool's ``parameters`` a valid JSON Schema, and the schema ``required`` or a named function
        constrains decoding to buildable; BadRequestError (400) naming the tool otherwise.

        Blocking CPU work: jsonschema's check costs about 0.1 ms per schema node (two cores),
        so with ``max_nodes`` the schemas' nodes (objects, arrays, values) are counted first,
        a walk a thousand times cheaper, and more than ``max_nodes`` is a 400 with no check run.
        """
        if max_nodes is not None:
            count = sum(json_nodes(t.function.parameters, max_nodes + 1) for t in self.tools or ())
            if count > max_nodes:
                raise BadRequestError(
                    f"the tools' parameter schemas have more than {max_nodes} nodes (objects, arrays and "
                    "values), the most this server validates for one request (max_tool_schema_nodes): "
                    "send fewer or smaller tools",
                    param="tools",
                    code="invalid_value",
                )
        for i, tool in enumerate(self.tools or ()):
            if tool.function.parameters is not None:
                try:
                    check_json_schema(tool.function.parameters)
                except ValueError as exc:
                    raise BadRequestError(
                        f"tools.{i}.function.parameters: {exc}",
                        param=f"tools.{i}.function.parameters",
                        code="invalid_value",
                    ) from None
        try:
            self.tool_call_schema()
        except ValueError as exc:  # $defs that the required schema cannot merge
            raise BadRequestError(str(exc), param="tools", code="invalid_value") from None

    def to_sampling_params(self, *, default_max_tokens: int, max_model_len: int | None = None) -> SamplingParams:
        params = super().to_sampling_params(default_max_tokens=default_max_tokens, max_model_len=max_model_len)
        schema = self.tool_call_schema()
        if schema is None:
            return params
        if params.structured_outputs is not None:  # vLLM's rule
            raise ValueError("You can only either use constraints for structured outputs or tools, not both.")
        # required / a named function: decoding follows the arguments' schema, so they always parse.
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: ``{"role", "content"}`` strings, plus
        ``tool_calls`` / ``tool_call_id`` on the messages that have them."""
        return [m.template_message() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/completions``: one prompt, text or token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Int | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: str | None = None
    # vLLM's completion extensions this engine does not implement: refused unless vLLM's default.
    add_special_tokens: Any = None
    prompt_embeds: Any = None

    id_prefix: ClassVar[str] = "cmpl"

    @field_validator("add_special_tokens", mode="before")
    @classmethod
    def _special_tokens_added(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: v is True, "true")

    @field_validator("prompt_embeds", mode="before")
    @classmethod
    def _no_prompt_embeds(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, lambda v: False, "null")

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got {len(value)}")
            value = value[0]
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix", "; send an empty string or omit it")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise PydanticCustomError("unsupported_value", "best_of must equal n ({n}) or be omitted", {"n": n})
        return value

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # An echoed prompt comes with its tokens' logprobs when logprobs are asked (vLLM's rule).
        # A token-id prompt is echoed from the ids the engine sends back with them (with their
        # texts on the Ray path, which has no tokenizer): it asks for them at k = 0.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs if self.logprobs is not None or isinstance(self.prompt, str) else 0
        return self.prompt_logprobs

    def default_max_tokens(self, max_model_len: int) -> int:
        """The limit when the client sets none, before the prompt is known: OpenAI's legacy 16."""
        return DEFAULT_COMPLETION_MAX_TOKENS

    def prompt_fields(self) -> dict[str, Any]:
        """``{"prompt": ...}``: the prompt as ``EngineRequest`` takes it."""
        return {"prompt": self.prompt}


OpenAIRequest = ChatCompletionRequest | CompletionRequest


def parse_json_object(body: bytes | str) -> dict[str, Any]:
    """The request body as a JSON object; raises BadRequestError (400, ``invalid_json``) otherwise.

    pydantic's JSON parser, not the json module: it refuses what JSON does not
    allow and Python would accept (NaN, Infinity, lone UTF-16 surrogates that no
    tokenizer can encode) and bounds the nesting depth.
    """
    try:
        data = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


# Any request model validate_request parses (the chat and completions bodies, the Responses API's).
R = TypeVar("R", bound=RequestModel)


def validate_request(
    model: type[R], data: Mapping[str, Any], *, scheduling_policy: str = "fcfs", tool_schemas: bool = True
) -> R:
    """``data`` (a parsed JSON body) as ``model``; raises BadRequestError (400) on any problem.

    ``scheduling_policy``: the engine's (ModelInfo.scheduling_policy): whether ``priority`` and the
    service tiers that shift it are taken. ``tool_schemas``: check the tools' schemas here
    (``ChatCompletionRequest.check_tool_schemas``); False leaves that to the caller, which runs it
    off its event loop.
    """
    try:
        request = model.model_validate(data, context={"scheduling_policy": scheduling_policy})
    except ValidationError as exc:
        raise _format_validation_error(exc) from None
    if isinstance(request, ChatCompletionRequest):
        request.check(tool_schemas=tool_schemas)
    return request


def parse_request(model: type[OpenAIRequest], body: bytes | str, *, scheduling_policy: str = "fcfs") -> OpenAIRequest:
    """Parse a raw JSON body into ``model``; raises BadRequestError (400) on any problem."""
    return validate_request(model, parse_json_object(body), scheduling_policy=scheduling_policy)


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def build(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


def _without_none(handler: SerializerFunctionWrapHandler, model: BaseModel, *names: str) -> dict[str, Any]:
    """``model`` serialized without the keys ``names`` whose value is None (OpenAI leaves them out)."""
    data = handler(model)
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data


class ToolCallOut(BaseModel):
    """A tool call in an answer: ``call_...`` id, type ``function``, name and arguments' JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler, self, "name", "arguments")


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call: the first has id, type and name; later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler, self, "id", "type")


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler, self, "tool_calls")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (its ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler, self, "tool_calls")


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completions answer; a streamed one sends the same object per SSE event."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "prefixserve"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for a base model.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------
# Logprob rendering (the token text comes from the caller's tokenizer)
# ---------------------------------------------------------------------------

TokenText = Callable[[int], str]


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], top_k: int, token_text: TokenText
) -> ChatLogprobs:
    """OpenAI chat ``logprobs.content`` for sampled ``token_ids``.

    ``logprobs[i]`` maps token id to logprob for the top-k plus the sampled token
    of position ``i`` (the engine's StreamDelta format).
    """
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=entry[token_id],
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=(t := token_text(tid)), logprob=lp, bytes=list(t.encode("utf-8")))
                    for tid, lp in _top(entry, top_k)
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: list[int],
    logprobs: Sequence[dict[int, float] | None],
    top_k: int,
    token_text: TokenText,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    An entry of None (an echoed prompt's first token, which nothing predicts) gives
    null logprobs for that token.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry.get(token_id))
        out.top_logprobs.append(
            {token_text(tid): lp for tid, lp in _top(entry, top_k)} if top_k and entry is not None else None
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(
    token_ids: list[int],
    logprobs: Sequence[dict[int, float] | None],
    ranks: Sequence[int | None],
    token_text: TokenText,
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` from the engine's entries (the top-k plus the prompt token)
    and each prompt token's rank: the top-k rank from 1 in logprob order, the prompt token
    has its own rank (past k when it is not among them)."""
    out: PromptLogprobs = []
    for token, entry, own in zip(token_ids, logprobs, ranks, strict=True):
        if entry is None:
            out.append(None)
            continue
        # A prompt token outside the top-k has the lowest logprob here: the others rank 1..k.
        rank = {t: i + 1 for i, t in enumerate(sorted(entry, key=lambda t: -entry[t]))}
        if own is not None:
            rank[token] = own
        out.append({t: PromptLogprob(logprob=entry[t], rank=rank.get(t), decoded_token=token_text(t)) for t in entry})
    return out
