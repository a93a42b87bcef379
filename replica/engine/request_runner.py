"""The engine host's side of the contract: what every host does with an engine request.

Job: :class:`RequestRunner`, what every engine host does with an
``EngineRequest`` (replica/contract/request.py) before the engine sees it, in one
place: the engine's cheap length bound, the chat template and tokenizer on the engine's one
tokenizer thread (never on the event loop), and the one ``max_tokens`` rule. The standalone
server (through :class:`LocalEngineClient`) and the Ray engine deployment both run it.

Imports neither an HTTP framework nor Ray; torch only through the engine a
caller passes in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.contract.routing import SESSION_HEADER
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.engine.tokenizer_executor import messages_chars
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import PromptTooLongError
from prefixserve.replica.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.replica.contract.kv_events import KVEventPublisher
    from prefixserve.replica.engine.core import AsyncEngine


# ---------------------------------------------------------------------------
# The engine host's side
# ---------------------------------------------------------------------------


def fit_max_tokens(request: EngineRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams once its prompt length is known: the one ``max_tokens`` rule.

    A client's own ``max_tokens`` stands (the engine refuses it if prompt plus
    ``max_tokens`` does not fit). Without one, the request gets
    ``min(max_tokens_default, max_model_len - prompt_len)``, at least 1:
    ``max_model_len`` (what fits) for chat, 16 for completions.
    """
    if request.max_tokens_default is None:
        return request.sampling
    fit = min(request.max_tokens_default, max_model_len - prompt_len)
    return dataclasses.replace(request.sampling, max_tokens=max(1, fit))


