"""Structured output: the params' validation, the xgrammar backend, and constrained decoding."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from model_helpers import shared_prefix_prompts

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarRejected, GrammarTimeoutError
from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.structured_output.state import SequenceGrammar


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "string"}'}, "json"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"json_object": True}, "json_object"),
    ],
)
def test_params_one_kind(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    assert len(params.key) == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
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
    ],
)
def test_params_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_key_is_the_schema_text_in_its_own_order_and_separates_kinds():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"a": {"type": "integer"}}}')
    c = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key
    assert a.key != c.key  # property order is the output's order: a different grammar
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


def test_sampling_params_field():
    assert SamplingParams().structured_outputs is None
    so = StructuredOutputsParams(choice=["x"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


# -- the engine, on a tiny random checkpoint with SmolLM2's tokenizer and the real xgrammar -----------------

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2}-[a-c]{2}"
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=7, prefix_len=40, n=8, lo=3, hi=20)


def constrained(kind: str, **kw) -> SamplingParams:
    spec = {
        "json": {"json": SCHEMA},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
        "json_object": {"json_object": True},
    }[kind]
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": 48, **kw}, structured_outputs=StructuredOutputsParams(**spec)
    )


def check_output(kind: str, text: str, finish_reason: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text) and finish_reason == "stop", text
    elif kind == "choice":
        assert text in CHOICES and finish_reason == "stop", text
    elif finish_reason == "stop":
        value = json.loads(text)
        assert isinstance(value, dict)
        if kind == "json":
            jsonschema.validate(value, SCHEMA)
    else:  # a random model may pad JSON with whitespace up to max_tokens: still a valid prefix
        assert finish_reason == "length" and text.lstrip()[:1] == "{", text


KINDS_CYCLE = ["json", "regex", "choice", "json_object", None]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=8),  # chunked prefill
        dict(num_kv_blocks=9, max_num_batched_tokens=64),  # recompute preemption
        dict(num_kv_blocks=9, max_num_batched_tokens=64, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["caching", "chunked-8", "recompute", "swap"],
)
def test_constrained_batch_follows_constraints_and_free_rows_are_unchanged(ckpt, prompts, knobs):
    free = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(ckpt, **knobs) as llm:
        alone = llm.generate(prompts, free)
        kinds = [KINDS_CYCLE[i % len(KINDS_CYCLE)] for i in range(len(prompts))]
        params = [free if k is None else constrained(k) for k in kinds]
        mixed = llm.generate(prompts, params)
        if "num_kv_blocks" in knobs:
            assert llm.engine.scheduler.num_preemptions > 0
    for kind, a, m in zip(kinds, alone, mixed, strict=True):
        out = m.outputs[0]
        if kind is None:
            assert out.token_ids == a.outputs[0].token_ids  # unconstrained rows pay nothing, change nothing
        else:
            check_output(kind, out.text, str(out.finish_reason))


def test_n_children_each_follow_the_grammar(ckpt, prompts):
    with LLM(ckpt) as llm:
        [out] = llm.generate(prompts[:1], constrained("regex", n=4, temperature=1.0, seed=5))
    texts = [o.text for o in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1  # one matcher per child: they sample independently


def test_schema_that_cannot_finish_in_max_tokens_ends_with_length(ckpt, prompts):
    with LLM(ckpt) as llm:
        [out] = llm.generate(prompts[:1], constrained("json", max_tokens=3))
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
        [again] = llm.generate(prompts[:1], constrained("choice"))  # the engine still serves
    assert again.outputs[0].text in CHOICES


def test_sequence_grammar_replays_when_the_outputs_were_rebuilt(ckpt, prompts):
    with LLM(ckpt) as llm:
        [out] = llm.generate(prompts[:1], constrained("regex"))
        backend = llm.engine.grammars.backend
        grammar = llm.engine.grammars.get(StructuredOutputsParams(regex=REGEX))
    state = SequenceGrammar.start(grammar, backend)
    tokens = out.outputs[0].token_ids
    state.sync(tokens[:3])  # a fresh matcher behind the sequence: replayed
    assert state.num_accepted == 3
    for t in tokens[3:]:
        state.accept(t)
    assert state.terminated
    with pytest.raises(RuntimeError, match="does not allow"):
        SequenceGrammar.start(grammar, backend).accept(tokens[-1])  # EOS before any digit


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "nope"}}, "Unsupported type"),
        ({"json": {"$ref": "#/definitions/missing"}}, "json cannot be compiled"),
        ({"regex": "(("}, "parenthesis"),
        ({"grammar": "root ::= undefined_rule"}, "not defined"),
    ],
)
def test_uncompilable_constraints_are_rejected_before_the_engine(ckpt, prompts, spec, message):
    with LLM(ckpt) as llm:
        with pytest.raises(GrammarRejected, match=message):
            llm.engine.add_request(None, prompts[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
        assert not llm.engine.requests
        failures = llm.engine.structured_metrics.failures["invalid"]._value.get()
    assert failures == 1


async def test_async_engine_compiles_off_the_loop_with_a_time_bound_and_caches(ckpt, prompts):
    engine = AsyncEngine(EngineConfig(model=ckpt, grammar_compile_timeout_s=30.0))
    try:
        params = constrained("choice")
        texts = []
        for _ in range(2):
            texts.append("".join([d.text async for d in engine.generate(prompts[0], params)]))
        assert all(t in CHOICES for t in texts) and texts[0] == texts[1]
        m = engine.engine.structured_metrics
        assert (m.cache_misses._value.get(), m.cache_hits._value.get()) == (1, 1)
        assert m.requests["choice"]._value.get() == 2
        # A bound no compile meets: refused (the 400 of the front ends), the engine never saw it.
        engine.engine.grammars.timeout_s = 1e-9
        big = {
            "type": "object",
            "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(60)},
        }
        with pytest.raises(GrammarTimeoutError, match="did not compile within"):
            async for _ in engine.generate(
                prompts[0], SamplingParams(structured_outputs=StructuredOutputsParams(json=big))
            ):
                pass
        assert m.failures["timeout"]._value.get() == 1
        engine.engine.grammars.timeout_s = 30.0
        text = "".join([d.text async for d in engine.generate(prompts[1], constrained("regex"))])
        assert re.fullmatch(REGEX, text)
        assert not engine.engine.requests
    finally:
        await engine.shutdown()


def test_processed_logprobs_of_a_constrained_row_list_only_tokens_it_may_take(ckpt, prompts):
    params = SamplingParams(temperature=0.0, logprobs=5, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    with LLM(ckpt, logprobs_mode="processed_logprobs") as llm:
        [out] = llm.generate(prompts[:1], params)
        allowed = set(llm.tokenizer.convert_tokens_to_ids(["x", "y"]))
    entries = out.outputs[0].logprobs
    assert entries and all(math.isfinite(v) for entry in entries for v in entry.values())
    assert set(entries[0]) <= allowed
    # The default, vLLM's raw_logprobs: the model's own top 5, before the grammar's mask, and the same token.
    with LLM(ckpt) as llm:
        [raw] = llm.generate(prompts[:1], params)
    assert raw.outputs[0].token_ids == out.outputs[0].token_ids
    assert len(raw.outputs[0].logprobs[0]) >= 5 and not set(raw.outputs[0].logprobs[0]) <= allowed
