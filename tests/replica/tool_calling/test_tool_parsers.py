"""Tool-call parsers on fixed generated texts, collected and streamed (every split point gives the same calls)."""

from __future__ import annotations

import json

import pytest

from prefixserve.replica.tool_calling.parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedFunctionParser,
    RequiredParser,
    get_parser,
)
from prefixserve.replica.tool_calling.stream import ToolCallResult, ToolCallStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}'

# (parser factory, generated text, expected content, expected [(name, arguments object)], failed)
CASES = [
    (
        HermesParser,
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "}" b'})],
        False,
    ),
    (
        HermesParser,
        'Let me look.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
        "Let me look.\n",
        [("a", {}), ("b", {"x": 1})],
        False,
    ),
    (HermesParser, '<tool_call>{"name": "a"}</tool_call>', None, [("a", {})], False),
    (HermesParser, '<tool_call>{"name": "a", "arguments": {"x": 1}}', None, [("a", {"x": 1})], False),
    (HermesParser, "Paris is sunny. <tool but not a call", "Paris is sunny. <tool but not a call", [], False),
    (
        HermesParser,
        '<tool_call>{"name": "a", "arguments": {"x": 1',
        '<tool_call>{"name": "a", "arguments": {"x": 1',
        [],
        True,
    ),
    (
        HermesParser,
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
        True,
    ),
    (
        HermesParser,
        '<tool_call>{"name": "a", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "a", "arguments": "x"}</tool_call>',
        [],
        True,
    ),
    (
        Llama3JsonParser,
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
        False,
    ),
    (
        Llama3JsonParser,
        '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"q": "x;y"}), ("b", {})],
        False,
    ),
    (Llama3JsonParser, "The weather is fine.", "The weather is fine.", [], False),
    (
        Llama3JsonParser,
        '{"name": "a", "parameters": {"q": 1}} trailing',
        '{"name": "a", "parameters": {"q": 1}} trailing',
        [],
        True,
    ),
    (
        lambda: NamedFunctionParser("get_weather"),
        ' {"city": "Rome", "days": 3} ',
        None,
        [("get_weather", {"city": "Rome", "days": 3})],
        False,
    ),
    (lambda: NamedFunctionParser("get_weather"), '{"city": "Ro', '{"city": "Ro', [], True),
    (
        RequiredParser,
        '[{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"name": "b", "parameters": {}}]',
        None,
        [("a", {"x": [1, {"y": "]"}]}), ("b", {})],
        False,
    ),
    (RequiredParser, "[]", "[]", [], True),
    (RequiredParser, '[{"name": "a", "parameters": {}}', '[{"name": "a", "parameters": {}}', [], True),
]


def _collected(factory, text: str, truncated: bool = False) -> ToolCallResult:
    result = ToolCallStream(factory()).feed(text, finished=True, truncated=truncated).result
    assert result is not None
    return result


def _streamed(factory, pieces: list[str], truncated: bool = False) -> tuple[str, dict[int, dict], ToolCallResult]:
    """Content and calls as a client reassembles them from the deltas of ``pieces``; every call a
    client has seen at any point parses (a call is sent whole)."""
    stream = ToolCallStream(factory())
    content, calls = "", {}
    result = None
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out = stream.feed(piece, finished=last, truncated=truncated and last)
        content += out.content
        for d in out.tool_calls:
            if d.id is not None:
                assert d.index not in calls and d.name is not None and d.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert d.name is None
                calls[d.index]["arguments"] += d.arguments
        for call in calls.values():
            assert isinstance(json.loads(call["arguments"]), dict), (pieces, calls)
        result = out.result
    assert result is not None
    return content, calls, result


@pytest.mark.parametrize("factory,text,content,calls,failed", CASES)
def test_collected(factory, text, content, calls, failed):
    result = _collected(factory, text)
    assert result.failed is failed
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in result.calls)
    assert len({c.id for c in result.calls}) == len(result.calls)


