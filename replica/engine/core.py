"""LLMEngine: one engine replica's state (scheduler, KV manager, runner), one step at a time.

LLMEngine wires the parts: its input processor (replica/engine/input_processor.py) turns a
prompt into one validated ``PreparedRequest``, which ``add_prepared`` queues as it is (what hosts
and tools ask of prompts, they ask the input processor: ``engine.input_processor``); each
``step`` asks the Scheduler for a plan, has the ModelRunner run it, forks the children of
``n > 1`` requests after their prompt's prefill, and hands the sampled tokens to its output
processor (replica/engine/output_processor.py: stop checks, deltas, finished outputs).
``add_request`` is the offline convenience that does both (``LLM``, benchmarks, tests).

Fault isolation: work done for one request (its sampling spec, its fork, its row of
the sampler, its tokens, text and stop checks) runs under a per-request ``try``; a
failure there fails that request alone (``EngineUpdate.error``: ``RequestRejected``
when the request is at fault, else ``RequestFailedError``) and frees its blocks.
Anything else escaping ``step()`` (the scheduler, the model forward, the KV pool) may
have corrupted shared state and is fatal to the engine's state; ``reset()`` rebuilds
it around the loaded weights.

With ``async_scheduling`` a step's forward and sampling run on the step pipeline's device
thread (replica/engine/step_pipeline.py) while ``step`` schedules the next one and processes
the previous one's outputs; ``step`` falls back to the synchronous path (the pipeline drained
first) whenever the next schedule needs the last tokens on the host (``_may_overlap``).

The background loop that streams (``AsyncEngine``) is replica/engine/async_engine.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Container, Mapping
from typing import Any

import torch

from prefixserve.common.tracing import RequestTracer, build_tracer
from prefixserve.replica.config import MAX_MODEL_LEN_CAP, EngineConfig
from prefixserve.replica.contract.continuation import Continuation
from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.core.request import PreparedRequest, Request, Sequence
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.core.scheduler import Scheduler, SchedulerConfig
from prefixserve.replica.engine.detokenizer import IncrementalDetokenizer
from prefixserve.replica.engine.input_processor import InputProcessor, rendered_request
from prefixserve.replica.engine.kv_event_publisher import ZmqKVEventPublisher
from prefixserve.replica.engine.metrics import EngineMetrics, EngineStats, PinTotals, SwapTotals
from prefixserve.replica.engine.output_processor import EngineUpdate, OutputProcessor
from prefixserve.replica.engine.step_pipeline import StepPipeline
from prefixserve.replica.engine.step_timer import StepTimer, TimedKVCacheManager
from prefixserve.replica.engine.tiers import EngineTiers
from prefixserve.replica.errors import EngineOverloadedError, RequestFailedError, RequestRejected
from prefixserve.replica.executor.model_runner import ModelRunner, PromptLogprobSpan
from prefixserve.replica.kv.disk_tier import LIST_EVERY_S
from prefixserve.replica.kv.event_recorder import KVEventRecorder, TierSetReporter
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.lora.request import LoRARequest
from prefixserve.replica.model import loader
from prefixserve.replica.model.llama import ModelConfig
from prefixserve.replica.model.startup import StartupTimer
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarCache
from prefixserve.replica.structured_output.metrics import StructuredOutputMetrics
from prefixserve.replica.structured_output.state import SequenceGrammar
from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend
from prefixserve.replica.tool_calling.choice import ToolCallMode
from prefixserve.replica.tool_calling.templates import load_chat_template
from prefixserve.replica.worker.sampler import SampleResult, SampleSpec, advance_generator

log = logging.getLogger(__name__)

__all__ = ["EngineUpdate", "LLMEngine"]


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
        self.metrics = EngineMetrics(config.model_name, self.max_model_len)
        self.metrics.observe_startup(startup.phases)
        startup.log(config.model_name)
        self.metrics.observe_cache_config(self._cache_config_info())
        # Per-step phase timers; the runner laps its own phases (input building, forward, sampling).
        self.step_timer = StepTimer(self.metrics.registry, config.model_name) if config.enable_step_timers else None
        self.runner.lap = self.step_timer.lap if self.step_timer is not None else None
        tracer = None
        if config.otlp_traces_endpoint is not None:
            tracer = RequestTracer(
                build_tracer(f"prefixserve-engine:{config.model_name}", config.otlp_traces_endpoint), config.model_name
            )
        eos = set(self.model_config.eos_token_ids) | set(loader.generation_eos_ids(src))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # Structured output: grammars compile in the cache's workers, never on the engine loop
        # (the async engine compiles before the request is queued).
        self.structured_metrics = StructuredOutputMetrics(self.metrics.registry, config.model_name)
        self.grammars = GrammarCache.from_config(self._grammar_backend, config, self.structured_metrics)
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.runner.num_blocks,
            grammars=self.grammars,
            # --chat-template: renders every chat request (replica/tool_calling/templates.py).
            chat_template=load_chat_template(config.chat_template) if config.chat_template else None,
        )
        self.metrics.track_cache_bytes("static_prefix", lambda: self.input_processor.static_prefix_memo_bytes)
        self.output_processor = OutputProcessor(self.metrics, self.eos_token_ids, self.max_model_len, tracer)
        self._ids = itertools.count()
        self.fault_hook: Callable[[Request], None] | None = None
        # Prefix queries, hits and preemptions of the states dropped by reset(): metrics are
        # cumulative since start, so a fresh KV manager and scheduler continue from here.
        self._carried = (0, 0, 0)
        self._carried_swap = SwapTotals()
        self._carried_pins = PinTotals()
        # The host and disk KV tiers (kv_offloading_size, kv_disk_path); None without them.
        try:
            self.tiers = (
                EngineTiers(config, self.runner, self.metrics.registry, config.model_name)
                if (config.host_tier_enabled)
                else None
            )
        except BaseException:  # an unusable kv_disk_path: no worker process or grammar thread outlives it
            self.runner.shutdown()
            self.grammars.close()
            raise
        # vLLM-format KV events (kv_events_config): the KV manager records each step's block
        # events and the publisher sends them as one batch per step; None when off.
        self.kv_event_recorder: KVEventRecorder | None = None
        self.kv_event_publisher: ZmqKVEventPublisher | None = None
        kv_events = config.kv_events
        if kv_events is not None and kv_events.enabled:
            try:
                self.kv_event_publisher = ZmqKVEventPublisher(kv_events)
            except BaseException:  # an endpoint in use: nothing started here outlives it
                self.runner.shutdown()
                self.grammars.close()
                if self.tiers is not None:
                    self.tiers.close()
                raise
            self.kv_event_recorder = KVEventRecorder()
        # The shared disk tier is known as a set of hashes (other replicas write it too): its
        # events are that set's changes, diffed no more often than the tier relists it.
        self._disk_events: TierSetReporter | None = None
        self._disk_events_due = 0.0
        if self.kv_event_recorder is not None and self.tiers is not None and self.tiers.disk is not None:
            self._disk_events = TierSetReporter(self.kv_event_recorder)
        # Steps in flight on the device thread (async_scheduling); its thread starts at first use.
        self.pipeline = StepPipeline(self.runner)
        self._new_state()

    def _new_state(self) -> None:
        """Fresh request bookkeeping, KV manager and scheduler over the runner's cache."""
        config = self.config
        manager_class = KVCacheManager if self.step_timer is None else TimedKVCacheManager
        pin_budget = int(self.runner.num_blocks * config.cache_retention_budget)
        self.kv_manager = manager_class(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_hash_algo,
            eviction_policy=config.eviction_policy,
            num_host_blocks=self.runner.num_host_blocks,
            sliding_window=self.model_config.kv_window,
            pin_budget_blocks=pin_budget,
            pin_budget_per_owner=int(pin_budget * config.cache_retention_tenant_budget),
            pin_ttl_s=config.cache_retention_ttl_s,
            **(self.tiers.manager_kwargs() if self.tiers is not None else {}),  # type: ignore[arg-type]
        )
        if isinstance(self.kv_manager, TimedKVCacheManager):
            self.kv_manager.step_timer = self.step_timer
        if self.kv_event_recorder is not None:
            self.kv_event_recorder.cleared()  # a fresh manager: whatever the old one held is gone
            self.kv_manager.record_events(self.kv_event_recorder)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.enable_chunked_prefill,
                config.preemption_mode,
                evict_generated_first=config.evict_generated_first,
                protect_static_prefix=config.protect_static_prefix,
                max_model_len=self.max_model_len,
                scheduling_policy=config.scheduling_policy,
                max_loras=config.max_loras if config.enable_lora else None,
            ),
            self.kv_manager,
        )
        self.requests: dict[str, Request] = {}
        if self.runner.lora is not None:  # a live request's adapter stays loaded until it finishes
            self.runner.lora.in_use = lambda: {n for r in self.requests.values() if (n := r.lora_name) is not None}
        # Adapters served by name (EngineConfig.lora_modules, load_lora_adapter): what a request's
        # ``model`` may name besides the base model.
        self.lora_adapters: dict[str, LoRARequest] = {}
        for module in config.lora_modules:
            name, _, path = module.partition("=")
            self.load_lora_adapter(name, path)
        self._observe_lora()
        # Requests whose next step needs their last tokens on the host (async_scheduling's
        # fallback, ``_needs_host_tokens``); pruned as they leave ``requests``.
        self._host_bound: dict[str, Request] = {}
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
        self._carried_pins = self._pin_totals()
        if self.tiers is not None:
            self.tiers.carry(self.kv_manager.stats)
        self.pipeline.reset()
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
        workers (idempotent). Steps in flight finish first."""
        try:
            self.drain()
        except Exception as exc:  # noqa: BLE001 - shutting down regardless
            log.warning("a step in flight failed during shutdown: %r", exc)
        self.pipeline.close()
        self.runner.shutdown()
        self.grammars.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    # --- requests ------------------------------------------------------------

    @property
    def tracer(self) -> RequestTracer | None:
        """Where finished requests' spans go (the output processor's); None: untraced."""
        return self.output_processor.tracer

    @tracer.setter
    def tracer(self, tracer: RequestTracer | None) -> None:
        self.output_processor.tracer = tracer

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        *,
        trace_headers: Mapping[str, str] | None = None,
        conversation: bool = False,
        static_prefix_tokens: int = 0,
        grammar: Any = None,
        lora_request: LoRARequest | None = None,
        tool_mode: ToolCallMode | None = None,
        priority: int = 0,
    ) -> Request:
        """Build a prompt its caller rendered into an EngineRequest's PreparedRequest (the input
        processor's ``encode_prompt`` and ``build``, in the caller's thread) and queue it.

        ``trace_headers``: the W3C trace context the request arrived with (its spans' parent).
        ``conversation``: a turn whose answer the next turn's prompt repeats (its generated
        blocks are not sent to the cold end of the eviction order).
        ``static_prefix_tokens``: the prompt's leading tokens other requests share (its system
        prompt, ``InputProcessor.static_prefix_tokens``): their blocks are kept as reused ones are.
        ``grammar``: the compiled grammar of ``params.structured_outputs`` (``self.grammars``);
        when it is missing the constraint is compiled here.
        ``tool_mode``: read each sequence's text for tool calls (StreamDelta.content / tool_calls).
        ``lora_request``: the LoRA adapter it runs with (EngineConfig.enable_lora), loaded and checked
        here: a bad adapter is a ValueError and nothing is queued.
        ``priority``: vLLM's request priority (EngineConfig.scheduling_policy).
        """
        request = rendered_request(
            request_id or f"req-{next(self._ids)}",
            prompt,
            params,
            cache_salt,
            trace_headers,
            conversation,
            tool_mode,
            priority,
        )
        if lora_request is not None:
            self.add_lora(lora_request)
        processor = self.input_processor
        arrival = arrival_time or time.monotonic()
        encoded = processor.encode_prompt(prompt, params, static_prefix_tokens=static_prefix_tokens)
        if grammar is None:
            grammar = processor.compile_grammar(params)
        return self.add_prepared(
            processor.build(request, encoded, grammar, arrival_time=arrival, lora_request=lora_request)
        )

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (vLLM's ``add_lora``): ValueError when LoRA is off or the
        adapter does not fit the model; a good one stays loaded while it is among the
        ``max_cpu_loras`` most recently used."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True (the engine was started without it)")
        self.runner.lora.add(lora_request)

    def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter at ``path`` under ``name`` (vLLM's ``/v1/load_lora_adapter``), loaded
        and checked now. ValueError, with nothing changed, when LoRA is off, ``name`` is served
        already (or is the base model's), or the adapter does not fit (rank, modules, base model,
        missing or corrupt files). A name keeps meaning the adapter it first named until the engine
        restarts (its KV blocks are keyed by name): loading it again takes the same path.
        """
        if name in self.lora_adapters or name in (self.config.model_name, self.config.model):
            raise ValueError(f"the name {name!r} is already served; unload it first or pick another")
        next_id = max((r.lora_int_id for r in self.lora_adapters.values()), default=0) + 1
        request = LoRARequest(name, next_id, path)
        self.add_lora(request)
        self.lora_adapters[name] = request
        self._observe_lora()
        return request

    def unload_lora_adapter(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (vLLM's ``/v1/unload_lora_adapter``): a request naming it from now on
        is unknown; those in flight finish with it, after which its memory is freed. KeyError when
        ``name`` is not served."""
        request = self.lora_adapters.pop(name)
        if self.runner.lora is not None:
            self.runner.lora.unload(name)
        self._observe_lora()
        return request

    def check_admission(self, request_id: str, *, in_use: Container[str] | None = None, pending: int = 0) -> None:
        """What admitting a request depends on besides the request (which the input processor checked):
        raise RequestRejected when its id is in use, EngineOverloadedError when the waiting queue is full.

        ``in_use``: the ids taken (default: this engine's requests; the async engine's are its streams');
        ``pending``: requests on their way to the waiting queue (the async engine's, not added yet).
        """
        if request_id in (self.requests if in_use is None else in_use):
            raise RequestRejected(f"request id {request_id!r} is already in use")
        bound = self.config.max_waiting_requests
        waiting = self.scheduler.num_waiting + pending
        if bound is not None and waiting >= bound:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting (max_waiting_requests={bound}); retry later"
            )

    def add_prepared(self, prepared: PreparedRequest) -> Request:
        """Queue a request the input processor prepared (validated there; nothing is checked again
        but what depends on the engine's state now: ``check_admission``)."""
        request_id = prepared.request_id
        self.check_admission(request_id)
        if prepared.lora_request is not None:
            self.add_lora(prepared.lora_request)  # in memory while the request lives (LoRAManager)
        req = Request(prepared)
        seq = self._new_sequence(req, 0)
        self.scheduler.add(seq)
        req.seqs.append(seq)
        self.requests[request_id] = req
        if _needs_host_tokens(req):
            self._host_bound[request_id] = req
        self.stalled = False
        constraint = prepared.params.structured_outputs
        if constraint is not None:
            self.structured_metrics.requests[constraint.kind].inc()
        return req

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
        continuation = req.prepared.continuation
        if continuation is not None and index == 0:
            self._continue(seq, continuation)
        return seq

    def _continue(self, seq: Sequence, continuation: Continuation) -> None:
        """Stand ``seq`` where the stream it continues stood (OutputProcessor.replay): its tokens are
        prefilled with the prompt, nothing already sent is sent again, a seeded generator draws next
        what it would have, and the prompt's logprobs (sent by the first replica) are not asked again."""
        self.output_processor.replay(seq, continuation)
        if seq.generator is not None and not seq.request.params.greedy:
            advance_generator(seq.generator, len(continuation.output_token_ids), self.model_config.vocab_size)
        seq.request.prompt_logprobs = None
        seq.request.prompt_logprobs_sent = True

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
                self._end(seq)

    def _end(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler; its blocks are freed once no step in flight holds it."""
        pipeline = self.pipeline
        if pipeline.busy and pipeline.holds(seq):
            self.scheduler.finish(seq, free_blocks=False)
            pipeline.defer(seq, self.scheduler.free)
        else:
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is in the engine or a step is still in flight (``step`` again)."""
        return bool(self.requests) or self.pipeline.busy

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet of the waiting and the still-prefilling running sequences.

        Safe to call from another thread than the engine's: ``list()`` of a deque or list is
        one C call under the GIL, so the copies are consistent. Waiting sequences count their
        whole uncomputed prompt (their prefix-cache lookup happens at admission), so this is
        an upper bound of the prefill work ahead.
        """
        scheduler = self.scheduler
        total = 0
        for seq in list(scheduler.waiting) + list(scheduler.running):
            total += max(0, int(seq.num_prompt_tokens) - int(seq.num_computed_tokens))
        return total

    # --- one step --------------------------------------------------------------

    def step(self) -> list[EngineUpdate]:
        """Schedule, run the model, post-process; one update per request touched.

        With ``async_scheduling`` the updates are those of the step before the one this call
        schedules (the first call after an idle spell returns none; ``drain`` the last).
        A failure in one request's own work fails that request (an update with
        ``error``); an exception escaping this method is fatal (see ``reset``).
        """
        updates = self._step()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
        return updates

    def _publish_kv_events(self) -> None:
        """The step's block events as one batch (none when nothing changed), as vLLM's scheduler does."""
        assert self.kv_event_recorder is not None and self.kv_event_publisher is not None
        if self._disk_events is not None and time.monotonic() >= self._disk_events_due:
            assert self.tiers is not None and self.tiers.disk is not None
            self._disk_events_due = time.monotonic() + LIST_EVERY_S
            self._disk_events.update(self.tiers.disk.known_hashes())
        events = self.kv_event_recorder.take()
        if events:
            self.kv_event_publisher.publish(events)

    def _step(self) -> list[EngineUpdate]:
        if self.config.async_scheduling and self._may_overlap():
            return self._step_async()
        if self.pipeline.busy:  # the synchronous step needs the tokens in flight first
            timer = self.step_timer
            if timer is not None:
                timer.start()
            updates = self._complete_oldest()
            self.stalled = False
            if timer is not None:
                timer.finish("output", 0)
            return updates
        return self._step_sync()

    def drain(self) -> list[EngineUpdate]:
        """Finish every step in flight and process its outputs (their updates); afterwards the
        engine holds no step in flight and no deferred free (shutdown, reset, abort-all)."""
        updates: list[EngineUpdate] = []
        while self.pipeline.busy:
            updates += self._complete_oldest()
        return updates

    def _may_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are on the host."""
        if self.tiers is not None:  # tier copies run on the engine thread around each step
            return False
        bound = self._host_bound
        if bound:
            for rid, req in list(bound.items()):
                if self.requests.get(rid) is not req:
                    del bound[rid]
            if bound:
                return False
        return not self.scheduler.may_preempt()

    def _step_async(self) -> list[EngineUpdate]:
        """Schedule step N+1 and queue it behind step N on the device thread, then process
        step N's outputs (replica/engine/step_pipeline.py)."""
        timer = self.step_timer
        if timer is not None:
            timer.start()
        pipeline = self.pipeline
        prev = pipeline.last
        plan = self.scheduler.schedule()
        if plan.preempted:
            raise RuntimeError("the scheduler preempted although may_preempt said it would not")
        if timer is not None:
            timer.lap("schedule")
        self.kv_manager.take_tier_ops()  # none without tiers (which _may_overlap excludes)
        scheduled_at = time.monotonic()
        failed: dict[str, tuple[Request, Exception]] = {}
        for seq in plan.rejected:
            failed[seq.request.request_id] = (seq.request, self._never_schedulable())
        specs: list[tuple[int, SampleSpec]] = []
        owners: list[Sequence] = []
        placeholders: list[tuple[int, int]] = []
        for i, s in enumerate(plan.scheduled):
            seq, req = s.seq, s.seq.request
            if req.scheduled_time is None:
                req.scheduled_time = scheduled_at
            if seq.num_placeholders:
                assert prev is not None
                placeholders.append((i, prev.row_of[seq]))
            if not s.samples:
                continue
            if seq.awaits_fork or req.grammar is not None:
                raise RuntimeError(f"request {req.request_id} needs the synchronous step (_needs_host_tokens)")
            try:
                spec = SampleSpec(req.params, seq.generator, self._banned(seq), seq.token_ids, seq.num_prompt_tokens)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[req.request_id] = (req, self._request_error(req, exc))
                continue
            specs.append((i, spec))
            owners.append(seq)
        if not plan.is_empty:
            prepared = self.runner.prepare(plan.scheduled, plan.copy_ops, specs, (), [i for i, _ in placeholders])
            if plan.swap_out:
                raise RuntimeError("swap-out copies without a preemption")
            num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.start < s.seq.num_prompt_tokens)
            pipeline.submit(plan.scheduled, owners, prepared, placeholders, plan.swap_in, num_prompt)
        updates = self._complete_oldest(timer) if prev is not None else []
        if prev is None:
            self._observe_step(0, 0)
        updates += self._fail_all(failed)
        self.stalled = not plan.changed_state and prev is None  # completing a step is progress
        if timer is not None:
            timer.finish("output", len(plan.scheduled))
        return updates

    def _complete_oldest(self, timer: StepTimer | None = None) -> list[EngineUpdate]:
        """Wait for the oldest step in flight and process its outputs (``_post_step``)."""
        step, out = self.pipeline.wait_oldest()
        if timer is not None:
            timer.lap("forward")
        return self._post_step(step.owners, out.results, {}, step.num_prompt_tokens, timer, pipelined=True)

    def _step_sync(self) -> list[EngineUpdate]:
        """One step on the engine thread: schedule, forward, sample, post-process."""
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
            failed[seq.request.request_id] = (seq.request, self._never_schedulable())
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
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.start < s.seq.num_prompt_tokens)
        updates = self._post_step(owners, results, failed, num_prompt, timer, pipelined=False)
        if timer is not None:
            timer.finish("output", len(plan.scheduled))
        return updates

    def _post_step(
        self,
        owners: list[Sequence],
        results: list[SampleResult],
        failed: dict[str, tuple[Request, Exception]],
        num_prompt_tokens: int,
        timer: StepTimer | None,
        *,
        pipelined: bool,
    ) -> list[EngineUpdate]:
        """A step's sampled tokens into their requests, for both step paths: each owner's token
        appended (detokenization, stop checks), finished sequences ended, the step's updates and
        metrics, the failed requests (``failed``, and any whose work fails here, alone) reported
        and freed.

        ``pipelined``: the step ran on the pipeline while the next one was scheduled, so a sequence
        finished or aborted since has its row discarded, the block a token completes is registered
        here (a synchronous step registered it when it scheduled), and only the tokens appended
        count as generated (a synchronous step counts each sampled row).
        """
        now = time.monotonic()
        touched: dict[str, Request] = {}
        appended = 0
        for seq, result in zip(owners, results):
            req = seq.request
            rid = req.request_id
            if seq.is_finished or rid in failed:
                continue
            try:
                if result.error is not None:
                    raise result.error
                reason = self.output_processor.append_token(seq, result.token_id, result.logprobs, now)
                appended += 1
                if pipelined:
                    self.kv_manager.register_known(seq.seq_id, seq.token_ids)
                if reason is not None:
                    self._finish(seq, reason)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[rid] = (req, self._request_error(req, exc))
                continue
            touched[rid] = req
        if timer is not None:
            timer.lap("detokenize")
        updates = self._updates(touched, failed, now)
        self._observe_step(num_prompt_tokens, appended if pipelined else len(owners))
        return updates + self._fail_all(failed)

    def _updates(
        self, touched: dict[str, Request], failed: dict[str, tuple[Request, Exception]], now: float
    ) -> list[EngineUpdate]:
        """The step's update of each touched request (a finished one leaves ``requests``);
        a failure here adds the request to ``failed``."""
        updates = []
        hook = self.fault_hook
        for rid, req in touched.items():
            if rid in failed:
                continue
            try:
                if hook is not None:
                    hook(req)
                update = self.output_processor.update(req, now)
                if update.output is not None:
                    self.requests.pop(rid, None)
                updates.append(update)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[rid] = (req, self._request_error(req, exc))
        return updates

    @staticmethod
    def _never_schedulable() -> RequestRejected:
        return RequestRejected(
            "the request can never be scheduled: it needs more sequences, KV blocks or batched tokens "
            "than this engine has"
        )

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
                    PromptLogprobSpan(
                        i, first - s.start, list(prompt[first + 1 : last + 1]), req.params.prompt_logprobs or 0
                    )
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
        # token the grammar requires (the row would have no token left). A placeholder's token
        # (asynchronous scheduling) counts: it precedes the one this row samples.
        if seq.num_output_tokens + seq.num_placeholders >= p.min_tokens or seq.grammar is not None:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return tuple(p.stop_token_ids) + eos

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self._end(seq)

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

    def _pin_totals(self) -> PinTotals:
        st = self.kv_manager.stats
        return self._carried_pins + PinTotals(
            self.scheduler.num_pin_refusals, st.num_pins_expired, st.num_pins_released_for_room
        )

    def _observe_lora(self) -> None:
        """The LoRA metrics: adapters in use, held and loaded so far (after each step, and after
        adapters are loaded outside a step, so that loads at start count as soon as they happen)."""
        lora = self.runner.lora
        if lora is None:
            return
        sched = self.scheduler
        self.metrics.observe_lora(
            max_loras=lora.max_loras,
            running=(n for seq in sched.running if (n := seq.request.lora_name) is not None),
            waiting=(n for seq in sched.waiting if (n := seq.request.lora_name) is not None),
            loaded=lora.loaded,
            resident=sum(1 for name in lora.resident if name is not None),
            num_loads=lora.num_loads,
            capacity=lora.max_cpu_loras,
        )

    def _observe_step(self, num_prompt_tokens: int, num_generated: int) -> None:
        st = self.kv_manager.stats
        host_usage = st.num_used_host_blocks / st.num_host_blocks if st.num_host_blocks else 0.0
        self.metrics.observe_swap(self._swap_totals(), num_swapped=st.num_swapped_requests, host_usage=host_usage)
        self.metrics.observe_pins(self._pin_totals(), num_pinned=st.num_pinned_blocks)
        if self.tiers is not None:
            self.tiers.observe(st)
        self._observe_lora()
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
            lora_loaded=tuple(lora.loaded) if (lora := self.runner.lora) is not None else (),
            lora_loads=lora.num_loads if lora is not None else 0,
            lora_capacity=lora.max_cpu_loras if lora is not None else 0,
        )


def _needs_host_tokens(req: Request) -> bool:
    """Whether scheduling a step of ``req`` needs the tokens of its step before on the host: a
    fork (n > 1), a grammar's matcher, penalties and bad_words (they read the output tokens),
    prompt logprobs. Such a request keeps the engine on its synchronous step."""
    p = req.params
    return (
        p.n > 1
        or req.grammar is not None
        or p.has_penalties
        or bool(req.bad_words_token_ids)
        or p.prompt_logprobs is not None
    )