def prompt_token_ids(
    engine: AsyncEngine,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids ``engine`` generates from: ``messages`` (chat, with ``tools``) or ``prompt``. Blocking.

    Raises BadRequestError (400) when the chat template rejects the messages or
    a token id is not in the tokenizer's vocabulary.
    """
    if messages is not None:
        try:
            return list(engine.encode_chat(messages, tools=tools) if tools else engine.encode_chat(messages))
        except Exception as exc:  # a chat template refusing the conversation (jinja error)
            raise api.BadRequestError(
                f"the chat template rejected the messages: {exc}", param="messages", code="invalid_value"
            ) from exc
    if isinstance(prompt, str):
        return engine.engine.tokenize(prompt)
    if prompt is None:
        raise ValueError("prompt_token_ids needs a prompt or messages")
    vocab = len(engine.tokenizer)
    if any(t >= vocab for t in prompt):
        raise api.BadRequestError(
            f"prompt token ids must be below the vocabulary size {vocab}", param="prompt", code="invalid_value"
        )
    return list(prompt)


class RequestRunner:
    """Runs EngineRequests on a local AsyncEngine: what every engine host does the same way."""

    def __init__(self, engine: AsyncEngine, kv_events: KVEventPublisher | None = None) -> None:
        self.engine = engine
        self.max_model_len = int(engine.max_model_len)
        # Remembers each routing key's prefix block hashes for the routers (replica/contract/kv_events.py).
        self.kv_events = kv_events

    def model_info(self) -> ModelInfo:
        config = self.engine.config
        return ModelInfo(
            model_name=self.engine.model_name,
            model=config.model,
            max_model_len=self.max_model_len,
            max_messages=self.engine.engine.max_messages,
            tool_call_parser=config.tool_call_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
        )

    def check_prompt_size(self, request: EngineRequest) -> None:
        """Refuse (400 context_length_exceeded) a prompt that cannot fit, without tokenizing it.

        Text uses the engine's character bound (``LLMEngine.max_prompt_chars``:
        more characters than ``max_model_len`` of the longest token can cover).
        A chat is bounded by its message count (every message renders some
        template tokens, ``LLMEngine.max_messages``) and its contents' characters.
        """
        if isinstance(request.prompt, str):
            self.engine.engine.check_prompt_text(request.prompt)
        elif request.prompt is not None:
            if len(request.prompt) > self.max_model_len:
                raise PromptTooLongError(
                    f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                    f"{len(request.prompt)} tokens",
                    param="prompt",
                )
        else:
            self.engine.engine.check_messages_size(request.messages or [])

    async def prompt_ids(self, request: EngineRequest) -> tuple[list[int], int, SamplingParams]:
        """The request's prompt token ids, how many lead them as its static prefix (the system
        prompt's tokens, 0 for completions) and its SamplingParams (``fit_max_tokens``); template
        and tokenizer run on the engine's tokenizer thread (replica/engine/tokenizer_executor.py).

        The request is checked as the engine will admit it (``LLMEngine.validate``) before its
        static prefix is rendered and memoized: a refused request leaves nothing behind.
        """
        self.check_prompt_size(request)
        field = "prompt" if request.prompt is not None else "messages"

        def encode() -> tuple[list[int], int, SamplingParams]:
            ids = prompt_token_ids(self.engine, prompt=request.prompt, messages=request.messages, tools=request.tools)
            params = fit_max_tokens(request, len(ids), self.max_model_len)
            self.engine.engine.validate(ids, params, prompt_field=field)
            if not request.messages:
                return ids, 0, params
            kwargs = {"tools": request.tools} if request.tools else {}
            return ids, self.engine.engine.static_prefix_tokens(request.messages, ids, **kwargs), params

        chars = len(request.prompt) if isinstance(request.prompt, str) else messages_chars(request.messages)
        return await self.engine.tokenizer_executor.run(encode, chars=chars)

    def remember_prefix(self, key: str, prompt_ids: list[int], cache_salt: str | None) -> None:
        """Tell the KV event publisher the block hashes (Contract 2) of this prompt of ``key``.

        Only as many blocks as the key's remembered prefix still has are hashed
        (the publisher keeps the common run), so a known key costs little.
        """
        assert self.kv_events is not None
        kv = self.engine.engine.kv_manager
        if not kv.enable_prefix_caching:
            return
        known = self.kv_events.prefix_blocks(key)
        limit = self.kv_events.max_blocks_per_key if known is None else known
        stop = min(limit, len(prompt_ids) // kv.block_size)
        if stop > 0:
            self.kv_events.remember(key, kv.hasher.hash_blocks(prompt_ids, kv.block_size, cache_salt, stop=stop))

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamDelta]:
        """The engine's deltas for ``request``; leaving early aborts it in the engine."""
        prompt_ids, static_prefix_tokens, params = await self.prompt_ids(request)
        if self.kv_events is not None and request.routing_key:
            self.remember_prefix(request.routing_key, prompt_ids, request.cache_salt)
        stream = self.engine.generate(
            prompt_ids,
            params,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            trace_headers=request.trace_headers,
            conversation=request.conversation,
            static_prefix_tokens=static_prefix_tokens,
            tool_mode=request.tool_mode,
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            # Closing an unfinished engine stream aborts the request and frees its blocks.
            # Shielded: this runs while a host cancels a request whose client went away.
            with anyio.CancelScope(shield=True):
                await stream.aclose()


class LocalStream:
    """An EngineStream over a RequestRunner in this process."""

    def __init__(self, runner: RequestRunner, request: EngineRequest) -> None:
        self._runner = runner
        self._deltas = runner.generate(request)

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> StreamDelta:
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        await self._deltas.aclose()

    def token_text(self, token_id: int) -> str:
        return self._runner.engine.tokenizer.decode([token_id])

    def response_headers(self) -> dict[str, str]:
        return {}


class LocalEngineClient:
    """An EngineClient over an AsyncEngine in this process (the standalone replica server)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.runner = RequestRunner(engine)

    async def model_info(self) -> ModelInfo:
        return self.runner.model_info()

    async def is_healthy(self) -> bool:
        return bool(self.engine.is_running)

    def open_stream(self, request: EngineRequest) -> LocalStream:
        return LocalStream(self.runner, request)


def is_conversation_turn(messages: list[dict[str, Any]] | None, headers: Mapping[str, str]) -> bool:
    """Whether a request's answer will come back in a later prompt: a chat that already
    holds an assistant turn, or any request carrying a session id (``X-Session-Id``, the
    header router/contracts/prefix.py keys multi-turn affinity by)."""
    if any(k.lower() == SESSION_HEADER.lower() and v for k, v in headers.items()):
        return True
    return any(m.get("role") == "assistant" for m in messages or ())
