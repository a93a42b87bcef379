"""A stream's continuation: where a request stood when its replica stopped serving it.

When the engine replica serving a stream dies or ends it while stopping, the front end (the Ray
ingress) sends the same request to another replica with a :class:`Continuation`: the token ids its
client has already been sent and how much of their text. The new replica computes the prompt and
those tokens as one prefill (prefix-cache hits included), replays them through everything that reads
the output (the detokenizer and its stop-string search, the grammar matcher, the tool-call parser,
penalties, ``min_tokens``, a seeded generator's position) without sending them again, and streams on
from there: the client sees one stream, with no gap in its text or its usage figures.

Only what continues exactly is continued: one sequence (``n`` 1), and the replica refuses a
continuation whose prompt does not tokenize to ``num_prompt_tokens`` tokens, whose tokens the
output already ends with, or whose text it cannot reproduce (``ContinuationMismatchError``).
Greedy and seeded requests then produce the tokens an undisturbed run would have (up to the
floating-point differences between a prefill and a decode step, the same as a preemption's
recompute); an unseeded sample goes on as a sample of the same distribution.

Over HTTP (the standalone router in front of prefixserve replicas), the same exchange has two
parts. A front end that sends ``X-Prefixserve-Stream-Progress: 1`` gets, in the replica's SSE stream,
an SSE comment line (``: progress {json}``, which clients ignore) at the head of each event that
brings sequence 0 tokens (a comment-only event when they bring no text yet): ``ids`` the event's
token ids, ``chars`` their text's length, ``calls`` the ids of tool calls it opens; the first one
also ``prompt`` (the prompt's token count) and ``id`` (the answer's id). The router strips them and
counts what its client has. To continue, it sends the request again with the body field
``prefixserve_continuation``: ``{"id", "output_token_ids", "emitted_chars", "num_prompt_tokens",
"tool_call_ids", "migrations"}``; that replica's stream keeps the answer's id and opens no role
delta (nor a completion's echo) again.

Plain data (it crosses the Ray object store inside the EngineRequest).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.replica.errors import BadRequestError

# The request header that asks a replica's SSE stream for progress comments (the module docstring).
STREAM_PROGRESS_HEADER = "X-Prefixserve-Stream-Progress"
# The start of a progress comment line.
PROGRESS_COMMENT = ": progress "
# The request body field of a continuation over HTTP.
CONTINUATION_FIELD = "prefixserve_continuation"
# The error code of a stream a stopping replica ends (a 503): a front end may continue it elsewhere.
SHUTTING_DOWN_CODE = "server_shutting_down"
# Why a stream lost its replica (the ``reason`` label of the ingress's migration metric)...
MIGRATION_REPLICA_DIED = "replica_died"
MIGRATION_REPLICA_STOPPING = "replica_stopping"
# ... and what came of it (its ``result`` label): moved, or why not (the stream then ends with an
# in-band error, as without migration; "refused": the next replica could not continue it exactly).
MIGRATION_MIGRATED = "migrated"
MIGRATION_NO_REPLICA = "no_replica"
MIGRATION_DISABLED = "disabled"
MIGRATION_SEVERAL_SEQUENCES = "several_sequences"
MIGRATION_LIMIT = "limit"
MIGRATION_DRAINING = "draining"
MIGRATION_REFUSED = "refused"


class ContinuationMismatchError(BadRequestError, default_code="continuation_mismatch"):
    """A continuation the replica cannot take exactly (400)."""


@dataclass(frozen=True)
class Continuation:
    """The part of a stream its client already has.

    ``output_token_ids``: every token id sent (sequence 0); ``emitted_chars``: how many characters of
    their text were sent (text a possible stop string held back is not); ``num_prompt_tokens``: the
    prompt's length as the first replica counted it (the check that both tokenize it alike);
    ``tool_call_ids``: the ids of the tool calls already sent, in order, which the calls keep;
    ``migrations``: how many times the stream has moved, this move included.
    """

    output_token_ids: tuple[int, ...]
    emitted_chars: int
    num_prompt_tokens: int
    tool_call_ids: tuple[str, ...] = ()
    migrations: int = 1

    def __post_init__(self) -> None:
        if self.emitted_chars < 0 or self.num_prompt_tokens < 1 or self.migrations < 1:
            raise ValueError(f"a continuation needs counts >= 0 (prompt, migrations >= 1): {self!r}")

    def http_field(self, answer_id: str) -> dict[str, Any]:
        """The value of the request body field ``CONTINUATION_FIELD`` (the module docstring): this
        continuation, and the id of the answer the continued stream keeps."""
        return {
            "id": answer_id,
            "output_token_ids": list(self.output_token_ids),
            "emitted_chars": self.emitted_chars,
            "num_prompt_tokens": self.num_prompt_tokens,
            "tool_call_ids": list(self.tool_call_ids),
            "migrations": self.migrations,
        }


def progress_comment(
    token_ids: Sequence[int],
    chars: int,
    call_ids: Sequence[str] = (),
    *,
    prompt_tokens: int | None = None,
    answer_id: str | None = None,
) -> str:
    """One progress comment line (its newline included): what an event brings (the module docstring)."""
    fields: dict[str, Any] = {"ids": list(token_ids), "chars": chars}
    if call_ids:
        fields["calls"] = list(call_ids)
    if prompt_tokens is not None:
        fields["prompt"] = prompt_tokens
    if answer_id is not None:
        fields["id"] = answer_id
    return PROGRESS_COMMENT + json.dumps(fields, separators=(",", ":")) + "\n"


def parse_progress(line: str) -> dict[str, Any]:
    """The fields of a progress comment line (without its newline); ValueError when it is not one."""
    if not line.startswith(PROGRESS_COMMENT):
        raise ValueError("not a progress comment")
    fields = json.loads(line[len(PROGRESS_COMMENT) :])
    if not isinstance(fields, dict):
        raise ValueError(f"a malformed progress comment: {line[:200]!r}")
    ids, chars = fields.get("ids"), fields.get("chars")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not isinstance(chars, int):
        raise ValueError(f"a malformed progress comment: {line[:200]!r}")
    return dict(fields)
