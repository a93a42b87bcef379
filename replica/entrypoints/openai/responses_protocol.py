"""OpenAI's Responses API (``/v1/responses``) as a chat request: its models and the translations both ways.

Job: parse a ``POST /v1/responses`` body (the subset vLLM serves), translate it into the data
of a :class:`ChatCompletionRequest` (``instructions`` a leading system message, the input
items chat messages, function tools chat tools, ``max_output_tokens`` the chat's
``max_completion_tokens``, ``text.format`` its ``response_format``), and build the Response
object and its output items from what the chat machinery answered. Everything the chat path
checks (sampling ranges, tools, priority, service tier, limits) it checks for a response too.

Invariants:
* Fields the Responses API defines that this server does not implement are refused (400
  ``unsupported_parameter`` / ``unsupported_value``, the field named) when set to a value
  that would change the answer: built-in tools (web search, file search, computer use, ...),
  ``background: true``, ``conversation``, ``prompt`` templates, ``reasoning`` with an effort
  other than ``none``, ``truncation: "auto"``, ``max_tool_calls``, ``top_logprobs``,
  ``context_management``, the ``message.output_text.logprobs`` include, and input images,
  files and audio. Unknown fields follow the front end's IgnoredFields policy, as for chat.
* Input items translate into chat messages one way, whether they came in the request or are
  output items replayed by a client (the openai-agents SDK sends the previous output back as
  input): an assistant message followed by function calls is one assistant turn with
  ``tool_calls``; a ``function_call_output`` is a ``tool`` message. So a continuation by
  ``previous_response_id`` and one that replays the items render the same prompt.
* Content parts become one string joined by ``"\\n"``, as the chat path joins text parts.
* A ``function_call_output`` answers a call of an earlier item (in the stored conversation or
  in the input), checked here so that the 400 names ``input`` rather than the chat's fields.

Pure data: pydantic and the replica's plain types; no HTTP framework, Ray or torch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from prefixserve.replica.contract.routing import content_text
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.protocol import FUNCTION_NAME, Int, RequestModel
from prefixserve.replica.errors import BadRequestError

# The item types of the Responses API that this server reads.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
# Content parts: text only (an assistant turn replayed from an answer carries output_text).
TEXT_PART_TYPES = ("input_text", "output_text")
# The include values a Responses request may name that would change the answer here.
UNSUPPORTED_INCLUDES = frozenset({"message.output_text.logprobs"})


def new_item_id(prefix: str) -> str:
    """An OpenAI-style id: ``<prefix>_`` and 32 hex digits (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _unsupported_value(message: str, **values: Any) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message, values)


def _unsupported(name: str, allowed: str) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_parameter",
        "{name} is not supported by this server; send {allowed} or omit it",
        {"name": name, "allowed": allowed},
    )


# ---------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------


class TextPart(RequestModel):
    """A text content part; a replayed answer's ``annotations`` and ``logprobs`` are accepted and ignored."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _text_parts_only(value: Any) -> Any:
    """``value`` as a list of text parts (a string is one), refusing any other part by its type."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, Mapping) else getattr(part, "type", None)
            if kind not in TEXT_PART_TYPES:
                raise _unsupported_value(
                    "content parts of type {kind} are not supported by this server (no images, files or audio): "
                    "send input_text parts",
                    kind=repr(kind),
                )
    return value


class MessageItem(RequestModel):
    """A message of the input (``type: "message"`` or no type); an answer's message replayed carries
    ``id`` and ``status``."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_parts_only(value)


class FunctionCallItem(RequestModel):
    """A call the model made (replayed by the client): ``call_id`` is the id its output answers."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The client's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[TextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_parts_only(value)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, Mapping):
        kind = value.get("type")
        return "message" if kind is None else kind if isinstance(kind, str) else None
    if isinstance(value, BaseModel):
        return getattr(value, "type", None) or "message"
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(RequestModel):
    """A function tool in the Responses shape (the chat's ``function`` object, flattened)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool as a chat request carries it."""
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionToolChoice(RequestModel):
    """``tool_choice`` naming one function: ``{"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """``text.format``: plain text, a JSON object, or JSON following ``schema``."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat's ``response_format`` of this format (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise BadRequestError("text.format of type json_schema needs a schema", param="text.format.schema")
        spec: dict[str, Any] = {"name": self.name or "response", "schema": self.schema_}
        if self.description is not None:
            spec["description"] = self.description
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise _unsupported("text.verbosity", '"medium"')
        return value


