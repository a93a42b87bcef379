"""Structured output through the real front end (replica/entrypoints/openai/server.py's app, in process) and a tiny
engine: response_format, structured_outputs and guided_* on both endpoints, streaming, and the 400s."""

from __future__ import annotations

import json
import re

import pytest
from server_helpers import assert_openai_error

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["s", "m", "l"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["size", "count"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "hello"}]
REPLICA_OPTIONS = dict(max_model_len=256)  # conftest's replica: an InProcessReplica on the shared ckpt


def post(replica, path: str, body: dict):
    return replica.request("POST", path, json={"max_tokens": 40, "temperature": 0, **body})


def test_response_format_json_schema_on_chat(replica):
    r = post(
        replica,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "shirt", "strict": True, "schema": SCHEMA},
            },
            "structured_outputs": None,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert value["size"] in ("s", "m", "l") and 1 <= value["count"] <= 9
    else:
        assert choice["message"]["content"].lstrip().startswith("{")


@pytest.mark.parametrize(
    "body, check",
    [
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_regex": r"[a-f]{4}"}, lambda t: re.fullmatch(r"[a-f]{4}", t)),
        ({"structured_outputs": {"choice": ["up", "down"], "json": None}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ],
)
def test_vllm_fields_on_completions_and_streams(replica, body, check):
    r = post(replica, "/v1/completions", {"prompt": "Answer:", **body})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert check(text) and r.json()["choices"][0]["finish_reason"] == "stop", text
    s = post(replica, "/v1/chat/completions", {"messages": CHAT, "stream": True, "n": 2, **body})
    assert s.status_code == 200, s.text
    events = [json.loads(line[6:]) for line in s.text.split("\n") if line.startswith("data: {")]
    texts = ["", ""]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert all(check(t) for t in texts), texts


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            None,
            "Unsupported type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
        ({"guided_regex": "(("}, None, "parenthesis"),
        ({"guided_grammar": "root ::= nothing_here"}, None, "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "unknown field"),
        # Refused before compiling: xgrammar would take minutes over it (limits.py).
        ({"guided_json": {"type": "string", "pattern": "^a{30000}$"}}, None, "max_grammar_repeat"),
        ({"guided_regex": "(b{200}){200}"}, None, "max_grammar_repeat"),
        ({"guided_json": {"type": "array", "maxItems": 10**9}}, None, "max_grammar_length"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(replica, body, param, message):
    for path, prompt in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
        r = post(replica, path, {**prompt, **body})
        err = assert_openai_error(r)
        assert r.status_code == 400 and message in err["message"], err
        if param is not None:
            assert err["param"] == param, err
    ok = post(replica, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


def test_metrics_show_requests_compiles_and_cache_hits(replica):
    for _ in range(2):
        assert post(replica, "/v1/completions", {"prompt": "x", "guided_regex": "[0-9]{2}"}).status_code == 200
    text = replica.request("GET", "/metrics").text
    assert 'prefixserve:structured_output_requests_total{engine="0",kind="regex"' in text
    assert "prefixserve:grammar_compile_seconds_bucket" in text
    hits = [line for line in text.splitlines() if line.startswith("prefixserve:grammar_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 1
