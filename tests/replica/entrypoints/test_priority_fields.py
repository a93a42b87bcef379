"""vLLM's ``priority`` and OpenAI's ``service_tier`` on both endpoints: taken under the engine's
priority scheduling policy (the tier shifts the priority), refused under fcfs as before, and a
priority outside the 32-bit range a 400 under either."""

from __future__ import annotations

import json

import pytest
from server_helpers import assert_openai_error

from prefixserve.replica.contract.request import PRIORITY_MAX, PRIORITY_MIN, ModelInfo
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import engine_request
from prefixserve.replica.errors import BadRequestError

REPLICA_OPTIONS = {"engine_kwargs": {"scheduling_policy": "priority"}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def parse(model: type, policy: str, **fields) -> api.OpenAIRequest:
    body = {**CHAT, **fields} if model is api.ChatCompletionRequest else {"prompt": "hi", **fields}
    return api.parse_request(model, json.dumps(body), scheduling_policy=policy)


def refused(model: type, policy: str, **fields) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        parse(model, policy, **fields)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize("model", [api.ChatCompletionRequest, api.CompletionRequest])
def test_fcfs_refuses_a_priority_other_than_0_with_vllms_message(model):
    err = refused(model, "fcfs", priority=3)
    assert err.param == "priority" and err.code == "unsupported_parameter"
    assert err.message.endswith("Got priority 3 but Priority scheduling is not enabled.")
    assert parse(model, "fcfs", priority=0).scheduling_priority() == 0
    assert parse(model, "fcfs", priority=None).scheduling_priority() == 0


@pytest.mark.parametrize("model", [api.ChatCompletionRequest, api.CompletionRequest])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("value", [PRIORITY_MAX + 1, PRIORITY_MIN - 1, 2**70, True, 1.5, "1"])
def test_a_priority_that_is_not_a_32_bit_integer_is_a_400(model, policy, value):
    err = refused(model, policy, priority=value)
    assert err.param == "priority" and err.code == "invalid_value" and "priority must be an integer" in err.message


@pytest.mark.parametrize("model", [api.ChatCompletionRequest, api.CompletionRequest])
def test_the_priority_policy_takes_any_32_bit_priority(model):
    for value in (PRIORITY_MIN, -1, 0, 7, PRIORITY_MAX):
        assert parse(model, "priority", priority=value).scheduling_priority() == value


@pytest.mark.parametrize(
    "tier, priority, expected",
    [
        (None, 5, 5),
        ("auto", 5, 5),
        ("default", 5, 5),
        ("priority", 5, 4),
        ("flex", 5, 6),
        ("priority", PRIORITY_MIN, PRIORITY_MIN),  # saturates at the range's ends
        ("flex", PRIORITY_MAX, PRIORITY_MAX),
    ],
)
def test_service_tier_shifts_the_priority_under_the_priority_policy(tier, priority, expected):
    body = parse(api.ChatCompletionRequest, "priority", priority=priority, service_tier=tier)
    assert body.scheduling_priority() == expected
    info = ModelInfo("m", "m", 128, scheduling_policy="priority")
    assert engine_request(body, info, None).priority == expected


@pytest.mark.parametrize("policy, tier", [("fcfs", "priority"), ("fcfs", "flex"), ("priority", "scale")])
def test_tiers_without_a_meaning_here_keep_their_400(policy, tier):
    err = refused(api.ChatCompletionRequest, policy, service_tier=tier)
    assert err.param == "service_tier" and err.code == "unsupported_value"
    assert f"service_tier {tier!r} is not supported" in err.message


def test_the_priority_reaches_the_engine_through_the_front_end(replica):
    """The server tells validation its engine's policy: a priority and a tier are taken end to end."""
    rendered = replica.request(
        "POST", "/v1/chat/completions/render", json={**CHAT, "priority": 5, "service_tier": "priority"}
    )
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["priority"] == 4
    answer = replica.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": -3})
    assert answer.status_code == 200, answer.text
    error = assert_openai_error(
        replica.request("POST", "/v1/chat/completions", json={**CHAT, "priority": PRIORITY_MAX + 1})
    )
    assert error["param"] == "priority" and error["code"] == "invalid_value"
