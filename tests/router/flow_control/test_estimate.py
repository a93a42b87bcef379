"""What flow control reserves before a request ran: from an engine request, and from a raw OpenAI body."""

from __future__ import annotations

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.router.flow_control.estimate import (
    DEFAULT_BODY_MAX_TOKENS,
    estimated_body_tokens,
    estimated_tokens,
)


def test_an_engine_requests_estimate() -> None:
    chat = EngineRequest(messages=[{"role": "user", "content": "x" * 400}], sampling=SamplingParams(max_tokens=10, n=2))
    assert estimated_tokens(chat) == 100 + 20
    ids = EngineRequest(prompt=[1, 2, 3], sampling=SamplingParams(max_tokens=5), max_tokens_default=7)
    assert estimated_tokens(ids) == 3 + 7  # the engine's default applies when the client asked none


def test_a_bodys_estimate() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 80}]}], "max_tokens": 8, "n": 3}
    assert estimated_body_tokens(body) == 20 + 24
    assert estimated_body_tokens({"prompt": [5] * 9, "max_completion_tokens": 1}) == 10
    assert estimated_body_tokens({"prompt": "z" * 40}) == 10 + DEFAULT_BODY_MAX_TOKENS
    # Whatever is malformed counts as nothing: the replica refuses it and the usage settles the reserve.
    assert estimated_body_tokens({"messages": "no", "max_tokens": -1, "n": True}) == DEFAULT_BODY_MAX_TOKENS
    assert estimated_body_tokens(None) == 1
