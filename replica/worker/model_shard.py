"""One rank's share of the model: its weight shard, its KV cache shard, one forward pass.

A :class:`ModelShard` is what every tensor-parallel rank runs, the driver (rank 0) and
each worker alike: the model built for its ``TPGroup`` (its query/KV heads, MLP columns,
vocabulary rows), loaded from the full checkpoint tensors (each parameter's loader cuts
its rows out), and a KV cache of ``[num_layers, num_blocks, ...]`` over its own KV heads
in the attention backend's layout. Block ids mean the same on every rank: block ``b``
of rank ``r`` holds rank ``r``'s heads of the tokens the driver's KV manager put in ``b``.

:meth:`run` applies a step's copy-on-write block copies, runs the forward pass over the
packed tokens and returns the logits of the sampled rows (rank 0; None on other ranks).
With ``swap_space_gb`` > 0 a host pool of the same layout (pinned memory on CUDA, so
the copies are DMA) holds swapped-out blocks; :meth:`swap` copies device -> host first,
then host -> device.

Sizing (:meth:`kv_block_capacity`) applies the engine's memory knobs to this rank alone;
the caller takes the minimum over ranks and calls :meth:`allocate_kv_cache`.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from prefixserve.kernels.backends import select_backend
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.lora.manager import LoRAStep
from prefixserve.replica.lora.slots import LoRASlots
from prefixserve.replica.model.layers import TPGroup
from prefixserve.replica.model.llama import AttentionMetadata, LlamaForCausalLM, ModelConfig
from prefixserve.replica.model.startup import StartupTimer
from prefixserve.replica.worker.graph_runner import DecodeGraphRunner, graph_batch_sizes
from prefixserve.replica.worker.step_inputs import StepInputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# LM-head rows per call: prompt_logprobs ask for every prompt row of a chunk, whose logits are
# consumed slice by slice rather than held at once. Every rank slices alike (the head is collective).
LOGIT_SLICE_ROWS = 256


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, for the start-up log (bytes)."""

    rank: int
    device: str
    weights: int
    kv_cache: int
    num_blocks: int
    num_kv_heads: int

    def describe(self) -> str:
        mib = 1024**2
        return (
            f"on {self.device}: weights {self.weights / mib:,.1f} MiB (MKL-packed copies included), "
            f"KV cache {self.kv_cache / mib:,.1f} MiB ({self.num_blocks} blocks, "
            f"{self.num_kv_heads} KV heads per layer)"
        )


def keep_freed_memory_mapped() -> bool:
    """Make glibc's malloc keep freed memory instead of handing it back to the OS.

    Every step allocates activations of tens of MB (the MLP's gate/up output is
    ``tokens x 2 x intermediate`` floats). glibc serves such sizes with fresh mmap
    pages and unmaps them on free, so each step page-faults through every one of
    them again: measured, a third of the time of SiLU-and-mul and ~10% of a prefill
    step. Raising the mmap threshold to its maximum (32 MiB) and the trim threshold
    to 1 GiB keeps those pages in the heap for reuse (vLLM's CPU guide gets the same
    effect by preloading tcmalloc). Process-wide; a no-op off glibc. Returns whether it applied.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
        return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20))
    except (OSError, AttributeError):
        return False


def cpu_threads_per_rank(tp_size: int) -> int | None:
    """Torch threads each rank of a CPU engine uses: its share of the cores; None when the
    user chose the count (OMP_NUM_THREADS), which is then kept."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 1) // tp_size)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel ``rank``: "auto" = CUDA when available; "cuda" = the
    rank-th visible GPU (a worker pinned through CUDA_VISIBLE_DEVICES sees just its own)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available: use device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16


