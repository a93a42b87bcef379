"""LLMEngine (one step at a time) and AsyncEngine (a background loop that streams).

LLMEngine wires the parts and keeps request bookkeeping: it validates and tokenizes
requests, asks the Scheduler for a plan, has the ModelRunner run it, then appends
sampled tokens, detokenizes incrementally, applies stop conditions, forks the
children of ``n > 1`` requests after their prompt's prefill, and reports updates.

AsyncEngine runs an LLMEngine on a dedicated thread (the model runs off the event
loop, so an HTTP server on that loop stays responsive). Requests and aborts reach
the thread through a command queue; deltas come back through per-request asyncio
queues (``call_soon_threadsafe``). When a consumer stops iterating, its request is
aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch

from prefixserve.replica.config import MAX_MODEL_LEN_CAP, EngineConfig
from prefixserve.replica.detokenizer import IncrementalDetokenizer
from prefixserve.replica.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError, RequestRejected
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.metrics import EngineMetrics, EngineStats
from prefixserve.replica.model import loader
from prefixserve.replica.model.llama import ModelConfig
from prefixserve.replica.model_runner import ModelRunner
from prefixserve.replica.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, CompletionOutput, RequestOutput, StreamDelta
from prefixserve.replica.request import Request, Sequence
from prefixserve.replica.sampling import SampleSpec, SamplingParams
from prefixserve.replica.scheduler import Scheduler, SchedulerConfig


@dataclass
class EngineUpdate:
    """What one step produced for one request."""

    request_id: str
    deltas: list[StreamDelta]
    # Set when the request finished in this step.
    output: RequestOutput | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        src = loader.resolve(config.model)
        hf_config = loader.load_hf_config(src)
        self.model_config = ModelConfig.from_hf(hf_config)
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = loader.load_tokenizer(src)
        self.runner = ModelRunner(config, self.model_config, loader.iter_weights(src),
                                  max_model_len=self.max_model_len,
                                  checkpoint_dtype=getattr(hf_config, "dtype", None))
        self.kv_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                         config.enable_prefix_caching, config.prefix_hash_algo)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill), self.kv_manager)
        self.metrics = EngineMetrics(config.model_name)
        eos = set(self.model_config.eos_token_ids) | set(loader.generation_eos_ids(src))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    def _resolve_max_model_len(self) -> int:
        m, asked = self.model_config, self.config.max_model_len
        limit = m.max_position_embeddings
        if m.sliding_window is not None:
            # Sliding-window attention is not implemented: serve what fits inside the window,
            # where full attention is exactly the model's attention.
            limit = min(limit, m.sliding_window)
        if asked is None:
            length = min(limit, MAX_MODEL_LEN_CAP)
        elif asked > limit and not (m.rope.rope_type == "dynamic" and m.sliding_window is None):
            raise ValueError(f"max_model_len={asked} exceeds what the model supports ({limit}): lower it")
        else:
            length = asked
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < length:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.config.max_num_batched_tokens})"
                             f" must be >= max_model_len ({length}): raise it or enable chunked prefill")
        return length

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # --- requests ------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the checkpoint's chat template (generation prompt added)."""
        template_kwargs.setdefault("add_generation_prompt", True)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs)
        return list(ids)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected / PromptTooLongError for a request that can never be served."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: shorten the prompt or "
                f"lower max_tokens")
        blocks = -(-total // self.config.block_size)
        if blocks > self.kv_manager.num_blocks:
            raise PromptTooLongError(
                f"the request needs {blocks} KV blocks but the cache has {self.kv_manager.num_blocks}: "
                f"shorten it or give the engine more KV memory")

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> Request:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        self.validate(ids, params)
        bound = self.config.max_waiting_requests
        if bound is not None and self.scheduler.num_waiting >= bound:
            raise EngineOverloadedError(f"{self.scheduler.num_waiting} requests are already waiting "
                                        f"(max_waiting_requests={bound}); retry later")
        req = Request(request_id, ids, params, cache_salt, arrival_time or time.monotonic(),
                      prompt=prompt if isinstance(prompt, str) else None)
        seq = self._new_sequence(req, 0)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return req

    def _new_sequence(self, req: Request, index: int, token_ids: list[int] | None = None) -> Sequence:
        seq_id = req.request_id if index == 0 else f"{req.request_id}#{index}"
        seq = Sequence(seq_id, req, index, list(token_ids or req.prompt_token_ids), len(req.prompt_token_ids))
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device)
            seq.generator.manual_seed(req.params.seed + index)
        seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        if req.params.logprobs is not None:
            seq.logprobs = []
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = FINISH_ABORT
                self.scheduler.finish(seq)
        # The loop may go idle now: refresh the gauges (running, KV usage) here.
        self._observe_step(0, 0)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step --------------------------------------------------------------

    def step(self) -> list[EngineUpdate]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._observe_step(0, 0)
            return []
        specs: list[tuple[int, SampleSpec]] = []
        owners: list[Sequence] = []
        forks: list[tuple[Sequence, list[Sequence]]] = []
        for i, s in enumerate(plan.scheduled):
            if not s.samples:
                continue
            family = [s.seq]
            if s.seq.awaits_fork:
                children = [self._new_sequence(s.seq.request, k) for k in range(1, s.seq.request.params.n)]
                s.seq.request.forked = True
                forks.append((s.seq, children))
                family += children
            for seq in family:
                specs.append((i, SampleSpec(seq.request.params, seq.generator, self._banned(seq))))
                owners.append(seq)
        results = self.runner.execute(plan.scheduled, plan.copy_ops, specs)
        # Children share every prompt block; the next allocation copies the partial one.
        for parent, children in forks:
            for child in children:
                self.kv_manager.fork(parent.seq_id, child.seq_id)
                child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_forked(parent, children)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, result in zip(owners, results):
            self._append_token(seq, result.token_id, result.logprobs, now)
            touched[seq.request.request_id] = seq.request
        updates = [self._update(req, now) for req in touched.values()]
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.start < s.seq.num_prompt_tokens)
        self._observe_step(num_prompt, len(owners))
        return updates

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return tuple(p.stop_token_ids) + eos

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        req, p = seq.request, seq.request.params
        seq.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.observe_first_token(now - req.arrival_time)
        elif seq.last_token_time is not None:
            self.metrics.observe_inter_token(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, FINISH_STOP)
            return
        delta = seq.detok.add(token)
        if delta:
            seq.text += delta
            if p.stop and self._truncate_at_stop(seq, len(delta)):
                self._finish(seq, FINISH_STOP)
                return
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FINISH_LENGTH)

    @staticmethod
    def _truncate_at_stop(seq: Sequence, delta_len: int) -> bool:
        stops = seq.request.params.stop
        longest = max(len(s) for s in stops)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [i for i in (seq.text.find(s, search_from) for s in stops) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[:min(hits)]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _update(self, req: Request, now: float) -> EngineUpdate:
        deltas = []
        num_output = req.num_output_tokens
        cached = req.num_cached_tokens or 0
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        for seq in req.seqs:
            new_tokens = seq.num_output_tokens - seq.num_emitted_tokens
            if new_tokens == 0 and not (seq.is_finished and seq.num_emitted_chars < len(seq.text)):
                continue
            # Text that might still turn into a stop string is held back until it cannot.
            upto = len(seq.text) if seq.is_finished else max(seq.num_emitted_chars, len(seq.text) - holdback)
            text = seq.text[seq.num_emitted_chars:upto]
            seq.num_emitted_chars = upto
            ids = seq.output_token_ids[seq.num_emitted_tokens:]
            seq.num_emitted_tokens = seq.num_output_tokens
            lps = seq.logprobs[-len(ids):] if seq.logprobs is not None and ids else None
            deltas.append(StreamDelta(req.request_id, seq.index, text, ids, seq.finish_reason,
                                      len(req.prompt_token_ids), cached, num_output, lps))
        output = None
        if req.finished:
            req.finished_time = now
            self.metrics.observe_finished(now - req.arrival_time)
            self.requests.pop(req.request_id, None)
            output = self.request_output(req)
        return EngineUpdate(req.request_id, deltas, output)

    def request_output(self, req: Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason, s.logprobs)
                for s in sorted(req.seqs, key=lambda s: s.index)]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        e2e = None if req.finished_time is None else req.finished_time - req.arrival_time
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.num_cached_tokens or 0, ttft, e2e,
                             req.prompt)

    # --- observability ------------------------------------------------------------

    def _observe_step(self, num_prompt_tokens: int, num_generated: int) -> None:
        st = self.kv_manager.stats
        self.metrics.observe_step(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                                  kv_usage=st.usage, prefix_queries=st.prefix_query_tokens,
                                  prefix_hits=st.prefix_hit_tokens, num_preemptions=self.scheduler.num_preemptions,
                                  num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generated)

    def stats(self) -> EngineStats:
        st = self.kv_manager.stats
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_usage=st.usage, prefix_cache_hit_rate=st.hit_rate,
                           prefix_cache_queries=st.prefix_query_tokens, prefix_cache_hits=st.prefix_hit_tokens,
                           num_preemptions=self.scheduler.num_preemptions, num_kv_blocks=st.num_blocks)


