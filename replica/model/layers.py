"""Tensor-parallel-shardable layers: linears, vocab embedding, LM head, RMSNorm.

Every layer is built for a ``TPGroup`` (rank, size). It allocates only its own shard
and each parameter carries a ``weight_loader(param, full_checkpoint_tensor, shard_id)``
that cuts that shard out of the full checkpoint tensor, so the model code is the same
for every TP size and the checkpoint-name fusion (q/k/v -> qkv, gate/up -> gate_up)
is a table in the model, not logic in the loader.

Column-parallel layers split output features (no communication); row-parallel layers
split input features and all-reduce their output; the embedding splits vocabulary rows
and the LM head gathers its logits on rank 0 (the only rank that samples). With
``size == 1`` every collective is skipped. KV heads fewer than ranks are replicated
(vLLM's rule): rank ``r`` of ``N`` holds KV head ``r * num_kv_heads // N``, the one its
query heads attend with.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.kernels.cpu.linear import (
    SMALL_GEMM_MAX_ROWS,
    c_small_linear,
    c_small_linear_silu_and_mul,
    small_gemm_fits,
)
from prefixserve.kernels.interface import LayerOps
from prefixserve.kernels.reference_layer_ops import TORCH_LAYER_OPS


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside group of size {self.size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that samples (and the only one that gets logits)."""
        return self.rank == 0

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """``(count, first)``: the KV heads this rank holds.

        ``total >= size``: an even split. ``total < size``: one head per rank, each head
        replicated on ``size // total`` consecutive ranks, so that every rank holds the KV
        head its own query heads (``num_heads / size`` consecutive ones) attend with.
        """
        if total >= self.size:
            count = self.shard(total, "num_key_value_heads")
            return count, self.rank * count
        if self.size % total:
            raise ValueError(
                f"num_key_value_heads={total} neither divides nor is a multiple of "
                f"tensor_parallel_size={self.size}: KV heads cannot be sharded or replicated evenly"
            )
        return 1, self.rank * total // self.size

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``op``: "sum" or "max") over the group; a no-op for one rank."""
        if self.size > 1:
            reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(x, op=reduce_op)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` concatenated along the last dim; other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        torch.distributed.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None


class LinearDelta(Protocol):
    """What a linear adds to its own output, per row (LoRA adapters, replica/lora/slots.py)."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def mkl_packing_available() -> bool:
    """Whether float32 linears can use MKL's packed-weight GEMM here (CPU torch built with MKL)."""
    return bool(torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available())


class _PackableLinear(nn.Module):
    """A linear layer whose weight can be prepared once for the CPU's GEMMs.

    On CPU (the C kernel backend, float32), :meth:`pack_for_cpu` readies two paths, each taken
    where it was measured faster (docs/benchmarks/layers.md): up to
    ``SMALL_GEMM_MAX_ROWS`` rows (decode batches), the C kernel of kernels/cpu/small_gemm.c
    streams the weight as stored; above, ``cblas_sgemm_compute`` on a pre-packed weight skips
    re-packing it on every call (1.3-1.6x faster than unpacked at decode sizes, equal at
    prefill sizes, identical results at batch >= 64). The packed copy doubles the layer's
    weight memory.
    """

    packed_weight: torch.Tensor | None = None
    small_rows: bool = False  # up to SMALL_GEMM_MAX_ROWS rows on the C kernel
    # Adapter slots of the column- and row-parallel projections (None: no LoRA, no cost).
    lora: LinearDelta | None = None

    def pack_for_cpu(self) -> None:
        """Ready the CPU paths; called once the weights are loaded, with the C kernels loadable."""
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and mkl_packing_available():
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), 64)
        self.small_rows = small_gemm_fits(w)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            if self.small_rows and 0 < x.shape[0] <= SMALL_GEMM_MAX_ROWS:
                return c_small_linear(x, self.weight, bias)
            if self.packed_weight is not None:
                return torch.ops.mkl._mkl_linear(x, self.packed_weight, self.weight, bias, x.shape[0])
        return F.linear(x, self.weight, bias)


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a replicated (unsharded) tensor whole."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


