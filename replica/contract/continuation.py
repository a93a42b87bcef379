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

Plain data (it crosses the Ray object store inside the EngineRequest).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.replica.errors import BadRequestError

# The error code of a stream a stopping replica ends (a 503): a front end may continue it elsewhere.
SHUTTING_DOWN_CODE = "server_shutting_down"
# Why a stream lost its replica (the ``reason`` label of the ingress's migration metric)...
MIGRATION_REPLICA_DIED = "replica_died"
MIGRATION_REPLICA_STOPPING = "replica_stopping"
# ... and what came of it (its ``result`` label): moved, or why not (the stream then ends with an
# in-band error, as without migration; "refused": the next replica could not continue it exactly).
MIGRATION_MIGRATED = "migrated"
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
