"""The engine's view of the model: one step in, sampled tokens out, on one process or N.

``ModelRunner.execute(scheduled, copy_ops, specs)`` turns a scheduler plan into one
packed forward pass (replica/worker/step_inputs.py) and samples one token per sampling spec;
it is ``prepare`` (the inputs, on the engine thread) then ``run`` (forward and sampling,
which the step pipeline of asynchronous scheduling runs on its device thread).
With ``tensor_parallel_size`` 1 the runner's :class:`ModelShard` is the whole model.
With N > 1 this process is rank 0 of N: the runner starts the other ranks
(replica/executor/tensor_parallel.py), sends each step's inputs to them as one message, runs its
own shard in lockstep, and samples from the logits only rank 0 receives. The engine
above sees the same runner either way: one KV block count (the minimum over ranks),
one block id space, one sampler.

Nothing here knows requests beyond the ScheduledSeq records it is handed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.errors import EngineDeadError
from prefixserve.replica.executor.ray_bundles import RankResources, reserve_rank_resources
from prefixserve.replica.executor.tensor_parallel import WorkerGroup, WorkerSpec
from prefixserve.replica.executor.tp_protocol import (
    OP_CLEAR,
    OP_LORA,
    init_distributed,
    step_message,
    swap_message,
)
from prefixserve.replica.lora.adapter import ModuleShapes
from prefixserve.replica.lora.manager import LoRAManager, LoRAStep
from prefixserve.replica.model import loader
from prefixserve.replica.model.layers import TPGroup
from prefixserve.replica.model.llama import LlamaForCausalLM, ModelConfig
from prefixserve.replica.model.startup import StartupTimer
from prefixserve.replica.worker.input_builder import StepInputBuilder
from prefixserve.replica.worker.model_shard import ModelShard, resolve_device, resolve_dtype
from prefixserve.replica.worker.sampler import SampleResult, SampleSpec, prompt_logprobs, sample_tokens
from prefixserve.replica.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass
class PromptLogprobSpan:
    """Prompt tokens of one scheduled sequence whose logits a request's prompt_logprobs needs.

    Rows ``first .. first + len(next_tokens) - 1`` of the sequence's new tokens; row ``j``
    predicts ``next_tokens[j]``. ``execute`` fills ``logprobs`` (top ``k`` plus that token)
    and ``ranks`` (that token's rank in its row).
    """

    index: int
    first: int
    next_tokens: list[int]
    k: int
    logprobs: list[dict[int, float]] | None = None
    ranks: list[int] | None = None


class _PromptLogitsConsumer:
    """Takes the LM head's slices: keeps the sampled rows' logits (the first ``num_sampled``
    rows) and reduces each span's rows to prompt logprobs as they arrive."""

    def __init__(self, num_sampled: int, spans: Sequence[PromptLogprobSpan]) -> None:
        self.num_sampled = num_sampled
        self.sampled: list[torch.Tensor] = []
        self.spans: list[tuple[int, PromptLogprobSpan]] = []
        row = num_sampled
        for span in spans:
            self.spans.append((row, span))
            span.logprobs, span.ranks = [], []
            row += len(span.next_tokens)

    def __call__(self, first: int, logits: torch.Tensor) -> None:
        end = first + logits.shape[0]
        if first < self.num_sampled:
            self.sampled.append(logits[: min(end, self.num_sampled) - first])
        for start, span in self.spans:
            lo, hi = max(first, start), min(end, start + len(span.next_tokens))
            if lo < hi:
                entries, ranks = prompt_logprobs(
                    logits[lo - first : hi - first], span.next_tokens[lo - start : hi - start], span.k
                )
                assert span.logprobs is not None and span.ranks is not None
                span.logprobs += entries
                span.ranks += ranks

    def sample_logits(self) -> torch.Tensor | None:
        if not self.sampled:
            return None
        return self.sampled[0] if len(self.sampled) == 1 else torch.cat(self.sampled)


@dataclass
class PreparedStep:
    """One step's inputs, built by ``ModelRunner.prepare``, for ``ModelRunner.run``."""

    inputs: StepInputs
    specs: list[SampleSpec]
    consumer: _PromptLogitsConsumer | None = None
    # The step's adapters: slot writes and rows by slot (None: no row has an adapter).
    lora: LoRAStep | None = None


@dataclass
class StepOutput:
    """One step's sampled tokens: a result per spec, and their ids as a tensor (None: no row sampled)."""

    results: list[SampleResult]
    tokens: torch.Tensor | None


class ModelRunner:
    """Rank 0's model shard, plus the worker ranks when ``tensor_parallel_size`` > 1."""

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        checkpoint: loader.CheckpointSource,
        *,
        max_model_len: int,
        checkpoint_dtype: torch.dtype | None = None,
        startup: StartupTimer | None = None,
    ) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self._closed = False
        self.tp_size = size = config.tensor_parallel_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype)
        # Tables may hold NULL_BLOCK entries (blocks freed outside the sliding window).
        self.sliding = model_cfg.kv_window is not None
        self.workers: WorkerGroup | None = None
        # Inside a Ray Serve replica: what its placement group reserved for each rank.
        self.rank_resources: RankResources | None = None
        threads: list[int | None] = [None] * size
        if size > 1:
            model_cfg.check_tensor_parallel(size)
            self.rank_resources = reserve_rank_resources(size)
            if self.rank_resources is not None:
                threads = [max(1, int(c)) for c in self.rank_resources.num_cpus]
            gpus = self.rank_resources.cuda_visible_devices if self.rank_resources else None
            if self.device.type == "cuda" and gpus is None and torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, {torch.cuda.device_count()} visible")
        checkpoint = loader.prepare(checkpoint)
        try:
            if size > 1:
                self.workers = self._start_workers(checkpoint, checkpoint_dtype, threads)
            self.shard = ModelShard(
                config,
                model_cfg,
                loader.iter_weights(checkpoint, mapped=size > 1),
                max_model_len=max_model_len,
                tp=TPGroup(0, size),
                device=self.device,
                dtype=self.dtype,
                num_threads=threads[0],
                startup=startup,
            )
            with (startup or StartupTimer()).phase("kv_cache"):
                self._allocate_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        # The engine's step timer (replica/engine/step_timer.py): called with a phase's name as it ends.
        self.lap: Callable[[str], None] | None = None
        # Builds each step's inputs, keeping the block tables between steps; the stateless
        # builders (input_builder.build_step_inputs, step_inputs.build_step_inputs, the torch
        # reference) take the same arguments and give the same tensors (bench_host compares them).
        max_blocks = -(-max_model_len // self.shard.block_size)
        self.build_inputs: Callable[..., StepInputs] = StepInputBuilder(config.max_num_seqs, max_blocks)
        # The adapters in memory and in the shard's slots (enable_lora; one rank only).
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(
                ModuleShapes.of(model_cfg),
                config.max_loras,
                config.lora_cpu_capacity,
                config.max_lora_rank,
                config.model,
            )

    def _start_workers(
        self, checkpoint: loader.CheckpointSource, checkpoint_dtype: torch.dtype | None, threads: list[int | None]
    ) -> WorkerGroup:
        timeout = torch.distributed.distributed_c10d.default_pg_timeout
        store = torch.distributed.TCPStore(
            "127.0.0.1", 0, world_size=self.tp_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        spec = WorkerSpec(
            self.config, self.model_cfg, checkpoint, self.max_model_len, checkpoint_dtype, store.port, threads
        )
        gpus = self.rank_resources.cuda_visible_devices if self.rank_resources else None
        workers = WorkerGroup(spec, self.tp_size, cuda_visible_devices=gpus)
        self._store = store  # the rendezvous lives as long as the group
        try:
            workers.wait_while(
                "joining the group",
                lambda: init_distributed(store, 0, self.tp_size, self.device, self.config.distributed_timeout_s),
            )
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def _allocate_kv_cache(self) -> None:
        """Every rank allocates the block count all of them can hold (the minimum over ranks)."""
        blocks, host_blocks = self.shard.kv_block_capacity(), self.shard.host_block_capacity()
        if self.workers is not None:
            for worker_blocks, worker_host in self.workers.collect("loading its weights"):
                blocks, host_blocks = min(blocks, worker_blocks), min(host_blocks, worker_host)
        if blocks < 2:
            raise ValueError(
                f"KV cache too small: {blocks} blocks of {self.shard.kv_bytes_per_block} bytes fit "
                f"(per rank); raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks"
            )
        if self.config.swap_space_gb > 0 and host_blocks < 1:
            raise ValueError(
                f"swap_space_gb={self.config.swap_space_gb} holds no KV block of "
                f"{self.shard.kv_bytes_per_block} bytes: raise it"
            )
        tier = self.config.kv_offloading_size
        if tier is not None and tier / self.tp_size * 1024**3 < self.shard.kv_bytes_per_block:
            raise ValueError(
                f"kv_offloading_size={tier} GiB holds no KV block of {self.shard.kv_bytes_per_block} bytes "
                f"(per rank, over {self.tp_size} rank(s)): raise it or leave it unset"
            )
        if self.workers is not None:
            self.workers.reply((blocks, host_blocks))
        self.shard.allocate_kv_cache(blocks, host_blocks)
        # What each rank holds (weights, KV cache), by rank; logged at start under tensor parallelism.
        self.rank_memory = [self.shard.memory()]
        if self.workers is not None:
            self.rank_memory = self.workers.log_memory(self.shard.memory())

    # --- what the engine reads ------------------------------------------------------

    @property
    def model(self) -> LlamaForCausalLM:
        return self.shard.model

    @property
    def num_blocks(self) -> int:
        return self.shard.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.shard.num_host_blocks

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on one rank (all layers, K and V)."""
        return self.shard.kv_bytes_per_block

    @property
    def k_cache(self) -> torch.Tensor:
        return self.shard.k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        return self.shard.v_cache

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks 1..N-1 (empty for TP 1)."""
        return [] if self.workers is None else [p.pid for p in self.workers.procs if p.pid is not None]

    @property
    def is_alive(self) -> bool:
        """False once a tensor-parallel worker died (the engine cannot step again)."""
        return self.workers is None or self.workers.is_alive

    @property
    def death_reason(self) -> str | None:
        return None if self.workers is None else self.workers.death_reason

    # --- one step ------------------------------------------------------------

    def execute(
        self,
        scheduled: list[ScheduledSeq],
        copy_ops: list[tuple[int, int]],
        specs: list[tuple[int, SampleSpec]],
        prompt_spans: Sequence[PromptLogprobSpan] = (),
    ) -> list[SampleResult]:
        """Run one packed forward pass and sample (``prepare`` then ``run``).

        ``specs`` pairs an index into ``scheduled`` (a sequence that samples) with its
        SampleSpec; several specs may share one row (the children of a fork sample
        the same prompt logits). Returns one result per spec, in order. Each of
        ``prompt_spans`` gets its tokens' prompt logprobs in ``span.logprobs`` (from the
        raw logits of those rows, on rank 0). Under tensor parallelism any failure raises
        WorkerDiedError (ranks may be out of step).
        """
        return self.run(self.prepare(scheduled, copy_ops, specs, prompt_spans), lap=self.lap).results

    def prepare(
        self,
        scheduled: list[ScheduledSeq],
        copy_ops: list[tuple[int, int]],
        specs: list[tuple[int, SampleSpec]],
        prompt_spans: Sequence[PromptLogprobSpan] = (),
        placeholders: Sequence[int] = (),
    ) -> PreparedStep:
        """A step's packed inputs (the host's half of ``execute``; laps ``prepare``).
        ``placeholders``: see ``step_inputs.build_step_inputs``."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        inputs = self.build_inputs(
            scheduled,
            copy_ops,
            [i for i, _ in specs],
            self.shard.block_size,
            sliding=self.sliding,
            logit_spans=[(p.index, p.first, len(p.next_tokens)) for p in prompt_spans],
            placeholders=placeholders,
        )
        consumer = _PromptLogitsConsumer(len(specs), prompt_spans) if prompt_spans else None
        lora = None
        if self.lora is not None:
            lora = self.lora.plan_step(
                [s.seq.request.lora_name for s in scheduled], [s.num_new_tokens for s in scheduled]
            )
        if self.lap is not None:
            self.lap("prepare")
        return PreparedStep(inputs, [s for _, s in specs], consumer, lora)

    def run(self, step: PreparedStep, *, lap: Callable[[str], None] | None = None) -> StepOutput:
        """The forward pass and sampling of a prepared step (the device's half of ``execute``;
        ``lap``: the step timer's, laps ``forward`` and ``sample``). May run on another thread
        than ``prepare`` (replica/engine/step_pipeline.py), one step at a time."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        inputs, consumer = step.inputs, step.consumer
        if self.workers is None:
            logits = self.shard.run(inputs, consumer, lora=step.lora)
        else:
            if step.lora is not None:  # the workers write their shards of new adapters, then map the rows
                mapping = step.lora.mapping
                self.workers.send(torch.tensor([OP_LORA], dtype=torch.int64))
                self.workers.reply((step.lora.writes, mapping.token_slots if mapping is not None else None))
            self.workers.send(step_message(inputs.pack()))
            try:
                logits = self.shard.run(inputs, consumer, lora=step.lora)
            except Exception as exc:
                raise self.workers.failure(exc) from exc
        if consumer is not None:
            logits = consumer.sample_logits()
        if lap is not None:
            lap("forward")
        if logits is None or not step.specs:
            return StepOutput([], None)
        with torch.inference_mode():
            results, tokens = sample_tokens(logits, step.specs, self.generator, self.config.logprobs_mode)
        if lap is not None:
            lap("sample")
        return StepOutput(results, tokens)

    def swap(self, out_ops: list[tuple[int, int]], in_ops: list[tuple[int, int]]) -> None:
        """Apply a step's swap copies on every rank (see ModelShard.swap)."""
        if self.workers is not None:
            self.workers.send(swap_message(out_ops, in_ops))
        self.shard.swap(out_ops, in_ops)

    def clear_kv_cache(self) -> None:
        """Zero every rank's cache (after a failed step, see LLMEngine.reset)."""
        if self.workers is not None:
            self.workers.send(torch.tensor([OP_CLEAR], dtype=torch.int64))
        self.shard.clear_kv_cache()

    def shutdown(self) -> None:
        """Stop the worker ranks, leave the process group and release this rank's model and
        KV cache (on CUDA, back to the device); idempotent. The runner cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        if self.workers is not None:
            self.workers.shutdown()
        shard = getattr(self, "shard", None)  # absent when start-up failed before it was built
        if shard is not None:
            shard.release()
        if self.rank_resources is not None:
            self.rank_resources.release()  # after the ranks are gone: the GPUs they used
        if torch.distributed.is_initialized() and self.tp_size > 1:
            torch.distributed.destroy_process_group()
