"""A stream continued on another engine (replica/contract/continuation.py): cut a finished stream
after any of its deltas, hand what the client had to a second engine as a Continuation, and the
two parts together equal the undisturbed stream: tokens, text, usage, finish reason. Greedy, seeded
sampling with penalties, stop strings (held-back text and a stop reached after the cut), a JSON
schema, a tool call; and the continuations the engine must refuse."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.continuation import Continuation, ContinuationMismatchError
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.request_runner import RequestRunner
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.tool_calling.choice import ToolCallMode, required_schema

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Count from one to twenty in words, please."},
]
TOOL = (
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)


@pytest.fixture(scope="module")
def engines(ckpt):
    """Two engines on the same checkpoint: the stream's first replica and the one it moves to."""
    made = [AsyncEngine(EngineConfig(model=ckpt, num_kv_blocks=96, max_num_batched_tokens=64)) for _ in range(2)]
    yield [RequestRunner(e) for e in made]
    for e in made:
        asyncio.run(e.shutdown())


def run(runner: RequestRunner, request: EngineRequest) -> list[StreamDelta]:
    async def main() -> list[StreamDelta]:
        return [d async for d in runner.generate(request)]

    return asyncio.run(main())


def continuation_after(deltas: list[StreamDelta], cut: int) -> Continuation:
    """What a client had after the first ``cut`` deltas (what the ingress builds)."""
    sent = deltas[:cut]
    return Continuation(
        output_token_ids=tuple(t for d in sent for t in d.token_ids),
        emitted_chars=sum(len(d.text) for d in sent),
        num_prompt_tokens=deltas[0].num_prompt_tokens,
        tool_call_ids=tuple(c.id for d in sent for c in d.tool_calls or () if c.id is not None),
    )


def joined(deltas: list[StreamDelta]) -> tuple[list[int], str, str, list]:
    """Tokens, text, content and tool-call pieces (ids are random per call: only whether one is there)."""
    return (
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        "".join(d.content or "" for d in deltas),
        [dataclasses.replace(c, id=c.id is not None) for d in deltas for c in d.tool_calls or ()],
    )


def call_ids(deltas: list[StreamDelta]) -> list[str]:
    return [c.id for d in deltas for c in d.tool_calls or () if c.id is not None]


