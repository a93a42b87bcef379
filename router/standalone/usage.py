"""A relayed answer's token usage, read from its end: the prefill work ``placed`` balances, and the
tokens flow control settles a tenant's quota with.

Job: the prompt tokens of a finished request, and how many of them the replica
found cached, from the OpenAI ``usage`` object (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``) at the end of the answer the router
relayed. The Ray ingress reads the same numbers from the engine's stream; the
standalone router sees only bytes, so it keeps the tail of a stream (the usage
chunk comes last, before ``data: [DONE]``, when the client asked for
``stream_options.include_usage``) or the whole of a small JSON answer.

A Responses answer (``/v1/responses``) names its counts ``input_tokens``,
``input_tokens_details.cached_tokens`` and ``output_tokens``, in the Response object or, streamed,
in the Response its last event (``response.completed``) carries; its ``id`` (``response_id``) is
where the router sends a continuation of it.

An answer without a readable usage gives None: ``placed`` then balances that
key by request rate alone, as it does without reports. Pure stdlib.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Bytes of a stream's end kept: its last events, the usage chunk among them.
SSE_TAIL_BYTES = 16 * 1024
# Larger JSON answers are not kept for their usage (an answer of n > 1 long choices).
JSON_BODY_BYTES = 256 * 1024
# A stream's first event kept for its Response id (response.created repeats the request's instructions).
HEAD_BYTES = 256 * 1024


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int | None
    # What flow control settles a tenant's token quota with (0 when the answer does not say).
    completion_tokens: int = 0


def _response_object(obj: Any) -> Any:
    """The Response a Responses stream event carries (``{"type": "response.completed", "response": ...}``),
    else ``obj`` itself."""
    if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
        return obj["response"]
    return obj


def _usage(obj: Any) -> Usage | None:
    obj = _response_object(obj)
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    responses = "input_tokens" in usage  # the Responses API's names
    prompt = usage.get("input_tokens" if responses else "prompt_tokens")
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
        return None
    details = usage.get("input_tokens_details" if responses else "prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        cached = None
    completion = usage.get("output_tokens" if responses else "completion_tokens")
    if isinstance(completion, bool) or not isinstance(completion, int) or completion < 0:
        completion = 0
    return Usage(prompt, cached, completion)


def _response_id(obj: Any) -> str | None:
    obj = _response_object(obj)
    if isinstance(obj, dict) and obj.get("object") == "response" and isinstance(obj.get("id"), str):
        return str(obj["id"])
    return None


def usage_of(data: bytes, sse: bool) -> Usage | None:
    """The usage in an answer's kept bytes: a stream's last event carrying one, or a JSON body's."""
    return _last(data, sse, _usage)


def response_id_of(data: bytes, sse: bool) -> str | None:
    """The id of the Response in an answer's kept bytes (a Responses answer), else None."""
    return _last(data, sse, _response_id)


def _last(data: bytes, sse: bool, read: Callable[[Any], T | None]) -> T | None:
    """``read`` of a JSON body, or of the last event of a stream's tail it finds something in."""
    if not sse:
        try:
            return read(json.loads(data))
        except (ValueError, UnicodeDecodeError):
            return None
    for event in reversed(data.replace(b"\r\n", b"\n").split(b"\n\n")):
        # An event's data line (a Responses event has an ``event:`` line before it).
        lines = [line for line in event.strip().split(b"\n") if line.startswith(b"data:")]
        if not lines:
            continue
        payload = lines[-1][len(b"data:") :].strip()
        if payload == b"[DONE]":
            continue
        try:
            found = read(json.loads(payload))
        except (ValueError, UnicodeDecodeError):
            continue  # the first event of the tail may be cut
        if found is not None:
            return found
    return None


class AnswerTail:
    """The bytes of an answer kept for ``usage_of``, bounded (the module docstring)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.data = bytearray()
        self.whole = True  # a JSON answer kept whole so far
        # A stream's first event, kept whole up to HEAD_BYTES: a Responses stream's response.created
        # names the response however long the stream's last event (which repeats the whole Response).
        self.head = bytearray()
        self.head_done = not sse

    def add(self, chunk: bytes) -> None:
        if not self.head_done:
            self.head += chunk[: HEAD_BYTES - len(self.head) + 1]
            if b"\n\n" in self.head.replace(b"\r\n", b"\n") or len(self.head) > HEAD_BYTES:
                self.head_done = True
        if self.sse:
            self.data += chunk
            if len(self.data) > SSE_TAIL_BYTES:
                del self.data[: len(self.data) - SSE_TAIL_BYTES]
        elif self.whole:
            self.data += chunk
            if len(self.data) > JSON_BODY_BYTES:
                self.whole = False
                self.data.clear()

    def usage(self) -> Usage | None:
        if not self.data or not (self.sse or self.whole):
            return None
        return usage_of(bytes(self.data), self.sse)

    def response_id(self) -> str | None:
        if self.sse:
            head = bytes(self.head).replace(b"\r\n", b"\n").split(b"\n\n")[0]
            return response_id_of(head, True) or response_id_of(bytes(self.data), True)
        return response_id_of(bytes(self.data), False) if self.data and self.whole else None
