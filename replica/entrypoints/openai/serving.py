"""The OpenAI serving logic both front ends share, free of any HTTP framework.

Job: what the front end (``replica/entrypoints/openai/http_frontend.py``, hosted by the standalone
replica server and by the Ray ingress) does between parsing a request and
sending bytes: check the Bearer API key, and turn the engine's stream of
:class:`StreamDelta` into OpenAI answers: SSE chunk streams, or one collected
``ChatCompletionResponse`` / ``CompletionResponse`` for all ``n`` choices, with
usage including the cached prompt tokens.

Invariants:
* Every answer built here closes its :class:`Generation`, so a request left
  unfinished (client gone, engine error) is aborted and its KV blocks freed.
* A stream always ends with ``data: [DONE]``; an error after the status was
  sent goes in-band as the OpenAI error body.

Depends on ``prefixserve.replica.entrypoints.openai.protocol``, ``engine.request_runner`` and anyio only: must not
import an HTTP framework, Ray, torch or anything from ``router``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import anyio

from prefixserve.replica.contract.continuation import progress_comment
from prefixserve.replica.contract.request import EngineStream
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.protocol import OpenAIRequest
from prefixserve.replica.errors import AuthenticationError
from prefixserve.replica.tool_calling.stream import ToolCallResult

log = logging.getLogger(__name__)


def check_api_key(authorization: str, api_keys: Sequence[bytes]) -> None:
    """Raise AuthenticationError (401) unless ``authorization`` is ``Bearer <one of api_keys>``.

    No keys means no check. Keys are compared in constant time, as bytes: ASGI
    servers decode header bytes as latin-1, so the token is encoded back to
    latin-1 to recover the bytes the client sent (a UTF-8 key's bytes).
    """
    if not api_keys:
        return
    scheme, _, token = authorization.partition(" ")
    try:
        sent = token.strip().encode("latin-1")
    except UnicodeEncodeError:  # not a header value a server decoded: cannot be a key's bytes
        sent = b""
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(sent, k) for k in api_keys):
        raise AuthenticationError("missing or invalid API key", code="invalid_api_key")


class Generation:
    """One engine request: its stream, its first delta, and a close that aborts it if unfinished."""

    def __init__(self, request_id: str, stream: EngineStream) -> None:
        self.request_id = request_id
        self.stream = stream
        self.first: StreamDelta | None = None

    async def start(self) -> None:
        """Pull the first delta: admission errors (429, prompt too long) surface here."""
        self.first = await self.stream.__anext__()

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        assert self.first is not None, "start() first"
        delta: StreamDelta | None = self.first
        while delta is not None:
            yield delta
            try:
                delta = await self.stream.__anext__()
            except StopAsyncIteration:
                delta = None

    async def close(self) -> None:
        """Close the engine stream; an unfinished request is thereby aborted and its blocks freed.

        Shielded: it runs while the front end is cancelling a disconnected
        request, and the close must still reach the engine.
        """
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


@dataclass
class _Choice:
    """What one of the ``n`` sequences has produced so far (non-streaming)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    # The finished tool-call reading of the text (requests with a tool mode).
    tool_result: ToolCallResult | None = None

    def render(
        self, index: int, body: OpenAIRequest, token_text: api.TokenText, prompt: _Prompt
    ) -> api.ChatChoice | api.CompletionChoice:
        """This choice of the collected answer to ``body``."""
        text = "".join(self.text)
        top_k = _top_k(body)
        if isinstance(body, api.ChatCompletionRequest):
            logprobs = api.chat_logprobs(self.token_ids, self.logprobs, top_k, token_text) if body.logprobs else None
            message = api.ChatResponseMessage(content=text)
            finish_reason = self.finish_reason
            if self.tool_result is not None:
                message = tool_message(self.tool_result)
                finish_reason = tool_finish_reason(self.tool_result, finish_reason, body)
            return api.ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason)
        token_ids: list[int] = self.token_ids
        entries: list[dict[int, float] | None] = list(self.logprobs)
        if body.echo:
            text = prompt.text(body, token_text) + text
            if body.logprobs is not None:
                token_ids = prompt.token_ids + token_ids
                entries = prompt.logprobs + entries
        completion_logprobs = (
            api.completion_logprobs(token_ids, entries, top_k, token_text) if body.logprobs is not None else None
        )
        return api.CompletionChoice(
            index=index,
            text=text,
            logprobs=completion_logprobs,
            finish_reason=self.finish_reason,
            prompt_logprobs=prompt.render(body.prompt_logprobs, token_text),
        )