# ----------------------------------------------------------------------------------------

_DONE = object()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """An LLMEngine stepping on a background thread; ``generate`` streams deltas."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self._commands: deque[tuple] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefixserve-engine", daemon=True)
        self._thread.start()

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
        return self._dead is None and not self._stopping

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.engine.encode_chat(messages, **template_kwargs)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # --- requests ------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Stream the deltas of one request.

        Raises PromptTooLongError / RequestRejected / EngineOverloadedError /
        EngineDeadError before the first delta. Leaving the iteration early (aclose,
        cancellation, a disconnected client) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self._dead!r})")
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        bound = self.config.max_waiting_requests
        with self._lock:
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            if bound is not None and self.engine.scheduler.num_waiting + self._pending_adds >= bound:
                raise EngineOverloadedError(f"the waiting queue is full (max_waiting_requests={bound}); retry later")
            self._streams[request_id] = stream
            self._pending_adds += 1
            text = prompt if isinstance(prompt, str) else None
            self._commands.append(("add", request_id, ids, params, cache_salt, arrival, text))
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
                    self._commands.append(("abort", request_id, None))
            self._wake.set()

    async def abort(self, request_id: str) -> bool:
        """Abort a request; returns once the engine thread has freed its blocks."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._commands.append(("abort", request_id, (fut.get_loop(), fut)))
        self._wake.set()
        return await fut

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # --- the engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step())
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # the loop must report any failure to every waiting stream
            self._dead = exc
            error = EngineDeadError(f"the engine loop failed: {exc!r}")
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            self._post(s, error)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for cmd in commands:
            if cmd[0] == "add":
                _, rid, ids, params, salt, arrival, text = cmd
                with self._lock:
                    self._pending_adds -= 1
                    stream = self._streams.get(rid)
                if stream is None:  # the consumer left before the request started
                    continue
                try:
                    req = self.engine.add_request(rid, ids, params, salt, arrival)
                    req.prompt = text
                except Exception as exc:  # noqa: BLE001 - handed to the consumer
                    self._post(stream, exc)
            else:
                _, rid, reply = cmd
                found = self.engine.abort_request(rid)
                if reply is not None:
                    loop, fut = reply
                    loop.call_soon_threadsafe(lambda f=fut, v=found: f.done() or f.set_result(v))

    def _dispatch(self, updates: list[EngineUpdate]) -> None:
        for u in updates:
            with self._lock:
                stream = self._streams.get(u.request_id)
            if stream is None:
                continue
            if u.deltas:
                self._post(stream, u.deltas)
            if u.output is not None:
                self._post(stream, _DONE)

    @staticmethod
    def _post(stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody to tell
            pass
