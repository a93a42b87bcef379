"""A streamed ``/v1/responses`` answer: OpenAI's event sequence over the engine's deltas.

Job: turn a started :class:`Generation` of the chat request a response runs as into SSE events
(``event: <type>\\ndata: <json>\\n\\n``) in OpenAI's order: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, for text
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call ``response.function_call_arguments.delta`` /
``.done``, then ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when the length limit stopped it).

Invariants:
* ``sequence_number`` counts every event from 0; the deltas of an item concatenate to its done text.
* The finished Response is handed to ``on_finished`` (the front end stores it) before the last event
  is sent, so a client that continues it as soon as it reads that event finds it stored.
* An engine error after the headers were sent ends the stream with an ``error`` event and
  ``response.failed``; a client that goes away cancels the stream, whose ``finally`` closes the
  generation (aborting the engine request). Nothing is stored then.

Framework-free, as serving.py: the protocol modules and the Generation only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai import responses_protocol as rp
from prefixserve.replica.entrypoints.openai.serving import Generation, UsageCounter
from prefixserve.replica.tool_calling.stream import ToolCallDelta

log = logging.getLogger(__name__)


class EventWriter:
    """Numbers and encodes one stream's events."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OutputBuilder:
    """The output items of a streamed answer, opened and closed as its pieces arrive.

    Text opens a message item (closing a function call before it); a tool call's first piece
    (with its id) opens a function_call item (closing what was open). Each method returns the
    events it makes.
    """

    def __init__(self, event: EventWriter) -> None:
        self.event = event
        self.items: list[rp.OutputItem] = []
        self._text: list[str] | None = None  # the open message's text
        self._message_id = ""
        self._call: rp.OutputFunctionCall | None = None  # the open function call

    def _index(self) -> int:
        return len(self.items)

    def text(self, piece: str) -> list[str]:
        events = []
        if self._text is None:
            events += self.close()
            self._text = []
            self._message_id = rp.new_item_id("msg")
            item = rp.OutputMessage(id=self._message_id, status="in_progress", content=[])
            events.append(self.event("response.output_item.added", output_index=self._index(), item=item.model_dump()))
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message_id,
                    output_index=self._index(),
                    content_index=0,
                    part=rp.OutputText(text="").model_dump(),
                )
            )
        self._text.append(piece)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=self._index(),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return events

    def call(self, piece: ToolCallDelta) -> list[str]:
        events = []
        if piece.id is not None or self._call is None:
            events += self.close()
            self._call = rp.OutputFunctionCall(
                id=rp.new_item_id("fc"),
                call_id=piece.id or rp.new_item_id("call"),
                name=piece.name or "",
                arguments="",
                status="in_progress",
            )
            events.append(
                self.event("response.output_item.added", output_index=self._index(), item=self._call.model_dump())
            )
        if piece.arguments:
            self._call.arguments += piece.arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self._call.id,
                    output_index=self._index(),
                    delta=piece.arguments,
                )
            )
        return events

    def close(self, finish_reason: str | None = None) -> list[str]:
        """Close the open item (a message cut by the length limit is ``incomplete``)."""
        events = []
        index = self._index()
        if self._text is not None:
            text = "".join(self._text)
            status: rp.ItemStatus = "incomplete" if finish_reason == "length" else "completed"
            part = rp.OutputText(text=text)
            message = rp.OutputMessage(id=self._message_id, status=status, content=[part])
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    part=part.model_dump(),
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=message.model_dump()))
            self.items.append(message)
            self._text = None
        elif self._call is not None:
            call = self._call.model_copy(update={"status": "completed"})
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=call.model_dump()))
            self.items.append(call)
            self._call = None
        return events


def _pieces(delta: StreamDelta) -> tuple[str, list[ToolCallDelta]]:
    """A delta's text for the user and its tool-call pieces (a request read for tool calls has both)."""
    if delta.content is not None:
        return delta.content, list(delta.tool_calls or ())
    return delta.text, []


async def response_events(
    gen: Generation,
    response: rp.ResponseObject,
    on_finished: Callable[[rp.ResponseObject], None],
) -> AsyncIterator[str]:
    """The SSE events of a streamed response; ``response`` is its in-progress Response object."""
    event = EventWriter()
    builder = OutputBuilder(event)
    usage = UsageCounter()
    finish_reason: str | None = None
    try:
        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        async for delta in gen.deltas():
            usage.update(delta)
            text, calls = _pieces(delta)
            if text:
                for line in builder.text(text):
                    yield line
            for piece in calls:
                for line in builder.call(piece):
                    yield line
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
        for line in builder.close(finish_reason):
            yield line
        status = rp.finished_status(finish_reason)
        final = response.model_copy(
            update={
                "status": status,
                "incomplete_details": rp.IncompleteDetails() if status == "incomplete" else None,
                "output": builder.items,
                "usage": rp.ResponseUsage.of(usage.build()),
            }
        )
        on_finished(final)
        yield event(f"response.{status}", response=final.model_dump())
    except (asyncio.CancelledError, GeneratorExit):  # the client went away: cancelled, or closed at a yield
        log.info("response %s: the client disconnected mid-stream; its engine request is aborted", response.id)
        raise
    except Exception as exc:  # the engine failed mid-stream: say so in-band, the status is sent
        err = api.error_from_exception(exc)
        if err.status_code >= 500:
            log.error("response %s failed mid-stream: %s", response.id, err.message)
        yield event("error", code=err.code, message=err.message, param=err.param)
        failed = response.model_copy(
            update={
                "status": "failed",
                "error": rp.ResponseError(code=_failure_code(err.status_code), message=err.message),
                "output": builder.items,
            }
        )
        yield event("response.failed", response=failed.model_dump())
    finally:
        await gen.close()


def _failure_code(status_code: int) -> str:
    """The Response error's code (OpenAI's vocabulary) of an HTTP status."""
    if status_code == 429:
        return "rate_limit_exceeded"
    if status_code < 500:
        return "invalid_prompt"
    return "server_error"