def check_every_cut(engines, request: EngineRequest, cuts: int = 4) -> list[StreamDelta]:
    """Continue ``request``'s stream on the second engine after ``cuts`` spread cut points; each
    continued stream must equal the undisturbed one. The undisturbed deltas."""
    first, second = engines
    whole = run(first, request)
    assert len(whole) >= 3, "the stream is too short to cut"
    assert whole[-1].finish_reason is not None
    points = sorted({1 + i * (len(whole) - 2) // max(1, cuts - 1) for i in range(cuts)})
    for cut in points:
        moved = dataclasses.replace(
            request, request_id=f"{request.request_id}-cut{cut}", continuation=continuation_after(whole, cut)
        )
        rest = run(second, moved)
        assert joined(whole[:cut] + rest) == joined(whole), f"cut after delta {cut}"
        last, want = rest[-1], whole[-1]
        assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == (
            want.finish_reason,
            want.num_prompt_tokens,
            want.num_output_tokens,
        )
        if want.tool_result is not None:
            assert last.tool_result is not None
            # The calls sent before the cut keep their ids; the collected answer names the streamed ids.
            assert call_ids(whole[:cut]) == call_ids(whole[:cut] + rest)[: len(call_ids(whole[:cut]))]
            assert [c.id for c in last.tool_result.calls] == call_ids(whole[:cut] + rest)
            strip = [dataclasses.replace(c, id="") for c in last.tool_result.calls]
            assert strip == [dataclasses.replace(c, id="") for c in want.tool_result.calls]
            assert last.tool_result.content == want.tool_result.content
    return whole


def test_a_greedy_stream_continues_token_for_token(engines):
    request = EngineRequest(
        request_id="greedy", messages=CHAT, sampling=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    check_every_cut(engines, request, cuts=6)


def test_a_seeded_sample_with_penalties_continues_as_it_would_have(engines):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True, frequency_penalty=0.7)
    check_every_cut(engines, EngineRequest(request_id="seeded", messages=CHAT, sampling=params), cuts=5)


def test_the_seeded_generator_position_matters(engines):
    """The check above can fail: the same tokens as a prompt, sampled from a fresh generator of the same
    seed (no advance), go another way."""
    first, second = engines
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)
    whole = run(first, EngineRequest(request_id="seed-pos", messages=CHAT, sampling=params))
    cut = continuation_after(whole, len(whole) // 2)
    fresh = SamplingParams(temperature=1.0, seed=99, max_tokens=30 - len(cut.output_token_ids), ignore_eos=True)
    unadvanced = run(
        second,
        EngineRequest(
            request_id="seed-pos-raw",
            prompt=_prompt_ids(first, CHAT) + list(cut.output_token_ids),
            sampling=fresh,
        ),
    )
    assert joined(unadvanced)[0] != joined(whole)[0][len(cut.output_token_ids) :]


def _prompt_ids(runner: RequestRunner, messages) -> list[int]:
    return runner.engine.engine.input_processor.encode_chat(messages)


def test_held_back_text_and_a_stop_after_the_cut(engines):
    first, _ = engines
    free = run(
        first,
        EngineRequest(
            request_id="probe", messages=CHAT, sampling=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        ),
    )
    text = joined(free)[1]
    stop = text[len(text) * 2 // 3 :][:3]
    assert stop and stop in text
    params = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop, "\u2603\u2603\u2603\u2603\u2603"]
    )
    whole = check_every_cut(engines, EngineRequest(request_id="stops", messages=CHAT, sampling=params), cuts=5)
    assert whole[-1].finish_reason == "stop"


def test_a_json_schema_stream_continues_and_parses(engines):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    whole = check_every_cut(engines, EngineRequest(request_id="json", messages=CHAT, sampling=params), cuts=5)
    assert whole[-1].finish_reason == "stop"
    assert set(json.loads(joined(whole)[1])) == {"name", "age"}


def test_a_tool_call_stream_keeps_its_call_ids(engines):
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=required_schema([TOOL]))
    )
    request = EngineRequest(
        request_id="tools", messages=CHAT, sampling=params, tool_mode=ToolCallMode("required"), tools=None
    )
    whole = check_every_cut(engines, request, cuts=5)
    result = whole[-1].tool_result
    assert result is not None and result.calls and result.calls[0].name == "get_weather"
    assert [c.id for c in result.calls] == call_ids(whole)
    # The last cut (before the last delta) comes after the call was sent: its id is carried over.
    assert call_ids(whole[:-1])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_prompt_tokens=3), "tokens here"),
        (dict(output_token_ids=(10**9,)), "must be in"),
        (dict(emitted_chars=10**6), "characters"),
        (dict(output_token_ids=(0,) * 40), "nothing to continue"),
        (dict(tool_call_ids=("call_x",)), None),
    ],
    ids=["prompt-length", "vocabulary", "text", "max-tokens", "tool-ids"],
)
def test_a_continuation_that_cannot_be_exact_is_refused(engines, change, match):
    first, second = engines
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    whole = run(first, EngineRequest(request_id=f"ref-{match}", messages=CHAT, sampling=params))
    cont = dataclasses.replace(continuation_after(whole, 2), **change)
    request = EngineRequest(request_id=f"refused-{match}", messages=CHAT, sampling=params, continuation=cont)
    if "tool_call_ids" in change:  # a plain request has no tool stream: the ids mean nothing, and stay unchecked
        assert joined(whole[:2] + run(second, request))[0] == joined(whole)[0]
        return
    with pytest.raises(ContinuationMismatchError, match=match):
        run(second, request)
    assert not second.engine.engine.requests


def test_several_sequences_do_not_continue(engines):
    _, second = engines
    params = SamplingParams(temperature=0.8, n=2, max_tokens=8, seed=1)
    cont = Continuation(output_token_ids=(5,), emitted_chars=0, num_prompt_tokens=len(_prompt_ids(second, CHAT)))
    with pytest.raises(ContinuationMismatchError, match="single sequence"):
        run(second, EngineRequest(request_id="n2", messages=CHAT, sampling=params, continuation=cont))
