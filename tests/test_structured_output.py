"""Structured output: the params' validation, the xgrammar backend, and constrained decoding."""

from __future__ import annotations

import pytest

from prefixserve.replica.sampling import SamplingParams
from prefixserve.replica.structured_output.params import StructuredOutputsParams


@pytest.mark.parametrize("kwargs, kind", [
    ({"json": {"type": "object"}}, "json"),
    ({"json": '{"type": "string"}'}, "json"),
    ({"regex": "[a-z]+"}, "regex"),
    ({"choice": ["yes", "no"]}, "choice"),
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"json_object": True}, "json_object"),
])
def test_params_one_kind(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    assert len(params.key) == 64


@pytest.mark.parametrize("kwargs, message", [
    ({}, "must set one of"),
    ({"json": {}, "regex": "a"}, "only one kind"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "schema object"),
    ({"json": 3}, "JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"json_object": False}, "must set one of"),
    ({"grammar": "x" * 70000}, "at most"),
])
def test_params_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_key_ignores_key_order_and_separates_kinds():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


def test_sampling_params_field():
    assert SamplingParams().structured_outputs is None
    so = StructuredOutputsParams(choice=["x"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