@dataclass
class _Prompt:
    """The prompt's token ids and logprobs, from the first delta of a request that asked for them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    received: bool = False

    def update(self, delta: StreamDelta) -> None:
        if delta.prompt_logprobs is not None and delta.prompt_token_ids is not None:
            self.token_ids, self.logprobs, self.received = delta.prompt_token_ids, delta.prompt_logprobs, True
            self.ranks = delta.prompt_logprob_ranks or [None] * len(self.logprobs)

    def render(self, k: int | None, token_text: api.TokenText) -> api.PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` field, when the client asked for them (``k`` set)."""
        if k is None or not self.received:
            return None
        return api.prompt_logprobs(self.token_ids, self.logprobs, self.ranks, token_text)

    @staticmethod
    def text(body: api.CompletionRequest, token_text: api.TokenText) -> str:
        """The prompt's text as ``echo`` repeats it (a token-id prompt spelled token by token)."""
        return body.prompt if isinstance(body.prompt, str) else "".join(token_text(t) for t in body.prompt)


@dataclass
class UsageCounter:
    """A request's token counts so far, from its deltas (prompt, cached prompt, output)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def update(self, delta: StreamDelta) -> None:
        # Counts in a delta are cumulative for the whole request.
        self.prompt_tokens = max(self.prompt_tokens, delta.num_prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.completion_tokens = max(self.completion_tokens, delta.num_output_tokens)

    def build(self) -> api.Usage:
        return api.Usage.build(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def tool_message(result: ToolCallResult) -> api.ChatResponseMessage:
    """The collected assistant message of a sequence read for tool calls."""
    calls = [
        api.ToolCallOut(id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments)) for c in result.calls
    ]
    return api.ChatResponseMessage(content=result.content, tool_calls=calls or None)


def tool_finish_reason(
    result: ToolCallResult, finish_reason: str | None, body: api.ChatCompletionRequest
) -> str | None:
    """OpenAI's (and vLLM's) finish reason of a sequence read for tool calls: ``"tool_calls"`` when it
    stopped on its own with calls under ``auto`` or ``required``; a named function's call stays ``"stop"``."""
    if result.calls and finish_reason == "stop" and body.effective_tool_choice() != "named":
        return "tool_calls"
    return finish_reason


def delta_tool_calls(delta: StreamDelta) -> list[api.DeltaToolCall] | None:
    """A delta's tool-call pieces in OpenAI's chunk shape."""
    if not delta.tool_calls:
        return None
    return [
        api.DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=api.DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in delta.tool_calls
    ]


def _top_k(body: OpenAIRequest) -> int:
    if isinstance(body, api.ChatCompletionRequest):
        return body.top_logprobs or 0
    return body.logprobs or 0


async def collect_response(
    gen: Generation, body: OpenAIRequest, model: str, token_text: api.TokenText
) -> api.ChatCompletionResponse | api.CompletionResponse:
    """The whole non-streaming answer to ``body``: every choice's text, logprobs and finish reason, and usage."""
    choices = [_Choice() for _ in range(body.n)]
    usage = UsageCounter()
    prompt = _Prompt()
    try:
        async for delta in gen.deltas():
            usage.update(delta)
            prompt.update(delta)
            choice = choices[delta.index]
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
            if delta.tool_result is not None:
                choice.tool_result = delta.tool_result
    finally:
        await gen.close()
    rendered = [c.render(i, body, token_text, prompt) for i, c in enumerate(choices)]
    if isinstance(body, api.ChatCompletionRequest):
        return api.ChatCompletionResponse(
            id=gen.request_id,
            model=model,
            choices=rendered,
            usage=usage.build(),
            prompt_logprobs=prompt.render(body.prompt_logprobs, token_text),
        )
    return api.CompletionResponse(id=gen.request_id, model=model, choices=rendered, usage=usage.build())


def _dropped(gen: Generation) -> None:
    """One line for a stream whose client went away: routine, so no traceback (the engine request
    is aborted by the stream's close)."""
    log.info("request %s: the client disconnected mid-stream; its engine request is aborted", gen.request_id)


