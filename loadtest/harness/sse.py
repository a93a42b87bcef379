"""An OpenAI streaming response (server-sent events) read as decoded JSON events.

Each ``data:`` line is one event until ``data: [DONE]``; other lines (blank,
comments, ``event:``) carry nothing for a client. An event with an ``error`` key
is yielded like any other: what a failure means is the caller's to say.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

_DONE = object()


def _decode(line: str | bytes) -> Any:
    """The event of one line, None for a line without one, ``_DONE`` at the end of the stream."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


def iter_events(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """The events of a stream read line by line (raises json.JSONDecodeError on a garbled one)."""
    for line in lines:
        event = _decode(line)
        if event is _DONE:
            return
        if event is not None:
            yield event


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """:func:`iter_events` over an async line source, such as httpx's ``response.aiter_lines()``."""
    async for line in lines:
        event = _decode(line)
        if event is _DONE:
            return
        if event is not None:
            yield event


def starts_output(event: dict[str, Any]) -> bool:
    """Whether a chat event carries generated content or a finish: the mark of the first token."""
    return any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in event.get("choices") or ())
