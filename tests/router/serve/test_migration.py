"""What a moved stream carries and when it may move (router/migration.py), and which failures
of a replica the ingress continues elsewhere (router/serve/ingress.py ``_lost_replica``)."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError, RayTaskError

from prefixserve.replica.contract.continuation import (
    MIGRATION_DISABLED,
    MIGRATION_DRAINING,
    MIGRATION_LIMIT,
    MIGRATION_REPLICA_DIED,
    MIGRATION_REPLICA_STOPPING,
    MIGRATION_SEVERAL_SEQUENCES,
    SHUTTING_DOWN_CODE,
    Continuation,
)
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.errors import BadRequestError, EngineDeadError, ServiceUnavailableError
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.tool_calling.stream import ToolCallDelta
from prefixserve.router.migration import StreamProgress, migration_refusal
from prefixserve.router.serve.ingress import _lost_replica


def delta(index: int, ids: list[int], text: str, calls: list[ToolCallDelta] | None = None) -> StreamDelta:
    return StreamDelta(
        request_id="r",
        index=index,
        text=text,
        token_ids=ids,
        finish_reason=None,
        num_prompt_tokens=17,
        num_cached_tokens=0,
        num_output_tokens=0,
        tool_calls=calls,
    )


def test_progress_counts_what_sequence_zero_sent_and_builds_its_continuation():
    progress = StreamProgress()
    with pytest.raises(ValueError, match="resent whole"):
        progress.continuation(1)
    progress.record(delta(0, [5, 6], "ab"))
    progress.record(delta(1, [9], "zzz"))  # another sequence: not this stream's
    progress.record(delta(0, [7], "", [ToolCallDelta(0, "", id="call_1", name="f"), ToolCallDelta(0, "{}")]))
    progress.record(delta(0, [8], "cd"))
    assert progress.continuation(2) == Continuation(
        output_token_ids=(5, 6, 7, 8), emitted_chars=4, num_prompt_tokens=17, tool_call_ids=("call_1",), migrations=2
    )


@pytest.mark.parametrize(
    "n, enabled, migrations, draining, want",
    [
        (1, True, 0, False, None),
        (1, True, 2, False, None),
        (1, False, 0, False, MIGRATION_DISABLED),
        (2, True, 0, False, MIGRATION_SEVERAL_SEQUENCES),
        (1, True, 0, True, MIGRATION_DRAINING),
        (1, True, 3, False, MIGRATION_LIMIT),
    ],
)
def test_when_a_stream_may_move(n, enabled, migrations, draining, want):
    request = EngineRequest(prompt="x", sampling=SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0))
    got = migration_refusal(request, enabled=enabled, migrations=migrations, max_migrations=3, draining=draining)
    assert got == want


def test_zero_moves_allowed_is_a_limit():
    request = EngineRequest(prompt="x")
    assert migration_refusal(request, enabled=True, migrations=0, max_migrations=0, draining=False) == MIGRATION_LIMIT


def _in_task(cause: BaseException) -> RayTaskError:
    """``cause`` as Ray raises it from a replica's stream (wrapped in a RayTaskError)."""
    try:
        raise cause
    except BaseException as exc:  # noqa: BLE001 - wrapped as Ray wraps it
        return RayTaskError("generate", "traceback", exc)


@pytest.mark.parametrize(
    "exc, want",
    [
        (RayActorError(), MIGRATION_REPLICA_DIED),
        (_in_task(EngineDeadError("engine loop died")), MIGRATION_REPLICA_DIED),
        (
            _in_task(ServiceUnavailableError("stopping", code=SHUTTING_DOWN_CODE, retry_after_s=1.0)),
            MIGRATION_REPLICA_STOPPING,
        ),
        (_in_task(ServiceUnavailableError("no replica", code="no_replica")), None),
        (_in_task(BadRequestError("bad")), None),
        (ValueError("the request's own fault"), None),
    ],
    ids=["actor-died", "engine-died", "stopping", "other-503", "client-error", "other"],
)
def test_which_failures_continue_elsewhere(exc, want):
    assert _lost_replica(exc) == want
