"""One sequence's tool-call stream: generated text in, OpenAI content and tool-call deltas out.

Job: feed a sequence's text deltas through its parser (``replica/tool_calling/parsers.py``)
and say what to send: new content, and per call first one delta with its index,
``id`` (``call_...``), type and function name, then its arguments. On the last
delta, the collected result: the content, the calls, and whether parsing failed.
A failed parse (malformed tool-call text) makes the whole text the answer's content
and no calls, as vLLM answers; on a stream, what was not yet sent goes out as
content when no call had started.

A call is sent only once it is whole (its object closed, a string name, an arguments
object), so a stream never carries a call that does not parse: vLLM's hermes parser
streams argument fragments as they come, and a stream cut by ``max_tokens`` then ends
inside a call no client can use. The price is that a call's arguments arrive in one
piece rather than token by token. A sequence cut by ``max_tokens`` (``truncated``)
keeps the whole calls before the cut, in a collected answer as in a stream, and its
finish reason stays ``"length"``; the unfinished call after them is dropped.

Whitespace-only content is held back while the answer may still turn out to be
tool calls, so a stream and a collected answer to the same text agree: a
collected answer's content is None when it has calls and only whitespace
besides.

Pure Python. Deltas and results are plain frozen data (they cross the Ray object
store inside StreamDelta).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from prefixserve.replica.tool_calling.parsers import ParseState, ToolCallParser, valid_call


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of tool call ``index``: the opening one has ``id`` and ``name``, later ones
    only argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A finished tool call: ``arguments`` is the JSON object's text as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallResult:
    """A finished sequence's answer: ``content`` (None when there are calls and nothing else), its calls,
    and ``failed`` when tool-call text was there but did not parse."""

    content: str | None
    calls: tuple[ToolCall, ...]
    failed: bool = False


@dataclass(frozen=True)
class ToolStreamDelta:
    """What one text delta adds: content text and tool-call pieces; ``result`` on the last one."""

    content: str
    tool_calls: tuple[ToolCallDelta, ...]
    result: ToolCallResult | None = None


class ToolCallStream:
    """The tool-call view of one sequence's growing text (one per sequence of a request).

    ``parallel_tool_calls=False`` keeps only the first call.
    """

    def __init__(self, parser: ToolCallParser, parallel_tool_calls: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel_tool_calls
        self.text = ""
        self.sent_content = 0
        # Per started call: its id and how many characters of its arguments were sent.
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    def feed(self, delta: str, finished: bool = False, truncated: bool = False) -> ToolStreamDelta:
        """Add ``delta`` to the text; ``finished`` on the sequence's last delta, ``truncated`` when that
        delta ends it at ``max_tokens`` or the context length (finish reason ``"length"``)."""
        self.text += delta
        state = self.parser.parse(self.text, final=finished)
        if finished and state.error and truncated:
            state = self._whole_calls_before_the_cut()
        if finished and state.error:
            return self._failed()
        if not self.parallel:
            state.calls = state.calls[:1]
        content = self._content(state, finished)
        pieces = self._calls(state)
        if not finished:
            return ToolStreamDelta(content, pieces)
        calls = tuple(ToolCall(self.ids[i], c.name or "", c.arguments) for i, c in enumerate(state.calls))
        kept = state.content if not calls or state.content.strip() else None
        return ToolStreamDelta(content, pieces, ToolCallResult(kept, calls))

    def resume(self, text: str, call_ids: Sequence[str]) -> None:
        """Stand where a stream that was fed ``text`` (and sent what that gave) stood, its calls named
        ``call_ids``: a stream continued on another replica (replica/contract/continuation.py) sends
        only what comes after. The state is the text's alone (the parse reads the whole text, and
        calls are sent only whole), so one feed of it equals the first stream's many. ValueError when
        ``text`` gives another number of sent calls than ``call_ids`` names."""
        self.feed(text)
        if len(call_ids) != len(self.ids):
            raise ValueError(
                f"the continued text has {len(self.ids)} whole tool calls; the stream sent {len(call_ids)}"
            )
        self.ids[:] = call_ids

    def _content(self, state: ParseState, finished: bool) -> str:
        text = state.content
        # Whitespace alone waits: it is no content if calls follow (see the module docstring).
        if len(text) <= self.sent_content or (not text.strip() and not (finished and not state.calls)):
            return ""
        out = text[self.sent_content :]
        self.sent_content = len(text)
        return out

    def _whole_calls_before_the_cut(self) -> ParseState:
        """The text read as if more were coming, keeping its leading whole calls; an error when there
        are none or the text before the cut is malformed (then it is all content, as any failure)."""
        state = self.parser.parse(self.text, final=False)
        whole = 0
        while whole < len(state.calls) and valid_call(state.calls[whole]):
            whole += 1
        state.calls = state.calls[:whole]
        state.error = state.error or not whole
        return state

    def _calls(self, state: ParseState) -> tuple[ToolCallDelta, ...]:
        out: list[ToolCallDelta] = []
        for i, call in enumerate(state.calls):
            if not valid_call(call):
                break  # sent only whole; a later call cannot start before this one
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(ToolCallDelta(index=i, arguments="", id=self.ids[i], name=call.name))
            if len(call.arguments) > self.sent_args[i]:
                out.append(ToolCallDelta(index=i, arguments=call.arguments[self.sent_args[i] :]))
                self.sent_args[i] = len(call.arguments)
        return tuple(out)

    def _failed(self) -> ToolStreamDelta:
        rest = "" if self.ids else self.text[self.sent_content :]
        self.sent_content = len(self.text)
        return ToolStreamDelta(rest, (), ToolCallResult(self.text, (), failed=True))
