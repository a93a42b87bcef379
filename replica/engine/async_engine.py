"""AsyncEngine: an LLMEngine on a background thread, with streams.

The model runs off the event loop, so an HTTP server on that loop stays responsive.
``prepare`` runs the engine's input processor (replica/engine/input_processor.py) with
the tokenizer and chat template on the engine's one tokenizer thread and the grammar in
a grammar worker; the resulting PreparedRequest reaches the engine thread as it is,
through a command queue (with ``AbortRequest``); deltas come back through per-request
asyncio queues, one ``call_soon_threadsafe`` per consumer loop per step. When a consumer
stops iterating, its request is aborted and its blocks freed. On a fatal failure every in-flight request gets
``EngineDeadError`` and the engine is reset and serves again, at most
``max_engine_restarts`` times within ``engine_restart_window_s``; past that the loop
stops and ``is_running`` is False.

What front ends and hosts need of the engine's state they ask through methods here
(``max_messages``, ``prefix_block_hashes``, ``kv_block_view``,
``queued_prefill_tokens``), never through its attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.core.request import PreparedRequest
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.engine.input_processor import rendered_request
from prefixserve.replica.engine.metrics import EngineMetrics, EngineStats
from prefixserve.replica.engine.output_processor import EngineUpdate
from prefixserve.replica.engine.step_pipeline import build_on_forward_thread
from prefixserve.replica.engine.tokenizer_executor import TokenizerExecutor, messages_chars
from prefixserve.replica.errors import EngineDeadError, ModelNotFoundError
from prefixserve.replica.lora.request import LoRARequest
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.tool_calling.choice import ToolCallMode

T = TypeVar("T")

log = logging.getLogger(__name__)

_DONE = object()


@dataclass(frozen=True)
class AbortRequest:
    """Command to the engine thread: abort a request and free its blocks."""

    request_id: str
    # Resolved with whether the request was found, once its blocks are freed.
    reply: asyncio.Future[bool] | None = None


@dataclass(frozen=True)
class EngineCall:
    """Command to the engine thread: run ``fn`` between steps (what touches the engine's state
    from outside, such as loading an adapter) and resolve ``reply`` with its result or error."""

    fn: Callable[[], Any]
    reply: asyncio.Future[Any]


# A request to start is its PreparedRequest, queued as the input processor built it.
Command = PreparedRequest | AbortRequest | EngineCall


@dataclass(frozen=True)
class KVBlockView:
    """Live lookups of the blocks a KV cache holds, as KVEventPublisher.publish takes them:
    ``contains`` (the device pool), ``medium_of`` (the tier behind it, None without tiers),
    ``shared_of`` (in the shared disk directory named ``disk_group``)."""

    contains: Callable[[bytes], bool]
    medium_of: Callable[[bytes], str | None] | None = None
    shared_of: Callable[[bytes], bool] | None = None
    disk_group: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


class AsyncEngine:
    """An LLMEngine stepping on a background thread; ``stream`` (``generate`` from a prompt) streams deltas."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        # An engine handed in belongs to the caller: shutdown() leaves its workers and memory alone.
        self._owns_engine = engine is None
        if engine is not None:
            self.engine = engine
        self._commands: deque[Command] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0
        self._stopping = False
        self._shutdown_error: Exception | None = None
        self._dead: BaseException | None = None
        self._restart_times: deque[float] = deque()
        self.num_restarts = 0
        # Every tokenization and chat template of this engine's requests, on one thread.
        self.tokenizer_executor = TokenizerExecutor()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefixserve-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self.tokenizer_executor.shutdown()
            raise self._build_error

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        """Whether the engine serves requests: False once shut down or dead for good.

        True while it restarts after a fatal failure (it serves again right after).
        """
        return self._dead is None and not self._stopping and self._thread.is_alive() and self.engine.runner.is_alive

    def check_health(self) -> None:
        """Raise EngineDeadError unless the engine serves requests (see ``is_running``)."""
        if not self.is_running:
            lost_worker = self.engine.runner.death_reason
            if self._stopping or (self._dead is None and lost_worker is None):
                cause = "it was shut down"
            elif lost_worker is not None:
                cause = lost_worker
            else:
                cause = (
                    f"it failed more often than max_engine_restarts={self.config.max_engine_restarts} "
                    f"within {self.config.engine_restart_window_s:g} s "
                    f"(last failure: {type(self._dead).__name__})"
                )
            raise EngineDeadError(f"the engine loop is not running: {cause}")

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # --- what hosts may ask of the engine's state ---------------------------------

    @property
    def max_messages(self) -> int | None:
        """Messages above which a chat cannot fit ``max_model_len``; None when the template gives no bound."""
        return self.engine.input_processor.max_messages

    def prefix_block_hashes(self, token_ids: Sequence[int], cache_salt: str | None, max_blocks: int) -> list[bytes]:
        """The Contract-2 hashes of the first full blocks of ``token_ids`` (at most ``max_blocks``), as
        the KV cache names them; empty without prefix caching."""
        kv = self.engine.kv_manager
        if not kv.enable_prefix_caching:
            return []
        stop = min(max_blocks, len(token_ids) // kv.block_size)
        return kv.hasher.hash_blocks(token_ids, kv.block_size, cache_salt, stop=stop) if stop > 0 else []

    def kv_block_view(self) -> KVBlockView:
        """Where the KV cache holds blocks now (live lookups, safe to call from another thread): what
        the KV events report (replica/contract/kv_events.py)."""
        manager, tiers = self.engine.kv_manager, self.engine.tiers
        contains = manager.pool.hash_to_block.__contains__
        if tiers is None:
            return KVBlockView(contains)
        disk = tiers.disk
        return KVBlockView(
            contains,
            manager.tier_medium,
            disk.contains if disk is not None else None,
            disk.group if disk is not None else None,
        )

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet of the waiting and still-prefilling requests (LLMEngine's)."""
        return self.engine.queued_prefill_tokens()

    # --- requests ------------------------------------------------------------

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        """Process an EngineRequest into its PreparedRequest (InputProcessor.encode_request): the
        prompt's size bound here, template, tokenizer, ``fit_max_tokens`` and validation on the
        tokenizer thread (never on the event loop), the grammar in a grammar worker.

        Raises PromptTooLongError / RequestRejected / BadRequestError for a request the engine
        can never serve, EngineDeadError when the engine is not running.
        """
        processor = self.engine.input_processor
        processor.check_prompt_size(request)
        lora = self.lora_request(request.lora_name)
        chars = len(request.prompt) if isinstance(request.prompt, str) else messages_chars(request.messages)
        encoded = await self.tokenizer_executor.run(lambda: processor.encode_request(request), chars=chars)
        self.check_health()
        arrival = time.monotonic()
        grammar = await processor.compile_grammar_async(encoded.params, request.client)
        return processor.build(request, encoded, grammar, arrival_time=arrival, lora_request=lora)

    def lora_adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served by name (a copy: the engine thread changes the engine's)."""
        return dict(self.engine.lora_adapters)

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The served adapter ``name`` (None: the base model); ModelNotFoundError (404) when no longer served."""
        if name is None:
            return None
        lora = self.engine.lora_adapters.get(name)
        if lora is None:
            raise ModelNotFoundError(f"the LoRA adapter {name!r} is not served (it was unloaded)", param="model")
        return lora

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """``LLMEngine.load_lora_adapter`` on the engine thread (reading the files there, between steps)."""
        return await self.call(lambda: self.engine.load_lora_adapter(name, path))

    async def unload_lora_adapter(self, name: str) -> LoRARequest:
        """``LLMEngine.unload_lora_adapter`` on the engine thread."""
        return await self.call(lambda: self.engine.unload_lora_adapter(name))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
        conversation: bool = False,
        static_prefix_tokens: int = 0,
        tool_mode: ToolCallMode | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Process a prompt its caller rendered and stream its deltas (``conversation``,
        ``static_prefix_tokens``, ``tool_mode``: see LLMEngine.add_request; ``stream`` for the stream's
        errors). The prompt is built as an EngineRequest's (InputProcessor.build), encoded as given
        (``encode_prompt``: no chat template, no ``max_tokens`` fitting).

        Raises PromptTooLongError / RequestRejected / EngineOverloadedError / EngineDeadError
        before the first delta.
        """
        self.check_health()
        processor = self.engine.input_processor
        arrival = time.monotonic()
        request = rendered_request(
            request_id or uuid.uuid4().hex, prompt, params, cache_salt, trace_headers, conversation, tool_mode
        )
        if isinstance(prompt, str):
            processor.check_prompt_text(prompt)  # cheap: no thread for what cannot fit
            # Tokenizing a long text takes milliseconds: not on the event loop.
            encoded = await self.tokenizer_executor.run(
                lambda: processor.encode_prompt(prompt, params, static_prefix_tokens=static_prefix_tokens),
                chars=len(prompt),
            )
        else:
            encoded = processor.encode_prompt(prompt, params, static_prefix_tokens=static_prefix_tokens)
        grammar = await processor.compile_grammar_async(params)
        prepared = processor.build(request, encoded, grammar, arrival_time=arrival)
        # Closed with this generator: a consumer leaving early aborts the request at once.
        async with contextlib.aclosing(self.stream(prepared)) as deltas:
            async for delta in deltas:
                yield delta

    async def stream(self, request: PreparedRequest) -> AsyncGenerator[StreamDelta, None]:
        """Queue a PreparedRequest on the engine thread and stream its deltas.

        Raises RequestRejected (its id in use) / EngineOverloadedError / EngineDeadError before
        the first delta. Later, the stream raises RequestFailedError / RequestRejected when this
        request failed inside the engine (others are unaffected), or EngineDeadError when the
        engine failed as a whole. Leaving the iteration early (aclose, cancellation, a
        disconnected client) aborts the request.
        """
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # Checked again under the lock: the loop's final sweep of streams takes it too, so a
            # stream registered after that sweep cannot wait forever.
            self.check_health()
            # The ids in use are the streams'; the queue holds the requests not added yet too.
            self.engine.check_admission(request_id, in_use=self._streams, pending=self._pending_adds)
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._commands.append(request)
        self._wake.set()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if item is _DONE:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                for delta in item:
                    yield delta
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if not done:
                    self._commands.append(AbortRequest(request_id))
            self._wake.set()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps; its result, or its exception raised here."""
        self.check_health()
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._commands.append(EngineCall(fn, fut))
        self._wake.set()
        return await fut

    async def abort(self, request_id: str) -> bool:
        """Abort a request; returns once the engine thread has freed its blocks."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._commands.append(AbortRequest(request_id, reply=fut))
        self._wake.set()
        return await fut

    async def shutdown(self, error: Exception | None = None, save_hot_blocks: bool = False) -> None:
        """Stop the loop (in-flight requests fail with ``error``, by default EngineDeadError), then,
        when this object built the engine, its worker processes and memory. ``save_hot_blocks``
        (a drain): first write the hot cached blocks to the disk tier (replica/engine/tiers.py)."""
        if error is not None and not self._stopping:
            self._shutdown_error = error
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        tiers, e = self.engine.tiers, self.engine
        if save_hot_blocks and tiers is not None and self._dead is None:
            await asyncio.to_thread(tiers.save_hot_blocks, e.kv_manager, e.config.kv_drain_save_timeout_s)
        self.tokenizer_executor.shutdown()
        if self._owns_engine:
            self.engine.shutdown()

    # --- the engine thread ------------------------------------------------------

    def _build(self) -> bool:
        """Build the engine on the thread that runs its forward (this one; the device thread with
        async scheduling: step_pipeline.build_on_forward_thread says why); False when that failed."""
        try:
            if self._owns_engine:
                self.engine = build_on_forward_thread(lambda: LLMEngine(self.config), self.config.async_scheduling)
        except BaseException as exc:  # noqa: BLE001 - raised again by __init__, on the caller's thread
            self._build_error = exc
        self._built.set()
        return self._build_error is None

    def _run(self) -> None:
        if not self._build():
            return
        error: Exception = EngineDeadError("the engine was shut down")
        try:
            while True:
                try:
                    self._serve()
                    break  # shut down
                except Exception as exc:  # noqa: BLE001 - a fatal step failure: restart or die
                    log.error("the engine loop failed", exc_info=exc)
                    if isinstance(exc, EngineDeadError):  # a lost tensor-parallel worker: no way back
                        self._dead = exc
                        error = exc
                        break
                    if not self._may_restart():
                        self._dead = exc
                        error = EngineDeadError(
                            f"the engine loop failed ({type(exc).__name__}) and restarted too often: it is stopped"
                        )
                        break
                    self._fail_in_flight(
                        EngineDeadError(f"the engine failed ({type(exc).__name__}) and restarted; retry the request")
                    )
                    self.engine.reset()
                    self.num_restarts += 1
                    self.engine.metrics.observe_restart()
                    log.warning("engine state reset after a failure (restart %d)", self.num_restarts)
        except BaseException as exc:  # a failed reset, or KeyboardInterrupt/SystemExit: no restart
            self._dead = exc
            error = EngineDeadError(f"the engine loop failed ({type(exc).__name__}): it is stopped")
        if self._dead is None and self._shutdown_error is not None:
            error = self._shutdown_error
        if self._dead is None:
            # Steps in flight (async_scheduling) finish before the engine is left: their
            # tokens still reach the streams, their blocks are freed.
            try:
                self._dispatch(self.engine.drain())
            except Exception as exc:  # noqa: BLE001 - the streams get the shutdown error below
                log.error("a step in flight failed at shutdown", exc_info=exc)
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            self._post(s, error)

    def _serve(self) -> None:
        """Apply commands and step until shut down; raises on a fatal failure."""
        engine = self.engine
        while not self._stopping:
            self._apply_commands()
            if not engine.has_unfinished_requests() or engine.stalled:
                # Idle, or nothing can progress until a request arrives or leaves: wait for one.
                self._wake.wait()
                self._wake.clear()
                continue
            self._dispatch(engine.step())

    def _may_restart(self) -> bool:
        """Record a restart unless max_engine_restarts were already spent within the window."""
        now = time.monotonic()
        window = self.config.engine_restart_window_s
        while self._restart_times and now - self._restart_times[0] > window:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.config.max_engine_restarts:
            return False
        self._restart_times.append(now)
        return True

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        """Fail the streams of every request the engine holds; queued commands survive the reset."""
        with self._lock:
            streams = [self._streams.pop(rid) for rid in self.engine.requests if rid in self._streams]
        for s in streams:
            self._post(s, error)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for cmd in commands:
            if isinstance(cmd, PreparedRequest):
                self._add(cmd)
            elif isinstance(cmd, EngineCall):
                try:
                    result = cmd.fn()
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    cmd.reply.get_loop().call_soon_threadsafe(_fail, cmd.reply, exc)
                else:
                    cmd.reply.get_loop().call_soon_threadsafe(_resolve, cmd.reply, result)
            else:
                found = self.engine.abort_request(cmd.request_id)
                fut = cmd.reply
                if fut is not None:
                    fut.get_loop().call_soon_threadsafe(_resolve, fut, found)

    def _add(self, request: PreparedRequest) -> None:
        with self._lock:
            self._pending_adds -= 1
            stream = self._streams.get(request.request_id)
        if stream is None:  # the consumer left before the request started
            return
        try:
            self.engine.add_prepared(request)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._post(stream, exc)

    def _dispatch(self, updates: list[EngineUpdate]) -> None:
        """Hand one step's updates to their consumers' loops: one wake-up per loop per step.

        A callback per update would cost a self-pipe write and a loop iteration per
        request per token; the loop then runs them all in one callback, in step order.
        """
        if not updates:
            return
        with self._lock:
            found = [(self._streams.get(u.request_id), u) for u in updates]
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for stream, u in found:
            if stream is None:
                continue
            batch = batches.setdefault(stream.loop, [])
            if u.deltas:
                batch.append((stream.queue, u.deltas))
            if u.error is not None:
                batch.append((stream.queue, u.error))
            elif u.output is not None:
                batch.append((stream.queue, _DONE))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the consumers' loop is closed: nobody to tell
                pass

    @staticmethod
    def _deliver(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
        """On a consumer loop: put each item of one step's batch on its stream's queue."""
        for queue, item in batch:
            queue.put_nowait(item)

    @staticmethod
    def _post(stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody to tell
            pass


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