def sse_stream(
    gen: Generation, body: OpenAIRequest, model: str, token_text: api.TokenText, *, progress: bool = False
) -> AsyncIterator[str]:
    """The streamed answer to ``body``: SSE events (``data: ...\\n\\n``), ``data: [DONE]`` last.

    ``progress``: each event that brings sequence 0 tokens starts with a progress comment
    (replica/contract/continuation.py), for a front end that may continue the stream elsewhere.
    A continued stream (``prefixserve_continuation``) opens no role delta, nor echo, again.
    """
    notes = ProgressNotes(gen.request_id) if progress and body.n == 1 else None
    if isinstance(body, api.ChatCompletionRequest):
        return _chat_stream(gen, body, model, token_text, notes)
    return _completion_stream(gen, body, model, token_text, notes)


class ProgressNotes:
    """The progress comments of one stream (replica/contract/continuation.py): one per delta of sequence
    0 that brings tokens; the first also names the prompt's length and the answer's id."""

    def __init__(self, answer_id: str) -> None:
        self.answer_id = answer_id
        self.first = True

    def comment(self, delta: StreamDelta) -> str:
        """The comment line heading the event(s) of ``delta`` ("" when it brings nothing to count)."""
        if delta.index != 0:
            return ""
        calls = [c.id for c in delta.tool_calls or () if c.id is not None]
        if not (delta.token_ids or delta.text or calls or self.first):
            return ""
        first, self.first = self.first, False
        return progress_comment(
            delta.token_ids,
            len(delta.text),
            calls,
            prompt_tokens=delta.num_prompt_tokens if first else None,
            answer_id=self.answer_id if first else None,
        )


def _with_note(note: str, events: list[str]) -> str | None:
    """A delta's ``events``, the last headed by the progress comment ``note`` (the router counts what
    the note says once that event is whole); the comment as an event of its own when the delta
    gives none (its text is held back); None when there is neither."""
    if events:
        return "".join(events[:-1]) + note + events[-1]
    return note + "\n" if note else None


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


# pydantic-core escapes strings as this does (``"``, ``\\`` and control characters; the rest
# as UTF-8), so the templates below give the protocol models' ``model_dump_json`` bytes.
_quote = json.encoder.encode_basestring


class TextChunks:
    """The SSE payloads of one stream's text-only chunks, from a template made once per stream.

    A chunk that carries only text (no role, logprobs or tool calls) is the same JSON every
    token but for ``created``, the choice index, the text and the finish reason: the same
    bytes as ``api.CompletionResponse(...)`` / ``api.ChatCompletionChunk(...).model_dump_json()``
    without building and serializing models per token.
    """

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = f'{{"id":{_quote(request_id)},"object":"{kind}","created":'
        self._model = f',"model":{_quote(model)},"choices":[{{"index":'
        if chat:
            self._text = ',"delta":{"role":null,"content":'
            self._finish = '},"logprobs":null,"finish_reason":'
            self._tail = '}],"usage":null}'
        else:
            self._text = ',"text":'
            self._finish = ',"logprobs":null,"finish_reason":'
            self._tail = ',"prompt_logprobs":null}],"usage":null}'

    def encode(self, created: int, index: int, text: str, finish: str | None) -> str:
        """The JSON of one chunk."""
        reason = "null" if finish is None else _quote(finish)
        return f"{self._head}{created}{self._model}{index}{self._text}{_quote(text)}{self._finish}{reason}{self._tail}"


