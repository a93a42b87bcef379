"""Tool-call parsers: a model's generated text -> content and tool calls (vLLM's ``--tool-call-parser``).

Job: read the text a model family writes when it calls tools and say, for any
prefix of it, what is already known: the content (text for the user) that can
no longer turn into a tool call, and each call's name and the raw text of its
arguments so far. ``parse(text, final=False)`` is the streaming view (it holds
back what may still become markup); ``parse(text, final=True)`` the finished
one, which also says whether the tool-call part is well formed.

Parsers, by vLLM's names:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block
  per call (NousResearch Hermes, Qwen2.5, the ChatML tool template shipped in
  ``replica/tool_calling/chat_templates/``); the content is the text before the first block.
* ``llama3_json``: Llama 3.x's JSON tool calls: the output starts with
  ``<|python_tag|>`` or ``{`` and holds ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``; any other output is plain content.

And the two the front end picks from ``tool_choice`` (their output is constrained
to a JSON schema, so they read bare JSON):

* :class:`NamedFunctionParser` (``tool_choice`` naming a function): the whole
  output is that function's arguments object.
* :class:`RequiredParser` (``tool_choice="required"``): the output is a JSON array of
  ``{"name": ..., "parameters": {...}}`` (vLLM's schema for ``required``).

Invariant (what the streaming tests check): for any split of a text into
deltas, each streaming view's content and each call's arguments are prefixes
of the final view's, so streamed fragments concatenate to the collected answer.

Pure Python (json only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from prefixserve.replica.tool_calling.json_scan import ObjectScan, scan_object, skip_ws, value_end

# Keys that hold a call's arguments: Hermes writes "arguments", Llama 3 "parameters".
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class PartialCall:
    """One tool call as far as the text goes: ``name`` once complete, ``arguments`` raw JSON text so far."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ParseState:
    """A parser's reading of a text: content, calls, and (final only) whether the calls part is malformed."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)
    error: bool = False


class ToolCallParser(Protocol):
    """Reads one model family's tool-call text (see the module docstring)."""

    def parse(self, text: str, final: bool) -> ParseState: ...


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _call(text: str, obj: ObjectScan, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> PartialCall | None:
    """The call an object scan describes; None when its ``name`` is not a string or its arguments not an object."""
    name = None
    span = obj.fields.get("name")
    if span is not None and span.complete:
        try:
            value = json.loads(text[span.start : span.end])
        except ValueError:
            return None
        if not isinstance(value, str):
            return None
        name = value
    args_span = next((obj.fields[k] for k in argument_keys if k in obj.fields), None)
    if args_span is None:
        arguments = "{}" if obj.end is not None else ""
    else:
        arguments = text[args_span.start : args_span.end]
        if arguments and arguments[0] != "{":
            return None
    return PartialCall(name, arguments, obj.end is not None)


def valid_call(call: PartialCall) -> bool:
    """A finished call: a name and an arguments text that parses to a JSON object."""
    if not call.complete or call.name is None:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _take_call(state: ParseState, text: str, pos: int) -> int | None:
    """Scan the call object at ``pos`` into ``state``; the index past it, or None where parsing stops:
    the object is no call (``state.error`` set) or has not ended yet."""
    obj = scan_object(text, pos)
    call = None if obj.error else _call(text, obj)
    if call is None:
        state.error = True
        return None
    state.calls.append(call)
    return obj.end


def _finish(state: ParseState, final: bool) -> ParseState:
    if final and not state.error and not all(valid_call(c) for c in state.calls):
        state.error = True
    return state


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (vLLM's ``hermes``)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParseState:
        first = text.find(self.START)
        if first < 0:
            held = 0 if final else _held_prefix(text, self.START)
            return ParseState(text[: len(text) - held])
        state = ParseState(text[:first])
        pos, n = first, len(text)
        while text.startswith(self.START, pos):
            j = skip_ws(text, pos + len(self.START))
            if j >= n:
                state.error = final
                break
            end = _take_call(state, text, j)
            if end is None:
                break
            k = skip_ws(text, end)
            if text.startswith(self.END, k):
                pos = skip_ws(text, k + len(self.END))
            elif k >= n or (not final and self.END.startswith(text[k:])):
                break  # the end tag is still coming (or, finished, was left off: vLLM accepts that)
            else:
                state.error = True
                break
        return _finish(state, final)


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: ``<|python_tag|>`` or ``{`` first, objects separated by ``;`` (vLLM's
    ``llama3_json``)."""

    BOT = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParseState:
        start = skip_ws(text, 0)
        rest = text[start:]
        if not rest or (not final and self.BOT.startswith(rest)):
            return ParseState(text if final else "")
        if rest.startswith(self.BOT):
            start = skip_ws(text, start + len(self.BOT))
        elif rest[0] != "{":
            return ParseState(text)
        state = ParseState("")
        pos, n = start, len(text)
        while pos < n:
            if text[pos] != "{":
                state.error = True
                break
            end = _take_call(state, text, pos)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos < n:
                if text[pos] != ";":
                    state.error = True
                    break
                pos = skip_ws(text, pos + 1)
        if final and not state.calls:
            state.error = True
        return _finish(state, final)


class NamedFunctionParser:
    """The output is the arguments object of the one function ``tool_choice`` names."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ParseState:
        j = skip_ws(text, 0)
        state = ParseState("")
        if j >= len(text):
            state.error = final
            return state
        if text[j] != "{":
            state.error = True
            return state
        end = value_end(text, j)
        complete = end is not None and skip_ws(text, end) == len(text)
        if end is not None and not complete:
            state.error = True  # anything but whitespace after the object
        state.calls.append(PartialCall(self.name, text[j : end if end is not None else len(text)], end is not None))
        return _finish(state, final)


class RequiredParser:
    """The output is a JSON array of ``{"name", "parameters"}`` objects (``tool_choice="required"``)."""

    def parse(self, text: str, final: bool) -> ParseState:
        state = ParseState("")
        n = len(text)
        j = skip_ws(text, 0)
        if j >= n:
            state.error = final
            return state
        if text[j] != "[":
            state.error = True
            return state
        j = skip_ws(text, j + 1)
        closed = False
        while j < n:
            if text[j] == "]" and not state.calls:
                closed = True
                break
            end = _take_call(state, text, j)
            if end is None:  # an error stays one through the checks below
                break
            j = skip_ws(text, end)
            if j >= n:
                break
            if text[j] == "]":
                closed = True
                break
            if text[j] != ",":
                state.error = True
                return state
            j = skip_ws(text, j + 1)
        if final and (not closed or not state.calls or skip_ws(text, j + 1) != n):
            state.error = True
        return _finish(state, final)


# vLLM's --tool-call-parser names.
TOOL_CALL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}") from None
