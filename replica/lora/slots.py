"""The adapters resident in the model's projections: ``max_loras`` slots per adapted linear.

:class:`LoRASlots` attaches a :class:`LoRALinear` to every projection an adapter may target
(the fused q/k/v and gate/up linears, o and down) of a built ``LlamaForCausalLM``; each
holds zeroed ``A``/``B`` buffers of ``max_loras`` slots at ``max_lora_rank`` (see kernels/reference_lora.py for
the layout). :meth:`LoRASlots.load` writes an adapter into a slot (every projection it does
not adapt stays zero there); :meth:`LoRASlots.set_mapping` gives every layer the step's
rows grouped by slot. One mapping object is shared by all layers, set once per step.

Under tensor parallelism each rank's slots hold its shard of every adapter, cut as the
projection's own weight is: a column-parallel linear (q/k/v, gate/up) keeps A whole and the
rows of B its output rows are; a row-parallel one (o, down) keeps the columns of A its input
columns are and B whole, so its delta is a partial sum that the projection's all-reduce adds
up with the base's (``x A^T B^T`` is linear in ``x``'s shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prefixserve.kernels.reference_lora import LoRAMapping, add_lora
from prefixserve.replica.lora.adapter import LoRAAdapter
from prefixserve.replica.model.layers import ColumnParallelLinear, RowParallelLinear
from prefixserve.replica.model.llama import LlamaForCausalLM

# PEFT module -> (the model's linear, as a path from a decoder layer; the slice it fills).
MODULE_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


# The segmented matmul: y, x, A, B, the step's mapping -> y (updated in place).
LoRAOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRAMapping], torch.Tensor]


def _torch_op(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: LoRAMapping) -> torch.Tensor:
    return add_lora(y, x, a, b, m)


def segmented_op(triton: bool) -> LoRAOp:
    """The Triton kernels with the Triton backend (CUDA, or the interpreter in tests: one launch
    pair per projection, whatever the adapters), torch otherwise."""
    if not triton:
        return _torch_op
    from prefixserve.kernels.triton.lora import triton_add_lora

    def triton_op(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: LoRAMapping) -> torch.Tensor:
        return triton_add_lora(y, x.contiguous(), a, b, m.token_slots)

    return triton_op


class _Shared:
    """The step's mapping and the op that applies it, read by every layer."""

    mapping: LoRAMapping | None = None
    op: LoRAOp = _torch_op


class LoRALinear:
    """The LoRA slots of one linear: ``out_sizes`` its fused slices' output rows, in order."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        max_loras: int,
        max_rank: int,
        shared: _Shared,
        dtype: torch.dtype,
        device: torch.device,
        *,
        out_starts: list[int] | None = None,
        in_start: int = 0,
    ) -> None:
        """``out_starts``: where this rank's rows of each fused slice start in the slice's full
        output (a column-parallel shard; 0s: every row); ``in_start``: where its input columns
        start (a row-parallel shard's)."""
        n = len(out_sizes)
        self.rank = max_rank
        self.in_features = in_features
        self.in_start = in_start
        self.out_starts = out_starts if out_starts is not None else [0] * n
        self.out_offsets = [sum(out_sizes[:i]) for i in range(n)]
        self.out_sizes = out_sizes
        self.a = torch.zeros((max_loras, n * max_rank, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((max_loras, sum(out_sizes), n * max_rank), dtype=dtype, device=device)
        self.shared = shared

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice ``index``'s A ``[r, in]`` and B ``[out_i, r]`` (whole: this rank keeps its shard)
        into ``slot`` (r <= max rank)."""
        r, first, out, rows = a.shape[0], index * self.rank, self.out_offsets[index], self.out_sizes[index]
        a = a.narrow(1, self.in_start, self.in_features)
        b = b.narrow(0, self.out_starts[index], rows)
        self.a[slot, first : first + r].copy_(a)
        self.b[slot, out : out + rows, first : first + r].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each row's adapter delta."""
        mapping = self.shared.mapping
        return y if mapping is None else self.shared.op(y, x, self.a, self.b, mapping)


class LoRASlots:
    """``max_loras`` adapter slots in every adaptable projection of ``model``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        triton: bool = False,
    ) -> None:
        """``triton``: apply the adapters with the Triton kernels (the Triton attention backend's model)."""
        self.max_loras = max_loras
        self.shared = _Shared()
        self.shared.op = segmented_op(triton)
        self.layers: list[dict[str, LoRALinear]] = []
        decoder_layers: list[Any] = list(model.layers)
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            built = {}
            for path, module in (
                ("self_attn.qkv_proj", attn.qkv_proj),
                ("self_attn.o_proj", attn.o_proj),
                ("mlp.gate_up_proj", mlp.gate_up_proj),
                ("mlp.down_proj", mlp.down_proj),
            ):
                lora = _lora_linear(module, max_loras, max_rank, self.shared, dtype, device)
                module.lora = lora
                built[path] = lora
            self.layers.append(built)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer (zeros where it adapts nothing)."""
        for layer in self.layers:
            for lora in layer.values():
                lora.clear(slot)
        for (i, module), (a, b) in adapter.weights.items():
            path, index = MODULE_SLICES[module]
            self.layers[i][path].write(slot, index, a, b)

    def set_mapping(self, mapping: LoRAMapping | None) -> None:
        self.shared.mapping = mapping


def _lora_linear(
    module: Any, max_loras: int, max_rank: int, shared: _Shared, dtype: torch.dtype, device: torch.device
) -> LoRALinear:
    """The slots of one projection, cut to this rank's shard of it (the module docstring)."""
    if isinstance(module, ColumnParallelLinear):
        segments = module.segments
        return LoRALinear(
            module.weight.shape[1],
            [seg.rows for seg in segments],
            max_loras,
            max_rank,
            shared,
            dtype,
            device,
            out_starts=[seg.start for seg in segments],
        )
    assert isinstance(module, RowParallelLinear)
    in_shard = module.in_shard
    return LoRALinear(
        in_shard,
        [module.weight.shape[0]],
        max_loras,
        max_rank,
        shared,
        dtype,
        device,
        in_start=module.tp.rank * in_shard,
    )
