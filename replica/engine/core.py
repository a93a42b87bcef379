"""LLMEngine (one step at a time) and AsyncEngine (a background loop that streams).

LLMEngine wires the parts and keeps request bookkeeping: it validates and tokenizes
requests, asks the Scheduler for a plan, has the ModelRunner run it, then appends
sampled tokens, detokenizes incrementally, applies stop conditions, forks the
children of ``n > 1`` requests after their prompt's prefill, and reports updates.

Fault isolation: work done for one request (its sampling spec, its fork, its row of
the sampler, its tokens, text and stop checks) runs under a per-request ``try``; a
failure there fails that request alone (``EngineUpdate.error``: ``RequestRejected``
when the request is at fault, else ``RequestFailedError``) and frees its blocks.
Anything else escaping ``step()`` (the scheduler, the model forward, the KV pool) may
have corrupted shared state and is fatal to the engine's state; ``reset()`` rebuilds
it around the loaded weights.

AsyncEngine runs an LLMEngine on a dedicated thread (the model runs off the event
loop, so an HTTP server on that loop stays responsive). Requests and aborts reach
the thread as command objects (``AddRequest``, ``AbortRequest``) through a queue;
deltas come back through per-request asyncio queues, one ``call_soon_threadsafe`` per
consumer loop per step.
When a consumer stops iterating, its request is aborted and its blocks freed. On a
fatal failure every in-flight request gets ``EngineDeadError`` and the engine is
reset and serves again, at most ``max_engine_restarts`` times within
``engine_restart_window_s``; past that the loop stops and ``is_running`` is False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.common.tracing import RequestTiming, RequestTracer, build_tracer
from prefixserve.replica.config import MAX_MODEL_LEN_CAP, EngineConfig
from prefixserve.replica.contract.routing import canonical_json
from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.core.request import Request, Sequence, static_prefix_messages
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.engine.bounded_memo import BoundedMemo, str_bytes
from prefixserve.replica.engine.detokenizer import IncrementalDetokenizer
from prefixserve.replica.engine.metrics import EngineMetrics, EngineStats, FinishedRequestStats, SwapTotals
from prefixserve.replica.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from prefixserve.replica.engine.step_timer import StepTimer, TimedKVCacheManager
from prefixserve.replica.engine.tiers import EngineTiers
from prefixserve.replica.engine.tokenizer_executor import TokenizerExecutor
from prefixserve.replica.errors import (
    EngineDeadError,
    EngineOverloadedError,
    PromptTooLongError,
    RequestFailedError,
    RequestRejected,
)
from prefixserve.replica.executor.model_runner import ModelRunner, PromptLogprobSpan
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.model import loader
from prefixserve.replica.model.llama import ModelConfig
from prefixserve.replica.model.startup import StartupTimer
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarCache
from prefixserve.replica.structured_output.metrics import StructuredOutputMetrics
from prefixserve.replica.structured_output.state import SequenceGrammar
from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend
from prefixserve.replica.tools.choice import ToolCallMode
from prefixserve.replica.tools.templates import load_chat_template, template_for
from prefixserve.replica.worker.sampler import SampleSpec

log = logging.getLogger(__name__)

# Distinct system prompts whose token ids LLMEngine.static_prefix_tokens remembers, and their bytes
# (least recently used out first).
STATIC_PREFIX_MEMO_ENTRIES = 1024
STATIC_PREFIX_MEMO_BYTES = 16 * 1024**2
# Bytes of one memoized token id: its slot in the tuple and the int object.
_TOKEN_ID_BYTES = 36


@dataclass
class EngineUpdate:
    """What one step produced for one request."""

    request_id: str
    deltas: list[StreamDelta]
    # Set when the request finished in this step.
    output: RequestOutput | None = None
    # Set when the request failed in this step (it is gone from the engine, its blocks freed).
    error: Exception | None = None


class LLMEngine:
    """One engine replica's state, stepped by its caller (``LLM``, ``AsyncEngine``).

    ``fault_hook`` is a test seam for chaos tests: when set, it is called with each
    request during that request's post-processing in ``step()`` (inside the
    per-request fault isolation); whatever it raises fails that request alone. It is
    None in production.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        startup = StartupTimer()
        with startup.phase("checkpoint"):
            src = loader.prepare(loader.resolve(config.model))
        with startup.phase("config"):
            hf_config = loader.load_hf_config(src)
            self.model_config = ModelConfig.from_hf(hf_config)
            if config.sliding_window is not None:
                self.model_config = self.model_config.with_sliding_window(config.sliding_window)
        self.max_model_len = self._resolve_max_model_len()
        # The runner before the tokenizer: the loader reads a converted checkpoint's
        # tokenizer in the background meanwhile.
        self.runner = ModelRunner(
            config,
            self.model_config,
            src,
            max_model_len=self.max_model_len,
            checkpoint_dtype=getattr(hf_config, "dtype", None),
            startup=startup,
        )
        with startup.phase("tokenizer"):
            self.tokenizer = loader.load_tokenizer(src)
        # --chat-template: renders every chat request (replica/tools/templates.py).
        self.chat_template = load_chat_template(config.chat_template) if config.chat_template else None
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.max_model_len)
        self.min_message_tokens = min_message_tokens(self.tokenizer)
        self.metrics = EngineMetrics(config.model_name, self.max_model_len)
        self.metrics.observe_startup(startup.phases)
        startup.log(config.model_name)
        self.metrics.observe_cache_config(self._cache_config_info())
        # Per-step phase timers; the runner laps its own phases (input building, forward, sampling).
        self.step_timer = StepTimer(self.metrics.registry, config.model_name) if config.enable_step_timers else None
        self.runner.lap = self.step_timer.lap if self.step_timer is not None else None
        self.tracer: RequestTracer | None = None
        if config.otlp_traces_endpoint is not None:
            self.tracer = RequestTracer(
                build_tracer(f"prefixserve-engine:{config.model_name}", config.otlp_traces_endpoint), config.model_name
            )
        eos = set(self.model_config.eos_token_ids) | set(loader.generation_eos_ids(src))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # Structured output: grammars compile in the cache's workers, never on the engine loop
        # (AsyncEngine.generate compiles before the request is queued).
        self.structured_metrics = StructuredOutputMetrics(self.metrics.registry, config.model_name)
        self.grammars = GrammarCache(
            self._grammar_backend,
            timeout_s=config.grammar_compile_timeout_s,
            max_entries=config.grammar_cache_size,
            metrics=self.structured_metrics,
        )
        self._ids = itertools.count()
        # Static prefix (system messages, template kwargs) -> its token ids through the chat
        # template (static_prefix_tokens). Read and written from worker threads.
        self._static_prefix_ids: BoundedMemo[tuple[int, ...]] = BoundedMemo(
            STATIC_PREFIX_MEMO_BYTES, STATIC_PREFIX_MEMO_ENTRIES
        )
        self.metrics.track_cache_bytes("static_prefix", lambda: self._static_prefix_ids.nbytes)
        self.fault_hook: Callable[[Request], None] | None = None
        # Prefix queries, hits and preemptions of the states dropped by reset(): metrics are
        # cumulative since start, so a fresh KV manager and scheduler continue from here.
        self._carried = (0, 0, 0)
        self._carried_swap = SwapTotals()
        # The host and disk KV tiers (kv_offloading_size, kv_disk_path); None without them.
        self.tiers = (
            EngineTiers(config, self.runner, self.metrics.registry, config.model_name)
            if (config.host_tier_enabled)
            else None
        )
        self._new_state()

    def _new_state(self) -> None:
        """Fresh request bookkeeping, KV manager and scheduler over the runner's cache."""
        config = self.config
        manager_class = KVCacheManager if self.step_timer is None else TimedKVCacheManager
        self.kv_manager = manager_class(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_hash_algo,
            eviction_policy=config.eviction_policy,
            num_host_blocks=self.runner.num_host_blocks,
            sliding_window=self.model_config.kv_window,
            **(self.tiers.manager_kwargs() if self.tiers is not None else {}),  # type: ignore[arg-type]
        )
        if isinstance(self.kv_manager, TimedKVCacheManager):
            self.kv_manager.step_timer = self.step_timer
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.enable_chunked_prefill,
                config.preemption_mode,
                evict_generated_first=config.evict_generated_first,
                protect_static_prefix=config.protect_static_prefix,
            ),
            self.kv_manager,
        )
        self.requests: dict[str, Request] = {}
        # True when the last step changed nothing: stepping again is pointless until a
        # request arrives or leaves (AsyncEngine then waits instead of spinning).
        self.stalled = False

    def reset(self) -> None:
        """Drop every request and rebuild the KV manager and scheduler, keeping the weights.

        For after a fatal step failure. The cache tensors are zeroed as well: a forward
        that failed midway may have left NaN there, which masked reads could pick up.
        """
        self._carried = self._totals()
        self._carried_swap = self._swap_totals()
        if self.tiers is not None:
            self.tiers.carry(self.kv_manager.stats)
        self._new_state()
        self.runner.clear_kv_cache()
        self._observe_step(0, 0)

    def _cache_config_info(self) -> dict[str, object]:
        """The labels of ``vllm:cache_config_info`` (vLLM's CacheConfig field names where they exist)."""
        c = self.config
        return {
            "block_size": c.block_size,
            "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": c.enable_prefix_caching,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "num_gpu_blocks": self.runner.num_blocks,
            "prefix_caching_hash_algo": c.prefix_hash_algo,
            "swap_space": c.swap_space_gb,
        }

    def _resolve_max_model_len(self) -> int:
        m, asked = self.model_config, self.config.max_model_len
        # Sliding-window layers attend to the last `window` positions: max_model_len may exceed it.
        limit = m.max_position_embeddings
        if asked is None:
            length = min(limit, MAX_MODEL_LEN_CAP)
        elif asked > limit and not (m.rope.rope_type == "dynamic" and m.sliding_window is None):
            raise ValueError(f"max_model_len={asked} exceeds what the model supports ({limit}): lower it")
        else:
            length = asked
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < length:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.config.max_num_batched_tokens})"
                f" must be >= max_model_len ({length}): raise it or enable chunked prefill"
            )
        return length

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def _grammar_backend(self) -> XGrammarBackend:
        # The logits' width is the model's vocabulary (it may exceed the tokenizer's).
        return XGrammarBackend(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))

    def shutdown(self) -> None:
        """Release what outlives the object: the tensor-parallel worker processes, the grammar
        workers (idempotent)."""
        self.runner.shutdown()
        self.grammars.close()
        if self.tiers is not None:
            self.tiers.close()

    # --- requests ------------------------------------------------------------

    def check_prompt_text(self, prompt: str) -> None:
        """Refuse (PromptTooLongError) a text prompt too long to fit, without tokenizing it."""
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} characters, more than any prompt that fits this model's "
                f"maximum context length of {self.max_model_len} tokens can have: shorten it",
                param="prompt",
            )

    @property
    def max_messages(self) -> int | None:
        """Messages above which a chat cannot fit ``max_model_len`` (see min_message_tokens); None if unknown."""
        return self.max_model_len // self.min_message_tokens if self.min_message_tokens else None

    def check_messages_size(self, messages: list[dict[str, Any]]) -> None:
        """Refuse (PromptTooLongError) a chat too long to fit, without rendering it.

        Sound bounds only: every message renders at least ``min_message_tokens``
        template tokens (empty ones too), and the contents alone are under the
        character bound of ``max_prompt_chars``.
        """
        limit = self.max_messages
        if limit is not None and len(messages) > limit:
            raise PromptTooLongError(
                f"the chat has {len(messages)} messages; each renders at least {self.min_message_tokens} "
                f"tokens, so at most {limit} fit this model's maximum context length of "
                f"{self.max_model_len} tokens: send fewer"
            )
        if self.max_prompt_chars is not None:
            chars = sum(len(m.get("content") or "") for m in messages)
            if chars > self.max_prompt_chars:
                raise PromptTooLongError(
                    f"the messages have {chars} characters, more than any prompt that fits this model's "
                    f"maximum context length of {self.max_model_len} tokens can have: shorten them"
                )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_text(prompt)
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the chat template (generation prompt added).

        The template is ``--chat-template``'s, else the checkpoint's; a conversation with
        ``tools=`` on a model whose template renders none gets the shipped tool template.
        """
        template_kwargs.setdefault("add_generation_prompt", True)
        template = template_for(
            getattr(self.tokenizer, "chat_template", None), self.chat_template, bool(template_kwargs.get("tools"))
        )
        if template is not None:
            template_kwargs.setdefault("chat_template", template)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs)
        return list(ids)

    def static_prefix_tokens(
        self, messages: list[dict[str, Any]], prompt_ids: list[int], **template_kwargs: Any
    ) -> int:
        """How many leading tokens of ``prompt_ids`` (``messages`` through the chat template) are the
        conversation's static prefix: its leading system/developer messages (and ``tools=``, which
        the template renders before the conversation), rendered alone.

        The common run of the two renderings, so a template that renders the system part
        differently on its own costs only the tokens that differ. 0 without a static prefix,
        or when the template refuses the system messages alone. Memoized per system prompt
        (bounded in bytes): call it only for a prompt the engine admits (``validate``), so
        that refused requests leave nothing behind.
        """
        static = static_prefix_messages(messages)
        tools = template_kwargs.get("tools")
        if not static and not tools:
            return 0
        if not static:
            # Templates refuse an empty conversation; an empty system turn renders as none in the
            # shipped tool template, and any other difference only shortens the common run below.
            static = [{"role": "system", "content": ""}]
        try:
            # Tools are lists of dicts: their canonical JSON stands for them in the memo key.
            key: Any = (
                tuple((m.get("role"), m.get("content")) for m in static),
                tuple(sorted((k, canonical_json(v) if k == "tools" else v) for k, v in template_kwargs.items())),
            )
            hash(key)
        except TypeError:  # unhashable contents or kwargs: render without the memo
            key = None
        ids = self._static_prefix_ids.get(key) if key is not None else None
        if ids is None:
            try:
                ids = tuple(self.encode_chat(static, **{**template_kwargs, "add_generation_prompt": False}))
            except Exception:  # noqa: BLE001 - a template that needs a user turn: no static prefix
                ids = ()
            if key is not None:
                size = str_bytes(v for pair in key[0] for v in pair) + _TOKEN_ID_BYTES * len(ids)
                self._static_prefix_ids.put(key, ids, size + 64 * len(static))
        n = len(ids)
        if tuple(prompt_ids[:n]) == ids:
            return n
        return next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(n, len(prompt_ids)))

    def validate(self, prompt_ids: list[int], params: SamplingParams, *, prompt_field: str = "messages") -> None:
        """Raise RequestRejected / PromptTooLongError for a request that can never be served.

        ``prompt_field``: the request field a PromptTooLongError names (``prompt`` for completions).

        Everything that reaches the engine loop is checked here, before it is queued:
        what SamplingParams cannot check alone (the vocabulary, max_num_seqs, the
        context length and the KV cache size).
        """
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: shorten the prompt or "
                f"lower max_tokens",
                param=prompt_field,
            )
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise RequestRejected(f"stop_token_ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise RequestRejected(f"allowed_token_ids must be token ids in [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(
                f"n is {params.n} but this engine runs at most max_num_seqs="
                f"{self.config.max_num_seqs} sequences at once: lower n"
            )
        blocks = -(-total // self.config.block_size)
        if blocks > self.kv_manager.num_blocks:
            raise PromptTooLongError(
                f"the request needs {blocks} KV blocks but the cache has {self.kv_manager.num_blocks}: "
                f"shorten it or give the engine more KV memory",
                param=prompt_field,
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        *,
        prompt_text: str | None = None,
        trace_headers: dict[str, str] | None = None,
        conversation: bool = False,
        static_prefix_tokens: int = 0,
        grammar: Any = None,
        tool_mode: ToolCallMode | None = None,
    ) -> Request:
        """Validate and queue a request; ``prompt_text`` is reported back when ``prompt`` is token ids.

        ``trace_headers``: the W3C trace context the request arrived with (its spans' parent).
        ``conversation``: a turn whose answer the next turn's prompt repeats (its generated
        blocks are not sent to the cold end of the eviction order).
        ``static_prefix_tokens``: the prompt's leading tokens other requests share (its system
        prompt, ``static_prefix_tokens()``): their blocks are kept as reused ones are.
        ``grammar``: the compiled grammar of ``params.structured_outputs`` (``self.grammars``);
        when it is missing the constraint is compiled here, in the caller's thread (the offline
        ``LLM``); the engine loop always receives it compiled.
        ``tool_mode``: read each sequence's text for tool calls (StreamDelta.content / tool_calls).
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        self.validate(ids, params)
        constraint = params.structured_outputs
        if constraint is not None and grammar is None:
            grammar = self.grammars.get(constraint)
        bound = self.config.max_waiting_requests
        if bound is not None and self.scheduler.num_waiting >= bound:
            raise EngineOverloadedError(
                f"{self.scheduler.num_waiting} requests are already waiting (max_waiting_requests={bound}); retry later"
            )
        req = Request(
            request_id,
            ids,
            params,
            cache_salt,
            arrival_time or time.monotonic(),
            prompt=prompt if isinstance(prompt, str) else prompt_text,
            trace_headers=trace_headers,
            conversation=conversation,
            static_prefix_tokens=max(0, int(static_prefix_tokens)),
            bad_words_token_ids=self.bad_words_token_ids(params.bad_words),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            grammar=grammar if constraint is not None else None,
            tool_mode=tool_mode,
        )
        seq = self._new_sequence(req, 0)
        self.scheduler.add(seq)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.stalled = False
        if constraint is not None:
            self.structured_metrics.requests[constraint.kind].inc()
        return req

    def bad_words_token_ids(self, bad_words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of ``bad_words``: each word alone and after a space (so that it is
        banned at the start and in the middle of a text), the second only when it is a
        different word token of the same length."""
        out: list[list[int]] = []
        for word in bad_words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if not ids:
                    continue
                if not prefix or (out and ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                    out.append(ids)
        return tuple(tuple(ids) for ids in out)

    def _new_sequence(self, req: Request, index: int) -> Sequence:
        """Sequence ``index`` of ``req`` (not yet in ``req.seqs``: the caller adds it once it is scheduled)."""
        seq_id = req.request_id if index == 0 else f"{req.request_id}#{index}"
        seq = Sequence(seq_id, req, index, list(req.prompt_token_ids), len(req.prompt_token_ids))
        seed = req.params.child_seed(index)
        if seed is not None:
            seq.generator = torch.Generator(device=self.runner.device)
            seq.generator.manual_seed(seed)
        seq.detok = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            skip_special_tokens=req.params.skip_special_tokens,
            spaces_between_special_tokens=req.params.spaces_between_special_tokens,
        )
        if req.tool_mode is not None:
            seq.tool_stream = req.tool_mode.new_stream(self.config.tool_call_parser)
        if req.params.logprobs is not None:
            seq.logprobs = []
        if req.grammar is not None:
            seq.grammar = SequenceGrammar.start(req.grammar, self.grammars.backend)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._release(req)
        self.metrics.observe_abort()
        self.stalled = False
        # The loop may go idle now: refresh the gauges (running, KV usage) here.
        self._observe_step(0, 0)
        return True

    def _release(self, req: Request) -> None:
        """Finish (as aborted) every unfinished sequence of a request and free its blocks."""
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step --------------------------------------------------------------

    def step(self) -> list[EngineUpdate]:
        """Schedule, run the model, post-process; one update per request touched.

        A failure in one request's own work fails that request (an update with
        ``error``); an exception escaping this method is fatal (see ``reset``).
        """
        timer = self.step_timer
        if timer is not None:
            timer.start()
        plan = self.scheduler.schedule()
        if timer is not None:
            timer.lap("schedule")
        tier_ops = self.kv_manager.take_tier_ops()
        if self.tiers is not None:
            self.tiers.swap(tier_ops, plan.swap_out, plan.swap_in)
        elif plan.swap_out or plan.swap_in:
            self.runner.swap(plan.swap_out, plan.swap_in)
        self.stalled = not plan.changed_state
        scheduled_at = time.monotonic()
        for s in plan.scheduled:
            if s.seq.request.scheduled_time is None:  # the end of its queue time (vLLM's definition)
                s.seq.request.scheduled_time = scheduled_at
        failed: dict[str, tuple[Request, Exception]] = {}
        for seq in plan.rejected:
            failed[seq.request.request_id] = (
                seq.request,
                RequestRejected(
                    "the request can never be scheduled: it needs more sequences, KV blocks or batched tokens "
                    "than this engine has"
                ),
            )
        if plan.is_empty:
            self._observe_step(0, 0)
            updates = self._fail_all(failed)
            if timer is not None:
                timer.finish("output", 0)
            return updates
        specs: list[tuple[int, SampleSpec]] = []
        owners: list[Sequence] = []
        forks: list[tuple[Sequence, list[Sequence]]] = []
        for i, s in enumerate(plan.scheduled):
            if not s.samples:
                continue
            req = s.seq.request
            try:
                family = [s.seq]
                if s.seq.awaits_fork:
                    family += [self._new_sequence(req, k) for k in range(1, req.params.n)]
                for seq in family:
                    if seq.grammar is not None:
                        seq.grammar.sync(seq.output_token_ids)
                family_specs = [
                    SampleSpec(
                        req.params,
                        seq.generator,
                        self._banned(seq),
                        seq.token_ids,
                        seq.num_prompt_tokens,
                        req.bad_words_token_ids,
                        seq.grammar,
                    )
                    for seq in family
                ]
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[req.request_id] = (req, self._request_error(req, exc))
                continue
            if len(family) > 1:
                forks.append((s.seq, family[1:]))
            specs += ((i, spec) for spec in family_specs)
            owners += family
        spans = self._prompt_logprob_spans(plan.scheduled)
        results = self.runner.execute(plan.scheduled, plan.copy_ops, specs, spans)
        if self.tiers is not None:
            self.tiers.after_forward(tier_ops)
        for span in spans:
            req = plan.scheduled[span.index].seq.request
            if req.prompt_logprobs is not None and span.logprobs is not None and span.ranks is not None:
                req.prompt_logprobs.extend(span.logprobs)
                req.prompt_logprob_ranks.extend(span.ranks)
        for parent, children in forks:
            try:
                self._fork(parent, children)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                for child in children:
                    self.kv_manager.free(child.seq_id)
                failed[parent.request.request_id] = (parent.request, self._request_error(parent.request, exc))
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, result in zip(owners, results):
            req = seq.request
            rid = req.request_id
            if rid in failed:
                continue
            try:
                if result.error is not None:
                    raise result.error
                self._append_token(seq, result.token_id, result.logprobs, now)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[rid] = (req, self._request_error(req, exc))
                continue
            touched[rid] = req
        if timer is not None:
            timer.lap("detokenize")
        updates = []
        hook = self.fault_hook
        for rid, req in touched.items():
            if rid in failed:
                continue
            try:
                if hook is not None:
                    hook(req)
                updates.append(self._update(req, now))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[rid] = (req, self._request_error(req, exc))
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.start < s.seq.num_prompt_tokens)
        self._observe_step(num_prompt, len(owners))
        updates += self._fail_all(failed)
        if timer is not None:
            timer.finish("output", len(plan.scheduled))
        return updates

    @staticmethod
    def _prompt_logprob_spans(scheduled: list[ScheduledSeq]) -> list[PromptLogprobSpan]:
        """The prompt rows of this step whose logits prompt_logprobs still need.

        Position ``p``'s logits give the logprobs of prompt token ``p + 1``; a position
        already covered (a prefill recomputed after preemption) is not asked again.
        """
        spans = []
        for i, s in enumerate(scheduled):
            req = s.seq.request
            if not req.needs_prompt_logits or s.seq.index != 0:
                continue
            assert req.prompt_logprobs is not None
            prompt = req.prompt_token_ids
            first = max(s.start, len(req.prompt_logprobs) - 1)
            last = min(s.start + s.num_new_tokens, len(prompt) - 1)  # exclusive
            if first < last:
                spans.append(
                    PromptLogprobSpan(i, first - s.start, prompt[first + 1 : last + 1], req.params.prompt_logprobs or 0)
                )
        return spans

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Give the children of an n > 1 request their parent's blocks and start them running."""
        # Children share every prompt block; the next allocation copies the partial one.
        for child in children:
            self.kv_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
        self.scheduler.add_forked(parent, children)
        parent.request.seqs += children
        parent.request.forked = True

    def _request_error(self, req: Request, exc: Exception) -> Exception:
        """What the consumer of a request that failed inside the step gets."""
        if isinstance(exc, RequestRejected):
            return exc
        log.error(
            "request %s failed inside the engine; the engine keeps serving",
            req.request_id,
            exc_info=exc,
            extra={"request_id": req.request_id},
        )
        error = RequestFailedError(
            f"the engine failed while serving request {req.request_id} "
            f"({type(exc).__name__}); other requests are unaffected, retry it"
        )
        error.__cause__ = exc
        return error

    def _fail_all(self, failed: dict[str, tuple[Request, Exception]]) -> list[EngineUpdate]:
        """Remove failed requests, free their blocks, and report each one's error."""
        updates = []
        for rid, (req, error) in failed.items():
            self.requests.pop(rid, None)
            self._release(req)
            updates.append(EngineUpdate(rid, [], error=error))
        return updates

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.request.params
        # A constrained output ends where its grammar does: min_tokens must not ban the stop
        # token the grammar requires (the row would have no token left).
        if seq.num_output_tokens >= p.min_tokens or seq.grammar is not None:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return tuple(p.stop_token_ids) + eos

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        req, p = seq.request, seq.request.params
        if seq.grammar is not None:
            seq.grammar.accept(token)
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
            if p.include_stop_str_in_output:  # vLLM then detokenizes the stop token too
                seq.text += seq.detok.add(token)
            self._finish(seq, FinishReason.STOP)
            return
        if seq.grammar is not None and seq.grammar.terminated:
            self._finish(seq, FinishReason.STOP)
            return
        delta = seq.detok.add(token)
        if delta:
            seq.text += delta
            if p.stop and self._truncate_at_stop(seq, len(delta)):
                self._finish(seq, FinishReason.STOP)
                return
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    @staticmethod
    def _truncate_at_stop(seq: Sequence, delta_len: int) -> bool:
        """Cut the text at the first stop string in it (after it with include_stop_str_in_output)."""
        params = seq.request.params
        stops = params.stop
        longest = max(len(s) for s in stops)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [(i, len(s)) for i, s in ((seq.text.find(s, search_from), s) for s in stops) if i >= 0]
        if not hits:
            return False
        start, length = min(hits)
        seq.text = seq.text[: start + length if params.include_stop_str_in_output else start]
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _update(self, req: Request, now: float) -> EngineUpdate:
        deltas = []
        num_output = req.num_output_tokens
        cached = req.num_cached_tokens or 0
        # A stop string the output keeps is never taken back: nothing to hold (vLLM's rule).
        holdback = 0 if req.params.include_stop_str_in_output else max((len(s) for s in req.params.stop), default=1) - 1
        for seq in req.seqs:
            new_tokens = seq.num_output_tokens - seq.num_emitted_tokens
            if new_tokens == 0 and not (seq.is_finished and seq.num_emitted_chars < len(seq.text)):
                continue
            # Text that might still turn into a stop string is held back until it cannot.
            upto = len(seq.text) if seq.is_finished else max(seq.num_emitted_chars, len(seq.text) - holdback)
            text = seq.text[seq.num_emitted_chars : upto]
            seq.num_emitted_chars = upto
            ids = seq.output_token_ids[seq.num_emitted_tokens :]
            seq.num_emitted_tokens = seq.num_output_tokens
            lps = seq.logprobs[-len(ids) :] if seq.logprobs is not None and ids else None
            # The request's first delta carries its prompt_logprobs (complete by then).
            prompt_lps = req.prompt_logprobs if not req.prompt_logprobs_sent else None
            prompt_ids = req.prompt_token_ids if prompt_lps is not None else None
            prompt_ranks = req.prompt_logprob_ranks if prompt_lps is not None else None
            req.prompt_logprobs_sent = True
            delta = StreamDelta(
                request_id=req.request_id,
                index=seq.index,
                text=text,
                token_ids=ids,
                finish_reason=seq.finish_reason,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=cached,
                num_output_tokens=num_output,
                logprobs=lps,
                prompt_logprobs=prompt_lps,
                prompt_token_ids=prompt_ids,
                prompt_logprob_ranks=prompt_ranks,
            )
            if seq.tool_stream is not None:
                tools = seq.tool_stream.feed(text, finished=seq.is_finished)
                delta.content, delta.tool_calls = tools.content, list(tools.tool_calls) or None
                delta.tool_result = seq.tool_result = tools.result
            deltas.append(delta)
        output = None
        if req.finished:
            req.finished_time = now
            output = self.request_output(req)
            stats = self._finished_stats(req, now)
            self.metrics.observe_finished(stats)
            if req.tool_mode is not None:
                self.metrics.observe_tool_calls(*self._tool_counts(req))
            if self.tracer is not None:
                self._trace(req, stats)
            self.requests.pop(req.request_id, None)
        return EngineUpdate(req.request_id, deltas, output)

    @staticmethod
    def _finished_stats(req: Request, now: float) -> FinishedRequestStats:
        scheduled = req.scheduled_time if req.scheduled_time is not None else req.arrival_time
        first = req.first_token_time if req.first_token_time is not None else now
        reason = req.seqs[0].finish_reason if req.seqs and req.seqs[0].finish_reason else "stop"
        return FinishedRequestStats(
            finish_reason=str(reason),
            e2e_s=now - req.arrival_time,
            queued_s=scheduled - req.arrival_time,
            prefill_s=first - scheduled,
            decode_s=now - first,
            inference_s=now - scheduled,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=req.num_output_tokens,
            max_tokens=req.params.max_tokens,
            n=req.params.n,
        )

    @staticmethod
    def _tool_counts(req: Request) -> tuple[int, int]:
        """A finished request's parsed tool calls and its sequences whose tool-call text did not parse."""
        results = [s.tool_result for s in req.seqs if s.tool_result is not None]
        return sum(len(r.calls) for r in results), sum(r.failed for r in results)

    def _trace(self, req: Request, stats: FinishedRequestStats) -> None:
        assert self.tracer is not None
        start = req.arrival_time
        timing = RequestTiming(
            arrival=start,
            scheduled=start + stats.queued_s,
            first_token=start + stats.queued_s + stats.prefill_s,
            finished=start + stats.e2e_s,
        )
        p = req.params
        attributes: dict[str, Any] = {
            "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.num_generation_tokens,
            "prefixserve.cached_prompt_tokens": req.num_cached_tokens or 0,
            "gen_ai.request.n": p.n,
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.response.finish_reason": stats.finish_reason,
        }
        if p.structured_outputs is not None:
            attributes["prefixserve.structured_output.kind"] = p.structured_outputs.kind
        if req.tool_mode is not None:
            parsed, failures = self._tool_counts(req)
            attributes.update(
                {
                    "prefixserve.tool_choice": req.tool_mode.choice,
                    "prefixserve.tool_calls": parsed,
                    "prefixserve.tool_call_parse_failures": failures,
                }
            )
        self.tracer.record(req.request_id, timing, attributes, req.trace_headers)

    def request_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                logprobs=s.logprobs,
            )
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        e2e = None if req.finished_time is None else req.finished_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            num_cached_tokens=req.num_cached_tokens or 0,
            ttft_s=ttft,
            e2e_s=e2e,
            prompt=req.prompt,
            prompt_logprobs=req.prompt_logprobs,
        )

    # --- observability ------------------------------------------------------------

    def _totals(self) -> tuple[int, int, int]:
        """Prefix-cache query and hit tokens and preemptions since the engine started."""
        st = self.kv_manager.stats
        queries, hits, preemptions = self._carried
        return (
            queries + st.prefix_query_tokens,
            hits + st.prefix_hit_tokens,
            preemptions + self.scheduler.num_preemptions,
        )

    def _swap_totals(self) -> SwapTotals:
        st, sched = self.kv_manager.stats, self.scheduler
        return self._carried_swap + SwapTotals(
            sched.num_swap_preemptions,
            sched.num_recompute_preemptions,
            st.num_swapped_out_blocks,
            st.num_swapped_in_blocks,
            sched.num_swap_in_fallbacks,
        )

    def _observe_step(self, num_prompt_tokens: int, num_generated: int) -> None:
        st = self.kv_manager.stats
        host_usage = st.num_used_host_blocks / st.num_host_blocks if st.num_host_blocks else 0.0
        self.metrics.observe_swap(self._swap_totals(), num_swapped=st.num_swapped_requests, host_usage=host_usage)
        if self.tiers is not None:
            self.tiers.observe(st)
        queries, hits, preemptions = self._totals()
        self.metrics.observe_step(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv_manager.usage,
            prefix_queries=queries,
            prefix_hits=hits,
            num_preemptions=preemptions,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generated,
        )

    def stats(self) -> EngineStats:
        queries, hits, preemptions = self._totals()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv_manager.usage,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            num_kv_blocks=self.kv_manager.num_blocks,
        )


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters above which a text prompt cannot fit in ``max_model_len`` tokens; None if unknown.

    Without a normalizer, a tokenizer's tokens spell out the text they cover: one vocab
    string per token (byte-level BPE writes one character per byte, SentencePiece one
    per character, and a special token in the text is its own vocab string), and a
    character is at least one byte. So a text of C characters has at least
    C / (longest vocab string) tokens, and a prompt longer than
    ``max_model_len * longest`` characters can never fit. A normalizer may shrink the
    text (Unicode composition, whitespace folding), which breaks the bound: then
    there is none and such prompts are only refused once tokenized.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    return max_model_len * longest if longest else None