@pytest.mark.parametrize("factory,text,content,calls,failed", CASES)
def test_streamed_at_every_split_point_equals_collected(factory, text, content, calls, failed):
    splits = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for pieces in splits:
        got_content, got_calls, result = _streamed(factory, pieces)
        assert result.failed is failed
        if failed:
            # Nothing was sent as a call before the failure showed: the whole text arrived as content.
            if not got_calls:
                assert got_content == text
            continue
        assert got_content == (content or ""), pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls.values()] == calls, pieces
        assert [c["arguments"] for c in got_calls.values()] == [c.arguments for c in result.calls]
        assert [c["id"] for c in got_calls.values()] == [c.id for c in result.calls]


def test_a_call_is_sent_whole_once_its_object_closes():
    stream = ToolCallStream(HermesParser())
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    sent = [(i, d) for i, ch in enumerate(text) for d in stream.feed(ch).tool_calls]
    closed = text.index(WEATHER) + len(WEATHER) - 1  # the object's last brace
    assert [i for i, _ in sent] == [closed, closed]
    (_, opening), (_, arguments) = sent
    assert (opening.name, opening.arguments) == ("get_weather", "") and opening.id is not None
    assert arguments.id is None and json.loads(arguments.arguments)["city"] == "Paris"


CALL_A = '{"name": "a", "arguments": {"x": 1}}'
# (parser factory, text cut by max_tokens, its whole calls before the cut, the content)
TRUNCATED = [
    (HermesParser, f"Sure.<tool_call>{CALL_A}</tool_call>\n<tool_call>" + '{"name": "b", "argu', ["a"], "Sure."),
    (HermesParser, f"<tool_call>{CALL_A}</tool_call><tool_call>" + '{"name": "b", "arguments": {"y": [2', ["a"], None),
    (HermesParser, f"<tool_call>{CALL_A}</tool_ca", ["a"], None),
    (HermesParser, f"<tool_call>{CALL_A}</tool_call>" * 2 + '<tool_call>{"na', ["a", "a"], None),
    (Llama3JsonParser, '{"name": "a", "parameters": {}}; {"name": "b", "param', ["a"], None),
    (RequiredParser, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"', ["a"], None),
]


@pytest.mark.parametrize("factory,text,names,content", TRUNCATED)
def test_a_cut_answer_keeps_its_whole_calls_collected_and_streamed(factory, text, names, content):
    result = _collected(factory, text, truncated=True)
    assert not result.failed and result.content == content
    assert [c.name for c in result.calls] == names
    assert all(isinstance(json.loads(c.arguments), dict) for c in result.calls)
    # Not cut (the model stopped there on its own): malformed, all content, as vLLM answers.
    assert _collected(factory, text).failed
    for pieces in [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]:
        got_content, got_calls, streamed = _streamed(factory, pieces, truncated=True)
        assert [c["name"] for c in got_calls.values()] == names, pieces
        assert [c["arguments"] for c in got_calls.values()] == [c.arguments for c in streamed.calls]
        assert got_content == (content or "")


@pytest.mark.parametrize(
    "factory,text",
    [
        (HermesParser, '<tool_call>{"name": "a", "arguments": {"x": 1'),
        (HermesParser, "Paris is <tool_ca"),
        (lambda: NamedFunctionParser("f"), '{"city": "Ro'),
        (RequiredParser, '[{"name": "a", "par'),
    ],
)
def test_a_cut_answer_without_a_whole_call_is_all_content_and_no_call_was_streamed(factory, text):
    result = _collected(factory, text, truncated=True)
    assert result.content == text and result.calls == ()
    for pieces in [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]:
        got_content, got_calls, _ = _streamed(factory, pieces, truncated=True)
        assert got_calls == {} and got_content == text


def test_whitespace_before_calls_is_no_content_but_stays_when_there_are_none():
    assert _collected(HermesParser, '\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>').content is None
    assert _collected(HermesParser, "\n\n").content == "\n\n"
    assert _streamed(HermesParser, ["\n", "\n"])[0] == "\n\n"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    result = ToolCallStream(HermesParser(), parallel_tool_calls=False).feed(text, finished=True).result
    assert result is not None and [c.name for c in result.calls] == ["a"]


def test_parser_registry_uses_vllm_names():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="unknown tool_call_parser 'mistral'"):
        get_parser("mistral")