@dataclass(frozen=True)
class OutputSegment:
    """One checkpoint tensor fused into a column-parallel layer: this rank holds rows
    ``[start, start + rows)`` of its ``full_rows``."""

    full_rows: int
    rows: int
    start: int

    @classmethod
    def even(cls, full_rows: int, tp: TPGroup) -> OutputSegment:
        rows = tp.shard(full_rows, "output features")
        return cls(full_rows, rows, tp.rank * rows)


class ColumnParallelLinear(_PackableLinear):
    """``y = x W^T + b`` with W's output rows split over ranks; output stays sharded.

    ``out_sizes`` are the fused checkpoint tensors' output sizes, each split evenly, or
    explicit ``OutputSegment``s (the QKV projection's replicated KV heads)."""

    def __init__(
        self, in_features: int, out_sizes: list[int] | list[OutputSegment], bias: bool, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.segments = [s if isinstance(s, OutputSegment) else OutputSegment.even(s, tp) for s in out_sizes]
        self.shard_offsets = [sum(seg.rows for seg in self.segments[:i]) for i in range(len(self.segments))]
        out = sum(seg.rows for seg in self.segments)
        self.weight = _param((out, in_features), dtype, self._load)
        self.bias = _param((out,), dtype, self._load) if bias else None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        index = 0 if shard_id is None else shard_id
        seg, offset = self.segments[index], self.shard_offsets[index]
        if loaded.shape[0] != seg.full_rows:
            raise ValueError(f"checkpoint tensor has {loaded.shape[0]} output rows, expected {seg.full_rows}")
        param.data.narrow(0, offset, seg.rows).copy_(loaded.narrow(0, seg.start, seg.rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate/up of the MLP); shard id ``i`` is the ``i``-th projection."""

    def silu_and_mul_small(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a two-projection layer in one pass of the C decode GEMM
        (kernels/cpu/small_gemm.c), equal bit for bit to the C layer ops' ``silu_and_mul`` of
        :meth:`forward`; None where that pass does not apply (more than ``SMALL_GEMM_MAX_ROWS``
        rows, an adapter on the layer, weights not ready for it)."""
        if (
            self.small_rows
            and self.lora is None
            and len(self.segments) == 2
            and x.dim() == 2
            and 0 < x.shape[0] <= SMALL_GEMM_MAX_ROWS
        ):
            return c_small_linear_silu_and_mul(x, self.weight, self.bias)
        return None


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard ids ``"q"``, ``"k"``, ``"v"``; query heads split over
    ranks, KV heads split or replicated (``TPGroup.kv_heads``)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        q_heads = tp.shard(num_heads, "num_attention_heads")
        kv_count, kv_first = tp.kv_heads(num_kv_heads)
        kv = OutputSegment(num_kv_heads * head_dim, kv_count * head_dim, kv_first * head_dim)
        q = OutputSegment(num_heads * head_dim, q_heads * head_dim, tp.rank * q_heads * head_dim)
        super().__init__(hidden, [q, kv, kv], bias, tp, dtype)

    def _load(self, param, loaded, shard_id=None) -> None:
        super()._load(param, loaded, self.SHARDS[shard_id])


class RowParallelLinear(_PackableLinear):
    """``y = x W^T + b`` with W's input columns split over ranks; the partial sums are
    all-reduced and the bias added once after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.in_shard = tp.shard(in_features, "input features")
        self.weight = _param((out_features, self.in_shard), dtype, self._load_weight)
        self.bias = _param((out_features,), dtype, default_weight_loader) if bias else None

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, None)
        if self.lora is not None:  # one rank only: LoRA is refused under tensor parallelism (EngineConfig)
            y = self.lora.apply(x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split over ranks (masked lookup + all-reduce)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)  # ceil: the last shard is padded
        self.start = tp.rank * self.rows
        self.weight = _param((self.rows, hidden), dtype, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint vocabulary has {loaded.shape[0]} rows, config says {self.vocab_size}")
        part = loaded[self.start : self.start + self.rows]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, _PackableLinear):
    """Output projection to vocabulary logits; rows split like the embedding, logits
    gathered on rank 0 (None on the other ranks)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self.tp.gather_last_dim(self._linear(hidden, None))
        return None if logits is None else logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """Root-mean-square norm (float32 math, like the reference implementation), with the
    residual add fused in when a residual is given (see kernels/interface.py)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, ops: LayerOps = TORCH_LAYER_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = _param((hidden,), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
