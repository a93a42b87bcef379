"""A relayed answer's token usage, read from its end: the prefill work ``placed`` balances, and the
tokens flow control settles a tenant's quota with.

Job: the prompt tokens of a finished request, and how many of them the replica
found cached, from the OpenAI ``usage`` object (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``) at the end of the answer the router
relayed. The Ray ingress reads the same numbers from the engine's stream; the
standalone router sees only bytes, so it keeps the tail of a stream (the usage
chunk comes last, before ``data: [DONE]``, when the client asked for
``stream_options.include_usage``) or the whole of a small JSON answer.

An answer without a readable usage gives None: ``placed`` then balances that
key by request rate alone, as it does without reports. Pure stdlib.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Bytes of a stream's end kept: its last events, the usage chunk among them.
SSE_TAIL_BYTES = 16 * 1024
# Larger JSON answers are not kept for their usage (an answer of n > 1 long choices).
JSON_BODY_BYTES = 256 * 1024


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int | None
    # What flow control settles a tenant's token quota with (0 when the answer does not say).
    completion_tokens: int = 0


def _usage(obj: Any) -> Usage | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        cached = None
    completion = usage.get("completion_tokens")
    if isinstance(completion, bool) or not isinstance(completion, int) or completion < 0:
        completion = 0
    return Usage(prompt, cached, completion)


def usage_of(data: bytes, sse: bool) -> Usage | None:
    """The usage in an answer's kept bytes: a stream's last event carrying one, or a JSON body's."""
    if not sse:
        try:
            return _usage(json.loads(data))
        except (ValueError, UnicodeDecodeError):
            return None
    for event in reversed(data.replace(b"\r\n", b"\n").split(b"\n\n")):
        event = event.strip()
        if not event.startswith(b"data:"):
            continue
        payload = event[len(b"data:") :].strip()
        if payload == b"[DONE]":
            continue
        try:
            found = _usage(json.loads(payload))
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

    def add(self, chunk: bytes) -> None:
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