# Roles whose empty messages min_message_tokens renders.
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def min_message_tokens(tokenizer: Any) -> int:
    """The fewest tokens the chat template renders for one message, however empty; 0 if unknown.

    Measured on the template itself: for every pair of roles, the tokens of one
    empty message, and what a second and a third empty message add to it (a
    template that renders a message as delimiters and a role name adds the same
    each time). The minimum over all of them bounds every message, so a chat of
    ``n`` messages has at least ``n * min_message_tokens`` tokens. A template that
    renders some message as nothing (skips empty ones) gives 0: no bound.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return 0

    def count(roles: tuple[str, ...]) -> int:
        messages = [{"role": r, "content": ""} for r in roles]
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
        )

    costs: list[int] = []
    for first in _CHAT_ROLES:
        for then in _CHAT_ROLES:
            try:
                one, two, three = count((first,)), count((first, then)), count((first, then, then))
            except Exception:  # noqa: BLE001 - a template refusing this role or order: not a bound
                continue
            costs += [one, two - one, three - two]
    return max(0, min(costs)) if costs else 0


# ----------------------------------------------------------------------------------------

_DONE = object()


@dataclass(frozen=True)
class AddRequest:
    """Command to the engine thread: start a request (already tokenized and validated)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    # The text prompt, reported back in the RequestOutput; None for token-id prompts.
    prompt_text: str | None = None
    trace_headers: dict[str, str] | None = None
    conversation: bool = False
    static_prefix_tokens: int = 0
    tool_mode: ToolCallMode | None = None
    # The compiled grammar of params.structured_outputs (compiled before the command is queued).
    grammar: Any = None


