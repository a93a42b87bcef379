"""The engine host's side of the contract: what every host does with an engine request.

Job: :class:`RequestRunner`, what every engine host does with an
``EngineRequest`` (replica/contract/request.py), in one place: the engine prepares it
(``AsyncEngine.prepare``: the input processor's length bound, chat template, tokenizer,
``max_tokens`` rule and validation, off the event loop), the KV event publisher learns
its prefix's block hashes and, once it finished, where its prompt's history blocks (the
router's text blocks, replica/contract/history_events.py) lie in the KV cache, and the
engine streams it. The standalone server (through
:class:`LocalEngineClient`) and the Ray engine deployment both run it; it asks the
engine through its methods only.

Imports neither an HTTP framework nor Ray; torch only through the engine a
caller passes in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from prefixserve.replica.contract.history_events import token_blocks_at
from prefixserve.replica.contract.prompt_blocks import PromptBlocks, PromptHasher, UnhashablePrompt
from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.contract.retention import CACHE_RETENTION_HEADER
from prefixserve.replica.contract.routing import SESSION_HEADER
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.core.request import PreparedRequest

if TYPE_CHECKING:
    from prefixserve.replica.contract.kv_events import KVEventPublisher
    from prefixserve.replica.engine.async_engine import AsyncEngine


# The replica's memo of text-block hashes per message (replica/contract/prompt_blocks.py).
_HASHER_CACHE_MESSAGES = 8192


class RequestRunner:
    """Runs EngineRequests on a local AsyncEngine: what every engine host does the same way."""

    def __init__(self, engine: AsyncEngine, kv_events: KVEventPublisher | None = None) -> None:
        self.engine = engine
        self.max_model_len = int(engine.max_model_len)
        # Remembers each routing key's prefix block hashes for the routers (replica/contract/kv_events.py).
        self.kv_events = kv_events
        # The router's text-block hashes of each request, when the publisher tracks history.
        self._prompt_hasher = PromptHasher(cache_messages=_HASHER_CACHE_MESSAGES)

    def model_info(self) -> ModelInfo:
        config = self.engine.config
        return ModelInfo(
            model_name=self.engine.model_name,
            model=config.model,
            max_model_len=self.max_model_len,
            max_messages=self.engine.max_messages,
            max_tools=config.max_tools_per_request,
            max_tool_schema_nodes=config.max_tool_schema_nodes,
            tool_call_parser=config.tool_call_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            scheduling_policy=config.scheduling_policy,
            adapters=tuple((name, r.lora_path) for name, r in self.engine.lora_adapters().items()),
        )

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        """The request as the engine runs it (``AsyncEngine.prepare``: size bound, template and
        tokenizer on the engine's tokenizer thread, ``fit_max_tokens``, validation, grammar)."""
        return await self.engine.prepare(request)

    def remember_prefix(self, key: str, prompt_ids: Sequence[int], cache_salt: str | None) -> None:
        """Tell the KV event publisher the block hashes (Contract 2) of this prompt of ``key``.

        Only as many blocks as the key's remembered prefix still has are hashed
        (the publisher keeps the common run), so a known key costs little.
        """
        assert self.kv_events is not None
        known = self.kv_events.prefix_blocks(key)
        limit = self.kv_events.max_blocks_per_key if known is None else known
        hashes = self.engine.prefix_block_hashes(prompt_ids, cache_salt, limit)
        if hashes:
            self.kv_events.remember(key, hashes)

    def history_blocks(self, request: EngineRequest) -> PromptBlocks | None:
        """The router's text-block hashes of ``request`` (None: history not tracked, or a prompt
        the router cannot hash either)."""
        if self.kv_events is None or self.kv_events.history is None:
            return None
        try:
            return self._prompt_hasher.blocks(request)
        except (UnhashablePrompt, TypeError, ValueError):
            return None

    def remember_history(self, request: EngineRequest, prepared: PreparedRequest, blocks: PromptBlocks) -> None:
        """Tell the history tracker where a finished request's text blocks end in its token blocks."""
        assert self.kv_events is not None and self.kv_events.history is not None
        ids = prepared.prompt_token_ids
        block_size = int(self.engine.config.block_size)
        at = token_blocks_at(
            self._prompt_hasher.block_ends(request),
            blocks.static_blocks,
            prepared.static_prefix_tokens,
            len(ids),
            block_size,
        )
        if len(at) != len(blocks.hashes):
            return
        token_hashes = self.engine.prefix_block_hashes(ids, request.cache_salt, max(at, default=-1) + 1)
        self.kv_events.history.remember(
            (text, token_hashes[j]) for text, j in zip(blocks.hashes, at, strict=True) if 0 <= j < len(token_hashes)
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamDelta]:
        """The engine's deltas for ``request``; leaving early aborts it in the engine."""
        prepared = await self.prepare(request)
        if self.kv_events is not None and request.routing_key:
            self.remember_prefix(request.routing_key, prepared.prompt_token_ids, request.cache_salt)
        blocks = self.history_blocks(request)
        history = self.kv_events.history if self.kv_events is not None else None
        stream = self.engine.stream(prepared)
        if blocks is not None and history is not None:
            history.begin(blocks.hashes)  # in flight: never reported removed meanwhile
        try:
            async for delta in stream:
                yield delta
            if blocks is not None:
                self.remember_history(request, prepared, blocks)
        finally:
            if blocks is not None and history is not None:
                history.end(blocks.hashes)
            # Closing an unfinished engine stream aborts the request and frees its blocks.
            # Shielded: this runs while a host cancels a request whose client went away.
            with anyio.CancelScope(shield=True):
                await stream.aclose()


class LocalStream:
    """An EngineStream over a RequestRunner in this process."""

    def __init__(self, runner: RequestRunner, request: EngineRequest) -> None:
        self._runner = runner
        self._deltas = runner.generate(request)
        self._retention: str | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> StreamDelta:
        delta = await self._deltas.__anext__()
        if delta.cache_retention is not None:
            self._retention = delta.cache_retention
        return delta

    async def aclose(self) -> None:
        await self._deltas.aclose()

    def token_text(self, token_id: int) -> str:
        return self._runner.engine.tokenizer.decode([token_id])

    def response_headers(self) -> dict[str, str]:
        """Whether the request's prefix is pinned, when it asked for retention."""
        return {CACHE_RETENTION_HEADER: self._retention} if self._retention is not None else {}


class LocalEngineClient:
    """An EngineClient over an AsyncEngine in this process (the standalone replica server)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.runner = RequestRunner(engine)

    async def model_info(self, name: str | None = None) -> ModelInfo:
        return self.runner.model_info()

    async def models(self) -> list[ModelInfo]:
        return [self.runner.model_info()]

    async def is_healthy(self) -> bool:
        return bool(self.engine.is_running)

    def open_stream(self, request: EngineRequest) -> LocalStream:
        return LocalStream(self.runner, request)


def is_conversation_turn(messages: list[dict[str, Any]] | None, headers: Mapping[str, str]) -> bool:
    """Whether a request's answer will come back in a later prompt: a chat that already
    holds an assistant turn, or any request carrying a session id (``X-Session-Id``, the
    header router/routing_key.py keys multi-turn affinity by)."""
    if any(k.lower() == SESSION_HEADER.lower() and v for k, v in headers.items()):
        return True
    return any(m.get("role") == "assistant" for m in messages or ())
