"""The segmented LoRA matmul (punica's SGMV idea) in torch: one batch, rows of many adapters.

Every row of a step's packed batch carries the slot of its request's adapter (-1: the base
model, no adapter). The rows are grouped by slot once per step (:class:`LoRAMapping`); each
adapted projection then adds, for each slot present, ``(x[rows] A[slot]^T) B[slot]^T`` to
its output rows: one shrink and one expand matmul per adapter in the batch, never a
per-row weight gather, and nothing at all for a batch of base-model rows.

Several projections fused into one linear (q/k/v, gate/up) stack their ranks: ``A`` is
``[slots, n * r, in]`` and ``B`` is ``[slots, out, n * r]`` with slice ``i``'s output rows
reading only slice ``i``'s ranks (zeros elsewhere), so one shrink and one expand cover the
fused layer. Ranks below the slot's width are zero-padded: the padding adds exact zeros.

This is the torch implementation (CPUs, and the oracle); ``kernels/triton/lora.py`` is the
GPU one, reading each row's slot from ``LoRAMapping.token_slots``. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """A step's rows grouped by adapter slot: ``groups`` = ``(slot, row indices)``, slots >= 0 only;
    ``token_slots`` each row's slot (-1: none).

    ``full`` names the slot when every row of the batch uses it (no gather needed)."""

    groups: tuple[tuple[int, torch.Tensor], ...]
    token_slots: torch.Tensor
    full: int | None = None

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAMapping | None:
        """From each row's slot (``[T]`` int64, -1 = none); None when no row has an adapter."""
        present = [int(s) for s in torch.unique(token_slots).tolist() if s >= 0]
        if not present:
            return None
        if len(present) == 1 and bool((token_slots == present[0]).all()):
            rows = torch.arange(token_slots.numel(), device=token_slots.device)
            return cls(((present[0], rows),), token_slots, present[0])
        groups = tuple((s, torch.nonzero(token_slots == s).flatten()) for s in present)
        return cls(groups, token_slots)

    def to(self, device: torch.device) -> LoRAMapping:
        groups = tuple((s, rows.to(device)) for s, rows in self.groups)
        return LoRAMapping(groups, self.token_slots.to(device), self.full)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``y[rows] += (x[rows] a[slot]^T) b[slot]^T`` for each ``(slot, rows)`` of ``mapping``; returns ``y``.

    ``x`` ``[T, in]``, ``y`` ``[T, out]``, ``a`` ``[slots, R, in]``, ``b`` ``[slots, out, R]``."""
    if mapping.full is not None:
        s = mapping.full
        return y.add_((x @ a[s].T) @ b[s].T)
    for s, rows in mapping.groups:
        y.index_add_(0, rows, (x.index_select(0, rows) @ a[s].T) @ b[s].T)
    return y


def add_lora_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """The oracle: row by row, each row's own adapter (slot -1: none). Returns a new tensor."""
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += (x[t] @ a[s].T) @ b[s].T
    return out