class ReasoningConfig(RequestModel):
    """``reasoning``: this server serves no reasoning, so only an effort of ``none`` (or unset)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: str | None) -> str | None:
        if value not in (None, "none"):
            raise _unsupported_value(
                'reasoning.effort {effort} is not supported: this server runs no reasoning; send "none" or omit '
                "reasoning",
                effort=repr(value),
            )
        return value

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value: str | None) -> str | None:
        if value is not None:
            raise _unsupported("reasoning summaries", "null")
        return value


class StreamOptions(RequestModel):
    include_obfuscation: bool | None = None  # accepted, ignored: events go unpadded


# Built-in tools of the Responses API (and any other type): refused by name.
def _function_tools_only(value: Any) -> Any:
    if isinstance(value, list):
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            if kind != "function":
                raise _unsupported_value(
                    "tool {i} is of type {kind}: this server runs no built-in tools (web search, file "
                    "search, computer use, code interpreter, MCP, ...); send function tools",
                    i=i,
                    kind=repr(kind),
                )
    return value


def _item_types_served(value: Any) -> Any:
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                continue  # the model's own error names it
            kind = item.get("type", "message")
            if kind not in INPUT_ITEM_TYPES:
                raise _unsupported_value(
                    "item {i} is of type {kind}: this server reads messages, function_call and "
                    "function_call_output items",
                    i=i,
                    kind=repr(kind),
                )
    return value


class ResponsesRequest(RequestModel):
    """Body of ``POST /v1/responses``."""

    model: str | None = None
    input: list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's extensions, as on chat.
    priority: int | None = None
    cache_salt: str | None = None
    # What the Responses API defines and this server does not implement: refused unless harmless.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _served_items(cls, value: Any) -> Any:
        # A string is one user message.
        return [{"role": "user", "content": value}] if isinstance(value, str) else _item_types_served(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        return _function_tools_only(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and value.get("type") != "function":
            raise _unsupported_value(
                "tool_choice of type {kind} is not supported by this server: send none, auto, required or "
                '{{"type": "function", "name": ...}}',
                kind=repr(value.get("type")),
            )
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store_default(cls, value: Any) -> Any:
        return True if value is None else value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("background mode", "false")
        return value

    @field_validator("conversation", "prompt", "max_tool_calls", "context_management", mode="before")
    @classmethod
    def _not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise _unsupported(str(info.field_name), "null")
        return value

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, 0):
            raise _unsupported("top_logprobs", "0")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value not in (None, "disabled"):
            raise _unsupported_value(
                'truncation {value} is not supported: this server never drops input items; send "disabled"',
                value=repr(value),
            )
        return value

    @field_validator("include")
    @classmethod
    def _served_includes(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if name in UNSUPPORTED_INCLUDES:
                raise _unsupported_value("include {name} is not supported by this server", name=repr(name))
        return value

    # -- the chat request ------------------------------------------------------------------------------

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items (a string was one user message)."""
        return list(self.input or ())

    def turn_messages(self, history: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """``history`` (a stored conversation's messages) followed by the input's messages: what this
        response continues, and what a continuation of it starts from (with its output).

        Raises BadRequestError when the input is empty or a function_call_output answers no earlier call.
        """
        new = messages_of(self.input_items())
        if not new:
            raise BadRequestError("input must hold at least one item", param="input", code="invalid_value")
        check_call_outputs(history, new)
        return [*(dict(m) for m in history), *new]

    def chat_data(self, conversation: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The body of the chat request this response runs as: ``instructions`` as the leading system
        message, then ``conversation``; the tools, tool choice, limits and sampling as chat names them."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += [dict(m) for m in conversation]
        data: dict[str, Any] = {"messages": messages, "stream": self.stream}
        if self.tools is not None:
            data["tools"] = [t.chat_tool() for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            data["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            data["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        response_format = fmt.response_format() if fmt is not None else None
        fields = {
            "model": self.model,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": response_format,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
            "prompt_cache_retention": self.prompt_cache_retention,
            "prompt_cache_options": self.prompt_cache_options,
            "service_tier": self.service_tier,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
        }
        data.update((k, v) for k, v in fields.items() if v is not None)
        return data

    # -- the answer ------------------------------------------------------------------------------------

    def response(
        self,
        response_id: str,
        model: str,
        *,
        status: ResponseStatus,
        output: list[OutputItem] | None = None,
        usage: ResponseUsage | None = None,
        created_at: int | None = None,
    ) -> ResponseObject:
        """The Response object answering this request, echoing its settings."""
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()) if created_at is None else created_at,
            status=status,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            model=model,
            output=output or [],
            parallel_tool_calls=self.parallel_tool_calls is not False,
            previous_response_id=self.previous_response_id,
            reasoning=self.reasoning.model_dump() if self.reasoning is not None else None,
            store=self.store,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            text=self.text.model_dump(by_alias=True, exclude_none=True)
            if self.text is not None and self.text.format is not None
            else {"format": {"type": "text"}},
            tool_choice=self.tool_choice.model_dump()
            if isinstance(self.tool_choice, FunctionToolChoice)
            else self.tool_choice or "auto",
            tools=[t.model_dump() for t in self.tools or ()],
            usage=usage,
            user=self.user,
            safety_identifier=self.safety_identifier,
            metadata=dict(self.metadata or {}),
            service_tier=self.service_tier or "auto",
            prompt_cache_key=self.prompt_cache_key,
            prompt_cache_retention=self.prompt_cache_retention,
        )


def messages_of(items: Sequence[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[dict[str, Any]]:
    """The chat messages of input (or replayed output) items; function calls join the assistant turn
    before them."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: list[TextPart]) -> str:
    return content_text([{"type": "text", "text": p.text} for p in content])


def check_call_outputs(history: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> None:
    """BadRequestError (400, param ``input``) for a function_call_output whose call_id no earlier call has."""
    called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    for message in new:
        called.update(c["id"] for c in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise BadRequestError(
                f"No tool call found for function call output with call_id {message['tool_call_id']}.",
                param="input",
                code="invalid_value",
            )


# ---------------------------------------------------------------------------
# The answer
# ---------------------------------------------------------------------------

ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """An assistant message of the output."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A function call of the output: ``call_id`` (``call_...``) is what the client's output answers."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: api.Usage) -> ResponseUsage:
        """The chat's usage in the Responses shape."""
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
        )


class IncompleteDetails(BaseModel):
    # The one reason this server stops early: the length limit.
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The Response object, as OpenAI answers it (and as GET returns it once stored)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str = "auto"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    def output_text(self) -> str:
        """The text of the output's messages, joined (the client's ``output_text``)."""
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


def finished_status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    """A finished answer's status: ``incomplete`` when the length limit stopped it."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: api.ChatResponseMessage, finish_reason: str | None) -> list[OutputItem]:
    """The output items of a chat answer's message: its text as a message item (when it has text),
    then one function_call item per tool call."""
    items: list[OutputItem] = []
    if message.content:
        status: ItemStatus = "incomplete" if finish_reason == "length" else "completed"
        items.append(OutputMessage(id=new_item_id("msg"), status=status, content=[OutputText(text=message.content)]))
    for call in message.tool_calls or ():
        items.append(
            OutputFunctionCall(
                id=new_item_id("fc"),
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status="completed",
            )
        )
    return items


def output_messages(items: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """The chat messages of output items, as a later turn that replays them renders them."""
    replayed: list[MessageItem | FunctionCallItem | FunctionCallOutputItem] = []
    for item in items:
        if isinstance(item, OutputMessage):
            parts = [TextPart(type="output_text", text=p.text) for p in item.content]
            replayed.append(MessageItem(type="message", role="assistant", content=parts))
        else:
            replayed.append(
                FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
            )
    return messages_of(replayed)