async def _chat_stream(
    gen: Generation,
    body: api.ChatCompletionRequest,
    model: str,
    token_text: api.TokenText,
    notes: ProgressNotes | None = None,
) -> AsyncIterator[str]:
    usage = UsageCounter()
    top_k = _top_k(body)
    texts = TextChunks(gen.request_id, model, chat=True)

    def chunk(choices: list[api.ChatChunkChoice], usage_: api.Usage | None = None) -> str:
        return _sse(
            api.ChatCompletionChunk(id=gen.request_id, model=model, choices=choices, usage=usage_).model_dump_json()
        )

    def event(delta: StreamDelta) -> str | None:
        """The SSE event of one delta; None when it shows nothing yet."""
        if delta.content is not None:  # read for tool calls: content and call pieces
            if not delta.content and not delta.tool_calls and delta.finish_reason is None:
                return None
            message = api.DeltaMessage(content=delta.content or None, tool_calls=delta_tool_calls(delta))
            finish = (
                tool_finish_reason(delta.tool_result, delta.finish_reason, body)
                if delta.tool_result is not None
                else delta.finish_reason
            )
        else:
            if not delta.text and delta.finish_reason is None:
                return None  # the detokenizer holds back an incomplete character
            if not (body.logprobs and delta.logprobs):
                return _sse(texts.encode(int(time.time()), delta.index, delta.text, delta.finish_reason))
            message, finish = api.DeltaMessage(content=delta.text), delta.finish_reason
        logprobs = None
        if body.logprobs and delta.logprobs:
            logprobs = api.chat_logprobs(delta.token_ids, delta.logprobs, top_k, token_text)
        return chunk([api.ChatChunkChoice(index=delta.index, delta=message, logprobs=logprobs, finish_reason=finish)])

    try:
        if body.prefixserve_continuation is None:  # OpenAI opens each choice with a role-only delta
            yield chunk(
                [
                    api.ChatChunkChoice(index=i, delta=api.DeltaMessage(role="assistant", content=""))
                    for i in range(body.n)
                ]
            )
        async for delta in gen.deltas():
            usage.update(delta)
            shown = event(delta)
            out = _with_note(notes.comment(delta), [shown] if shown else []) if notes is not None else shown
            if out is not None:
                yield out
        if body.include_usage:
            yield chunk([], usage.build())
    except (asyncio.CancelledError, GeneratorExit):  # the client went away: cancelled, or closed at a yield
        _dropped(gen)
        raise
    except Exception as exc:  # the engine failed mid-stream: say so in-band, the status is sent
        yield _sse(json.dumps(api.error_from_exception(exc).body()))
    finally:
        await gen.close()
    yield _sse("[DONE]")


async def _completion_stream(
    gen: Generation,
    body: api.CompletionRequest,
    model: str,
    token_text: api.TokenText,
    notes: ProgressNotes | None = None,
) -> AsyncIterator[str]:
    usage = UsageCounter()
    top_k = _top_k(body)
    offsets = [0] * body.n
    prompt = _Prompt()
    # A continued stream's prompt was echoed by the replica that started it.
    echoed = [not body.echo or body.prefixserve_continuation is not None] * body.n
    texts = TextChunks(gen.request_id, model, chat=False)

    def chunk(choices: list[api.CompletionChoice], usage_: api.Usage | None = None) -> str:
        return _sse(
            api.CompletionResponse(id=gen.request_id, model=model, choices=choices, usage=usage_).model_dump_json()
        )

    def events(delta: StreamDelta) -> list[str]:
        """The SSE events of one delta (its echo first); none when it shows nothing yet."""
        i = delta.index
        out = []
        if not echoed[i]:  # each choice's first event repeats the prompt (and its logprobs)
            echoed[i] = True
            text = _Prompt.text(body, token_text)
            logprobs = None
            if body.logprobs is not None:
                logprobs = api.completion_logprobs(prompt.token_ids, prompt.logprobs, top_k, token_text)
            offsets[i] += len(text)
            out.append(chunk([api.CompletionChoice(index=i, text=text, logprobs=logprobs)]))
        if not delta.text and delta.finish_reason is None:
            return out
        if body.logprobs is None:
            return [*out, _sse(texts.encode(int(time.time()), i, delta.text, delta.finish_reason))]
        logprobs = None
        if delta.logprobs:
            logprobs = api.completion_logprobs(
                delta.token_ids, delta.logprobs, top_k, token_text, text_offset=offsets[i]
            )
        offsets[i] += len(delta.text)
        finish = delta.finish_reason
        return [*out, chunk([api.CompletionChoice(index=i, text=delta.text, logprobs=logprobs, finish_reason=finish)])]

    try:
        async for delta in gen.deltas():
            usage.update(delta)
            prompt.update(delta)
            shown = events(delta)
            out = _with_note(notes.comment(delta), shown) if notes is not None else "".join(shown) or None
            if out is not None:
                yield out
        if body.include_usage:
            yield chunk([], usage.build())
    except (asyncio.CancelledError, GeneratorExit):
        _dropped(gen)
        raise
    except Exception as exc:
        yield _sse(json.dumps(api.error_from_exception(exc).body()))
    finally:
        await gen.close()
    yield _sse("[DONE]")