@dataclass(frozen=True)
class AbortRequest:
    """Command to the engine thread: abort a request and free its blocks."""

    request_id: str
    # Resolved with whether the request was found, once its blocks are freed.
    reply: asyncio.Future[bool] | None = None


Command = AddRequest | AbortRequest


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """An LLMEngine stepping on a background thread; ``generate`` streams deltas."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        # An engine handed in belongs to the caller: shutdown() leaves its workers and memory alone.
        self._owns_engine = engine is None
        self.engine = engine or LLMEngine(config)
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

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.engine.encode_chat(messages, **template_kwargs)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # --- requests ------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        trace_headers: dict[str, str] | None = None,
        conversation: bool = False,
        static_prefix_tokens: int = 0,
        tool_mode: ToolCallMode | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream the deltas of one request (``conversation``, ``static_prefix_tokens``, ``tool_mode``:
        see LLMEngine.add_request).

        Raises PromptTooLongError / RequestRejected / EngineOverloadedError /
        EngineDeadError before the first delta. Later, the stream raises
        RequestFailedError / RequestRejected when this request failed inside the
        engine (others are unaffected), or EngineDeadError when the engine failed as a
        whole. Leaving the iteration early (aclose, cancellation, a disconnected
        client) aborts the request.
        """
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        if isinstance(prompt, str):
            self.engine.check_prompt_text(prompt)  # cheap: no thread for what cannot fit
            # Tokenizing a long text takes milliseconds: not on the event loop.
            ids = await self.tokenizer_executor.run(lambda: self.engine.tokenize(prompt), chars=len(prompt))
        else:
            ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, params)
        grammar = None
        if params.structured_outputs is not None:
            # In a grammar worker, bounded in time: the engine loop only ever sees compiled grammars.
            grammar = await self.engine.grammars.get_async(params.structured_outputs)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        bound = self.config.max_waiting_requests
        with self._lock:
            # Checked again under the lock: the loop's final sweep of streams takes it too, so a
            # stream registered after that sweep cannot wait forever.
            self.check_health()
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            if bound is not None and self.engine.scheduler.num_waiting + self._pending_adds >= bound:
                raise EngineOverloadedError(f"the waiting queue is full (max_waiting_requests={bound}); retry later")
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._commands.append(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=ids,
                    params=params,
                    cache_salt=cache_salt,
                    arrival_time=arrival,
                    prompt_text=prompt if isinstance(prompt, str) else None,
                    trace_headers=trace_headers,
                    conversation=conversation,
                    static_prefix_tokens=static_prefix_tokens,
                    grammar=grammar,
                    tool_mode=tool_mode,
                )
            )
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

    async def abort(self, request_id: str) -> bool:
        """Abort a request; returns once the engine thread has freed its blocks."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._commands.append(AbortRequest(request_id, reply=fut))
        self._wake.set()
        return await fut

    async def shutdown(self, error: Exception | None = None) -> None:
        """Stop the loop (in-flight requests fail with ``error``, by default EngineDeadError), then,
        when this object built the engine, its worker processes and memory."""
        if error is not None and not self._stopping:
            self._shutdown_error = error
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.tokenizer_executor.shutdown()
        if self._owns_engine:
            self.engine.shutdown()

    # --- the engine thread ------------------------------------------------------

    def _run(self) -> None:
        error = EngineDeadError("the engine was shut down")
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
            if isinstance(cmd, AddRequest):
                self._add(cmd)
            else:
                found = self.engine.abort_request(cmd.request_id)
                fut = cmd.reply
                if fut is not None:
                    fut.get_loop().call_soon_threadsafe(lambda f=fut, v=found: f.done() or f.set_result(v))

    def _add(self, cmd: AddRequest) -> None:
        with self._lock:
            self._pending_adds -= 1
            stream = self._streams.get(cmd.request_id)
        if stream is None:  # the consumer left before the request started
            return
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt_token_ids,
                cmd.params,
                cmd.cache_salt,
                cmd.arrival_time,
                prompt_text=cmd.prompt_text,
                trace_headers=cmd.trace_headers,
                conversation=cmd.conversation,
                static_prefix_tokens=cmd.static_prefix_tokens,
                grammar=cmd.grammar,
                tool_mode=cmd.tool_mode,
            )
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
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
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
    def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
        """On a consumer loop: put each item of one step's batch on its stream's queue."""
        for queue, item in batch:
            queue.put_nowait(item)

    @staticmethod
    def _post(stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody to tell
            pass