class ModelShard:
    """The model and KV cache of one tensor-parallel rank (the whole model when TP is 1).

    ``num_threads``: torch threads on CPU (what the rank's Ray bundle reserved); None =
    :func:`cpu_threads_per_rank`."""

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        max_model_len: int,
        tp: TPGroup,
        device: torch.device,
        dtype: torch.dtype,
        num_threads: int | None = None,
        startup: StartupTimer | None = None,
    ) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.num_kv_heads, _ = tp.kv_heads(model_cfg.num_kv_heads)
        # The KV cache's element type: the activations' dtype, or fp8 e4m3 (1 byte per element).
        self.kv_cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, dtype)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            threads = num_threads or cpu_threads_per_rank(tp.size)
            if threads is not None:
                torch.set_num_threads(threads)
            keep_freed_memory_mapped()
        startup = startup or StartupTimer()
        with startup.phase("kernels"):
            self.backend = select_backend(config.attention_backend, device, dtype)
        with startup.phase("weights"):
            with torch.device(device):
                self.model = LlamaForCausalLM(
                    model_cfg,
                    max_model_len=max_model_len,
                    backend=self.backend,
                    dtype=dtype,
                    tp=tp,
                )
            self.model.load_weights(weights)
            self.model.configure_kv_cache(fp8=self.kv_cache_dtype != dtype, calculate_scales=config.calculate_kv_scales)
            self.model.eval()
            if self.backend.name == "cpu":
                self.model.pack_weights_for_cpu()
            # Adapter slots in every adaptable projection (enable_lora): allocated before the KV
            # cache is sized, so that their memory is counted.
            self.lora_slots = (
                LoRASlots(
                    self.model,
                    config.max_loras,
                    config.max_lora_rank,
                    dtype,
                    device,
                    triton=self.backend.name == "triton",
                )
                if config.enable_lora
                else None
            )
        self.max_model_len = max_model_len
        self.num_blocks = 0
        self.num_host_blocks = 0
        self.k_cache = self.v_cache = self.k_host = self.v_host = torch.empty(0)
        self.graph_runner: DecodeGraphRunner | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # host -> device copies (CUDA)

    # --- memory -------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on this rank over every layer, K and V (1 byte per element in fp8)."""
        c = self.model_cfg
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * elem

    @property
    def weight_bytes(self) -> int:
        tensors = {id(p): p for p in self.model.parameters()}
        tensors.update(
            {
                id(m.packed_weight): m.packed_weight
                for m in self.model.modules()
                if getattr(m, "packed_weight", None) is not None
            }
        )
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def kv_block_capacity(self) -> int:
        """Blocks this rank could hold: ``num_kv_blocks`` if set, else what its memory knob allows."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            c = self.model_cfg
            elem = torch.empty((), dtype=self.dtype).element_size()
            # Activations of the largest step, generously: a few hidden-sized and MLP-sized rows.
            mlp = c.intermediate_size // self.tp.size
            activations = self.config.max_num_batched_tokens * (8 * c.hidden_size + 4 * mlp) * elem
            activations += self.config.max_num_seqs * c.vocab_size * 4 * 2
            budget = total * self.config.gpu_memory_utilization - (total - free) - activations
        else:
            budget = self.config.kv_cache_memory_bytes
        return max(0, int(budget // self.kv_bytes_per_block))

    def host_block_capacity(self) -> int:
        """Host-pool blocks on this rank: ``swap_space_gb`` plus this rank's share of the host
        tier's ``kv_offloading_size`` (one pool, replica/kv/tiers.py)."""
        tier = (self.config.kv_offloading_size or 0.0) / self.config.tensor_parallel_size
        return int((self.config.swap_space_gb + tier) * 1024**3 // self.kv_bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        c = self.model_cfg
        k_shape, v_shape = self.backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        self.k_cache = torch.zeros((c.num_layers, *k_shape), dtype=self.kv_cache_dtype, device=self.device)
        self.v_cache = torch.zeros((c.num_layers, *v_shape), dtype=self.kv_cache_dtype, device=self.device)
        pin = self.device.type == "cuda"
        self.k_host = torch.zeros(
            (c.num_layers, num_host_blocks, *k_shape[1:]), dtype=self.kv_cache_dtype, pin_memory=pin
        )
        self.v_host = torch.zeros(
            (c.num_layers, num_host_blocks, *v_shape[1:]), dtype=self.kv_cache_dtype, pin_memory=pin
        )
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.model.bind_kv_cache(list(self.k_cache.unbind(0)), list(self.v_cache.unbind(0)))
        self._start_graph_runner()

    def _start_graph_runner(self) -> None:
        """The decode static-buffer path per ``enforce_eager`` (see EngineConfig): captured on
        CUDA at TP 1; uncaptured where asked for explicitly; none otherwise. After the KV
        cache: graphs bake in its addresses. Its memory (buffers, graph pool: activations of
        at most max_num_seqs rows) is within the activations reserve kv_block_capacity keeps."""
        mode = self.config.enforce_eager
        cuda_single = self.device.type == "cuda" and self.tp.size == 1
        if mode is True or (mode is None and not cuda_single):
            return
        sizes = graph_batch_sizes(self.config.max_num_seqs, self.config.cuda_graph_sizes)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graph_runner = DecodeGraphRunner(self.model, sizes, max_blocks, self.device, capture=cuda_single)
        self.graph_runner.capture_all()

    def memory(self) -> RankMemory:
        kv = sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache))
        return RankMemory(self.tp.rank, str(self.device), self.weight_bytes, kv, self.num_blocks, self.num_kv_heads)

    def clear_kv_cache(self) -> None:
        """Zero the cache (after a failed forward may have left NaN where masked reads look)."""
        self.k_cache.zero_()
        self.v_cache.zero_()

    # --- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        inputs: StepInputs,
        consume: Callable[[int, torch.Tensor], None] | None = None,
        *,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor | None:
        """Block copies, then one forward pass; the float32 logits of ``inputs.sample_rows``
        on rank 0 (None on other ranks, and when no row samples). ``lora``: the step's adapter
        slot writes, applied first, and its rows by slot (None: every row is the base model's).

        The LM head runs on at most ``LOGIT_SLICE_ROWS`` rows at a time. With ``consume``,
        rank 0 hands each slice to ``consume(first_row, logits)`` instead and returns None.
        """
        inputs = inputs.to(self.device)
        if inputs.copy_ops.numel():
            src, dst = inputs.copy_ops[:, 0], inputs.copy_ops[:, 1]
            for cache in (_raw(self.k_cache), _raw(self.v_cache)):
                cache[:, dst] = cache[:, src]
        if self.lora_slots is not None:
            self._set_lora(lora)
        graphs = self.graph_runner
        # fp8 scales still to be computed come from the first forward: never a padded one.
        # A step with adapters runs eagerly: the captured graphs hold no LoRA rows.
        if graphs is not None and graphs.accepts(inputs) and not self._kv_scales_pending() and lora is None:
            hidden = graphs.run(inputs)
        else:
            meta = AttentionMetadata(
                slot_mapping=inputs.slot_mapping,
                block_tables=inputs.block_tables,
                seq_lens=inputs.seq_lens,
                query_start_loc=inputs.query_start_loc,
            )
            hidden = self.model(inputs.input_ids, inputs.positions, meta)
        if not inputs.sample_rows.numel():
            return None
        rows = hidden.index_select(0, inputs.sample_rows)
        parts = []
        for first in range(0, rows.shape[0], LOGIT_SLICE_ROWS):
            logits = self.model.compute_logits(rows[first : first + LOGIT_SLICE_ROWS])
            if logits is None:
                continue
            if consume is None:
                parts.append(logits)
            else:
                consume(first, logits)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _set_lora(self, lora: LoRAStep | None) -> None:
        """Write the step's new adapters into their slots and give the layers its rows by slot."""
        assert self.lora_slots is not None
        if lora is None:
            self.lora_slots.set_mapping(None)
            return
        for slot, adapter in lora.writes:
            self.lora_slots.load(slot, adapter)
        mapping = lora.mapping
        self.lora_slots.set_mapping(None if mapping is None else mapping.to(self.device))

    def _kv_scales_pending(self) -> bool:
        return any(layer.self_attn.calculate_kv_scales for layer in self.model.layers)

    def release(self) -> None:
        """Drop the model, the KV cache and the graphs (engine shutdown): on CUDA their
        memory goes back to the device, so another engine in this process can size its cache."""
        self.graph_runner = None
        self.k_cache = self.v_cache = self.k_host = self.v_host = torch.empty(0)
        self.model.bind_kv_cache([torch.empty(0)] * len(self.model.layers), [torch.empty(0)] * len(self.model.layers))
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def swap(self, out_ops: list[tuple[int, int]], in_ops: list[tuple[int, int]]) -> None:
        """Apply a step's swap copies: (device block, host slot) out first, then (host slot, device block) in."""
        pairs = ((self.k_cache, self.k_host), (self.v_cache, self.v_host))
        if self.device.type == "cpu":
            # Block by block: a gathered batch would be a fresh temporary as large as the copy, and
            # on a CPU host fresh pages can cost more than the copy itself.
            for cache, pool in pairs:
                dev_rows, host_rows = _raw(cache), _raw(pool)
                for d, h in out_ops:
                    host_rows[:, h].copy_(dev_rows[:, d])
                for h, d in in_ops:
                    dev_rows[:, d].copy_(host_rows[:, h])
            return
        if out_ops:
            dev = torch.tensor([d for d, _ in out_ops], dtype=torch.long, device=self.device)
            host = torch.tensor([h for _, h in out_ops], dtype=torch.long)
            for cache, pool in pairs:
                _raw(pool)[:, host] = _raw(cache)[:, dev].to("cpu")
        if in_ops:
            host = torch.tensor([h for h, _ in in_ops], dtype=torch.long)
            self._swap_in_cuda(host, [d for _, d in in_ops])

    def _swap_in_cuda(self, host: torch.Tensor, dst: list[int]) -> None:
        """Host -> device copies on a side stream (DMA from pinned rows), ordered after the
        work already queued (a fresh block may be one an earlier step still reads) and
        before the next forward pass; the host thread does not wait for them."""
        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side = self._copy_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dev = torch.tensor(dst, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            for cache, pool in ((self.k_cache, self.k_host), (self.v_cache, self.v_host)):
                rows = _raw(pool)[:, host].pin_memory().to(self.device, non_blocking=True)
                _raw(cache)[:, dev] = rows
                rows.record_stream(main)
            dev.record_stream(main)
        main.wait_stream(side)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as plain bytes when it is fp8 (indexing kernels do not all take float8 types)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache
