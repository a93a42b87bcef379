"""Everything that touches tensors: the model, the paged KV cache, one step's inputs, sampling.

``ModelRunner.execute(plan, specs)`` turns a scheduler plan into one packed forward
pass: token ids and positions of every scheduled sequence concatenated, the slot of
each new token (``block_table[pos // block_size] * block_size + pos % block_size``),
the block tables, context lengths and query offsets; copy-on-write block copies are
applied first. Only the last row of each sequence that samples goes through the LM
head. It returns one sampled token per sampling sequence.

The KV cache is two tensors ``[num_layers, num_blocks, ...]`` (K and V) in the
attention backend's layout (blocks always second); each layer gets views. Nothing
here knows requests beyond the ScheduledSeq records it is handed.

With ``swap_space_gb`` > 0 a host pool of the same layout (``num_host_blocks``
blocks; pinned memory on CUDA so the copies are DMA) holds swapped-out blocks;
``swap(out_ops, in_ops)`` copies device -> host first, then host -> device.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

import torch

from prefixserve.kernels import select_backend
from prefixserve.kernels.layer_ops import select_layer_ops
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.model.layers import TPGroup
from prefixserve.replica.model.llama import AttentionMetadata, LlamaForCausalLM, ModelConfig
from prefixserve.replica.model.startup import StartupTimer
from prefixserve.replica.sampling import SampleResult, SampleSpec, sample
from prefixserve.replica.scheduler import ScheduledSeq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def _threads_pinned() -> bool:
    """True when the user chose the torch thread count (OMP_NUM_THREADS), which we then keep."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available: use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                 *, max_model_len: int, checkpoint_dtype: torch.dtype | None = None,
                 startup: StartupTimer | None = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype)
        self.block_size = config.block_size
        # Tables may hold NULL_BLOCK entries (blocks freed outside the sliding window).
        self.sliding = model_cfg.kv_window is not None
        # The KV cache's element type: the activations' dtype, or fp8 e4m3 (1 byte per element).
        self.kv_cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.max_model_len = max_model_len
        if self.device.type == "cpu" and torch.get_num_threads() < (os.cpu_count() or 1) and not _threads_pinned():
            torch.set_num_threads(os.cpu_count() or 1)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        startup = startup or StartupTimer()
        with startup.phase("kernels"):
            self.backend = select_backend(config.attention_backend, self.device, self.dtype)
            ops = select_layer_ops(self.backend.name)
        with startup.phase("weights"):
            with torch.device(self.device):
                self.model = LlamaForCausalLM(model_cfg, max_model_len=max_model_len, backend=self.backend,
                                              dtype=self.dtype, tp=TPGroup(), ops=ops)
            self.model.load_weights(weights)
            self.model.configure_kv_cache(fp8=self.kv_cache_dtype != self.dtype,
                                          calculate_scales=config.calculate_kv_scales)
            self.model.eval()
            if self.backend.name == "cpu":
                self.model.pack_weights_for_cpu()
        with startup.phase("kv_cache"):
            self.num_blocks = self._num_kv_blocks()
            k_shape, v_shape = self.backend.kv_cache_shape(self.num_blocks, self.block_size,
                                                           model_cfg.num_kv_heads, model_cfg.head_dim)
            self.k_cache = torch.zeros((model_cfg.num_layers, *k_shape), dtype=self.kv_cache_dtype,
                                       device=self.device)
            self.v_cache = torch.zeros((model_cfg.num_layers, *v_shape), dtype=self.kv_cache_dtype,
                                       device=self.device)
            self.num_host_blocks = int(config.swap_space_gb * 1024**3 // self.kv_bytes_per_block)
            if config.swap_space_gb > 0 and self.num_host_blocks < 1:
                raise ValueError(f"swap_space_gb={config.swap_space_gb} holds no KV block of "
                                 f"{self.kv_bytes_per_block} bytes: raise it")
            pin = self.device.type == "cuda"
            self.k_host = torch.zeros((model_cfg.num_layers, self.num_host_blocks, *k_shape[1:]),
                                      dtype=self.kv_cache_dtype, pin_memory=pin)
            self.v_host = torch.zeros((model_cfg.num_layers, self.num_host_blocks, *v_shape[1:]),
                                      dtype=self.kv_cache_dtype, pin_memory=pin)
        self.model.bind_kv_cache(list(self.k_cache.unbind(0)), list(self.v_cache.unbind(0)))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over every layer, K and V (1 byte per element in fp8)."""
        c = self.model_cfg
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            c = self.model_cfg
            elem = torch.empty((), dtype=self.dtype).element_size()
            # Activations of the largest step, generously: a few hidden-sized and MLP-sized rows.
            activations = self.config.max_num_batched_tokens * (8 * c.hidden_size + 4 * c.intermediate_size) * elem
            activations += self.config.max_num_seqs * c.vocab_size * 4 * 2
            budget = total * self.config.gpu_memory_utilization - (total - free) - activations
        else:
            budget = self.config.kv_cache_memory_bytes
        blocks = int(budget // self.kv_bytes_per_block)
        if blocks < 2:
            raise ValueError(f"KV cache too small: {blocks} blocks of {self.kv_bytes_per_block} bytes fit; "
                             "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks")
        return blocks

    # --- one step ------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], copy_ops: list[tuple[int, int]],
                specs: list[tuple[int, SampleSpec]]) -> list[SampleResult]:
        """Run one packed forward pass and sample.

        ``specs`` pairs an index into ``scheduled`` (a sequence that samples) with its
        SampleSpec; several specs may share one row (the children of a fork sample
        the same prompt logits). Returns one result per spec, in order.
        """
        if copy_ops:
            self._copy_blocks(copy_ops)
        input_ids, positions, meta, last_rows = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, meta)
        if not specs:
            return []
        rows = torch.tensor([last_rows[i] for i, _ in specs], dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return sample(logits, [s for _, s in specs], self.generator)

    def _copy_blocks(self, ops: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in ops], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in ops], dtype=torch.long, device=self.device)
        for cache in (_raw(self.k_cache), _raw(self.v_cache)):
            cache[:, dst] = cache[:, src]

    def swap(self, out_ops: list[tuple[int, int]], in_ops: list[tuple[int, int]]) -> None:
        """Apply a step's swap copies: (device block, host slot) out first, then (host slot, device block) in."""
        if out_ops:
            dev = torch.tensor([d for d, _ in out_ops], dtype=torch.long, device=self.device)
            host = torch.tensor([h for _, h in out_ops], dtype=torch.long)
            for cache, pool in ((self.k_cache, self.k_host), (self.v_cache, self.v_host)):
                _raw(pool)[:, host] = _raw(cache)[:, dev].to("cpu")
        if in_ops:
            host = torch.tensor([h for h, _ in in_ops], dtype=torch.long)
            dev = torch.tensor([d for _, d in in_ops], dtype=torch.long, device=self.device)
            for cache, pool in ((self.k_cache, self.k_host), (self.v_cache, self.v_host)):
                rows = _raw(pool)[:, host]
                if self.device.type == "cuda":
                    rows = rows.pin_memory().to(self.device, non_blocking=True)
                _raw(cache)[:, dev] = rows.to(self.device)

    def _prepare(self, scheduled: list[ScheduledSeq]):
        ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        query_start = [0]
        for s in scheduled:
            end = s.start + s.num_new_tokens
            ids.extend(s.seq.token_ids[s.start:end])
            starts.append(s.start)
            q_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(s.block_table)
            query_start.append(query_start[-1] + s.num_new_tokens)
        width = max(len(t) for t in tables)
        table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        if self.sliding:  # blocks freed outside the window (NULL_BLOCK, -1) read as block 0, masked
            table_t.clamp_(min=0)
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens_t)
        offsets = torch.arange(query_start[-1]) - torch.tensor(query_start[:-1]).repeat_interleave(q_lens_t)
        positions = torch.tensor(starts).repeat_interleave(q_lens_t) + offsets
        bs = self.block_size
        slots = table_t[seq_index, positions // bs].long() * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=table_t.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
        )
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        last_rows = [q - 1 for q in query_start[1:]]
        return input_ids, positions.to(dev, non_blocking=True), meta, last_rows


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as plain bytes when it is fp8 (indexing kernels do not all take float8 types)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache
