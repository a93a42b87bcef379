"""Moving a stream whose engine replica stopped serving it: what its client has, and whether it may move.

Job: :class:`StreamProgress` records what a stream's client has been sent (sequence 0's token ids,
their text's length, the tool-call ids) and builds the :class:`Continuation` another replica
replays (replica/contract/continuation.py); :func:`migration_refusal` says why a stream may not move
(off, several sequences, the per-request limit, the front end draining). The ingress's RemoteStream
(router/serve/ingress.py) calls both when a replica dies or ends a stream while stopping.

Pure logic: no Ray, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    never moves)."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    call_ids: list[str] = field(default_factory=list)
    num_prompt_tokens: int | None = None

    def record(self, delta: StreamDelta) -> None:
        """Count a delta the client is about to get."""
        if delta.index != 0:
            return
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.token_ids.extend(delta.token_ids)
        self.chars += len(delta.text)
        self.call_ids.extend(c.id for c in delta.tool_calls or () if c.id is not None)

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
