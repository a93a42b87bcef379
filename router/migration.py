"""Moving a stream whose engine replica stopped serving it: what its client has, and whether it may move.

Job: :class:`StreamProgress` records what a stream's client has been sent (sequence 0's token ids,
their text's length, the tool-call ids), from the engine's deltas (the Ray ingress) or from a
replica's progress comments (the standalone router), and builds the :class:`Continuation` another
replica replays (replica/contract/continuation.py); :func:`migration_refusal` says why a stream may
not move (off, several sequences, the per-request limit, the front end draining). Both hosts call
them when a replica dies or ends a stream while stopping: the ingress's RemoteStream
(router/serve/ingress.py) and the standalone router's relay (router/standalone/proxy.py).

Pure logic: no Ray, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.replica.contract.continuation import (
    MIGRATION_DISABLED,
    MIGRATION_DRAINING,
    MIGRATION_LIMIT,
    MIGRATION_SEVERAL_SEQUENCES,
    Continuation,
)
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.stream import StreamDelta


@dataclass
class StreamProgress:
    """What one stream's client has been sent so far (sequence 0; a request of several sequences
    never moves); ``answer_id``: the answer's id, which a stream continued over HTTP keeps."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    call_ids: list[str] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    answer_id: str | None = None

    @classmethod
    def of(cls, continuation: Continuation | None) -> StreamProgress:
        """The progress of a stream that starts as ``continuation`` (a new one when None)."""
        if continuation is None:
            return cls()
        return cls(
            list(continuation.output_token_ids),
            continuation.emitted_chars,
            list(continuation.tool_call_ids),
            continuation.num_prompt_tokens,
        )

    def count(
        self, token_ids: Sequence[int], chars: int, call_ids: Sequence[str] = (), num_prompt_tokens: int | None = None
    ) -> None:
        """Count tokens, characters and tool calls the client is about to get."""
        if num_prompt_tokens is not None:
            self.num_prompt_tokens = num_prompt_tokens
        self.token_ids.extend(token_ids)
        self.chars += chars
        self.call_ids.extend(call_ids)

    def record(self, delta: StreamDelta) -> None:
        """Count an engine delta the client is about to get (another sequence's: nothing)."""
        if delta.index == 0:
            calls = [c.id for c in delta.tool_calls or () if c.id is not None]
            self.count(delta.token_ids, len(delta.text), calls, delta.num_prompt_tokens)

    def record_comment(self, fields: Mapping[str, Any]) -> None:
        """Count a replica's progress comment (``parse_progress``'s fields)."""
        self.count(fields["ids"], fields["chars"], fields.get("calls") or (), fields.get("prompt"))
        if isinstance(fields.get("id"), str):
            self.answer_id = fields["id"]

    def continuation(self, migrations: int) -> Continuation:
        """The Continuation of the stream as it stands (``migrations``: this move included)."""
        if self.num_prompt_tokens is None:
            raise ValueError("a stream with no delta yet is resent whole, not continued")
        return Continuation(
            output_token_ids=tuple(self.token_ids),
            emitted_chars=self.chars,
            num_prompt_tokens=self.num_prompt_tokens,
            tool_call_ids=tuple(self.call_ids),
            migrations=migrations,
        )

    def continuation_field(self, migrations: int) -> dict[str, Any]:
        """The continuation as the HTTP body field ``prefixserve_continuation`` (it needs the answer's id)."""
        if self.answer_id is None:
            raise ValueError("a stream whose answer id is unknown cannot be continued over HTTP")
        return self.continuation(migrations).http_field(self.answer_id)


def migration_refusal(
    request: EngineRequest, *, enabled: bool, migrations: int, max_migrations: int, draining: bool
) -> str | None:
    """Why the stream of ``request``, which has moved ``migrations`` times, may not move again (a
    ``MIGRATION_*`` reason), or None when it may."""
    if not enabled:
        return MIGRATION_DISABLED
    if request.sampling.n != 1:
        return MIGRATION_SEVERAL_SEQUENCES
    if draining:
        return MIGRATION_DRAINING
    if migrations >= max_migrations:
        return MIGRATION_LIMIT
    return None
