"""Decode steps through static input buffers, replayed as CUDA graphs.

A decode step (every scheduled sequence adds exactly one token) runs the same kernels
every time; only the batch size and the values change. :class:`DecodeGraphRunner`
keeps one set of static buffers (token ids, positions, slot mapping, block tables,
context lengths, query offsets) sized for the largest batch of its ladder, pads each
step's batch to the next size of the ladder, fills the buffers in place and runs the
model on views of them. On CUDA the forward of each size is captured once at start-up
(one CUDA graph per size, sharing one memory pool) and a step is one replay: no
per-layer launches from Python. Elsewhere (``capture=False``, the CPU) the very same
path runs eagerly, so the bucketing, the padding and the refills are tested without a GPU.

Padding rows never reach the KV cache or the sampler: their slot is -1 (every
cache-write kernel skips negative slots), their block table row is block 0 with a
context of one token (a valid read whose result is dropped), and the caller takes
only the first ``num_seqs`` hidden rows.

Mixed prefill/decode steps, batches beyond the ladder and block tables wider than the
buffers run eagerly (:meth:`DecodeGraphRunner.accepts`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixserve.replica.model.llama import AttentionMetadata
from prefixserve.replica.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)
PAD_SLOT = -1


def graph_batch_sizes(max_num_seqs: int, override: list[int] | None = None) -> tuple[int, ...]:
    """The captured batch sizes: ``override`` if given, else vLLM's ladder 1, 2, 4, 8, 16,
    32, then every 32, up to the first size that holds ``max_num_seqs``."""
    if override:
        if any(s < 1 for s in override):
            raise ValueError(f"cuda_graph_sizes must be positive, got {override}")
        return tuple(sorted(set(override)))
    sizes: list[int] = []
    for size in (1, 2, 4, 8, 16, 32):
        sizes.append(size)
        if size >= max_num_seqs:
            return tuple(sizes)
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 32)
    return tuple(sizes)


@dataclass
class _Buffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class DecodeGraphRunner:
    """Decode forwards through static buffers (captured as CUDA graphs when ``capture``).

    ``forward(input_ids, positions, meta)`` is the model's forward; ``max_blocks`` the
    block-table width the buffers hold (``ceil(max_model_len / block_size)``).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        sizes: tuple[int, ...],
        max_blocks: int,
        device: torch.device,
        *,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device: use capture=False elsewhere")
        self.forward = forward
        self.sizes = sizes
        self.max_size = max(sizes)
        self.max_blocks = max_blocks
        self.device = device
        self.capture = capture
        n = self.max_size
        with torch.device(device):
            self.buffers = _Buffers(
                input_ids=torch.zeros(n, dtype=torch.long),
                positions=torch.zeros(n, dtype=torch.long),
                slot_mapping=torch.full((n,), PAD_SLOT, dtype=torch.long),
                block_tables=torch.zeros((n, max_blocks), dtype=torch.int32),
                seq_lens=torch.ones(n, dtype=torch.int32),
                query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.num_eager_static_runs = 0

    def accepts(self, inputs: StepInputs) -> bool:
        """Whether this step can take the static path: decode only, within the ladder and buffers."""
        num_seqs = inputs.seq_lens.numel()
        return (
            inputs.input_ids.numel() == num_seqs
            and 0 < num_seqs <= self.max_size
            and inputs.block_tables.shape[1] <= self.max_blocks
        )

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per ladder size, largest first (so smaller ones reuse its pool)."""
        if not self.capture:
            return
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for size in sorted(self.sizes, reverse=True):
            for _ in range(2):  # warm-up: kernel compilation and allocator state outside the graph
                self._run_views(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run_views(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info(
            "captured %d CUDA graphs (batch %s) in %.2f s using %.1f MiB",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            time.perf_counter() - start,
            used / 2**20,
        )

    def _run_views(self, size: int) -> torch.Tensor:
        b = self.buffers
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:size],
            block_tables=b.block_tables[:size],
            seq_lens=b.seq_lens[:size],
            query_start_loc=b.query_start_loc[: size + 1],
        )
        return self.forward(b.input_ids[:size], b.positions[:size], meta)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[num_seqs, hidden]`` of a decode step (see :meth:`accepts`)."""
        num_seqs = inputs.seq_lens.numel()
        size = self.padded_size(num_seqs)
        self._fill(inputs, num_seqs, size)
        if self.capture:
            graph, out = self.graphs[size]
            graph.replay()
            self.num_replays += 1
            return out[:num_seqs]
        self.num_eager_static_runs += 1
        return self._run_views(size)[:num_seqs]

    def _fill(self, inputs: StepInputs, n: int, size: int) -> None:
        """Copy the step into the buffers' first ``n`` rows; rows ``n:size`` become padding."""
        b = self.buffers
        width = inputs.block_tables.shape[1]
        b.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        b.positions[:n].copy_(inputs.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        # Columns past ``width`` may hold an earlier step's blocks: never read, since attention
        # stops at each row's context length.
        b.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        b.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        if size > n:
            b.input_ids[n:size].zero_()
            b.positions[n:size].zero_()
            b.slot_mapping[n:size].fill_(PAD_SLOT)
            b.block_tables[n:size].zero_()
            b.seq_lens[n:size].fill_(1)
        # query_start_loc stays arange(max_size + 1): one token per row, padding included.
