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

Small batches (decode steps, up to ``BATCHED_MAX_ROWS`` rows) take the same sums in batched
form: the rows gathered into one ``[adapters, G, in]`` block (``G`` the largest group, shorter
groups padded with rows of zeros), then one batched shrink and one batched expand over the
adapters present and one scatter back: five calls per projection whatever the number of
adapters, where the grouped order pays a gather, two matmuls and a scatter per adapter. Padded
rows add exact zeros (to row 0).

This is the torch implementation (CPUs, and the oracle); ``kernels/triton/lora.py`` is the
GPU one, reading each row's slot from ``LoRAMapping.token_slots``. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows up to which ``add_lora`` takes the batched order (LoRAMapping.batched): its padding costs
# little while every group is small.
BATCHED_MAX_ROWS = 64


@dataclass(frozen=True)
class BatchedRows:
    """The rows of a small batch laid out for batched matmuls: ``slots`` ``[P]`` the adapters
    present, ``rows`` ``[P * G]`` each group's rows padded to ``G`` with row 0, ``valid`` ``[P * G, 1]``
    False on the padding, None when every group is ``G`` rows (nothing to zero); ``leading``: the slots
    are ``0 .. P-1`` (the buffers' first P, no gather)."""

    slots: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor | None
    group: int
    leading: bool

    def to(self, device: torch.device) -> BatchedRows:
        valid = self.valid.to(device) if self.valid is not None else None
        return BatchedRows(self.slots.to(device), self.rows.to(device), valid, self.group, self.leading)


@dataclass(frozen=True)
class LoRAMapping:
    """A step's rows grouped by adapter slot: ``groups`` = ``(slot, row indices)``, slots >= 0 only;
    ``token_slots`` each row's slot (-1: none).

    ``full`` names the slot when every row of the batch uses it (no gather needed)."""

    groups: tuple[tuple[int, torch.Tensor], ...]
    token_slots: torch.Tensor
    full: int | None = None
    # A batch of at most BATCHED_MAX_ROWS rows and several adapters, laid out for the batched order.
    batched: BatchedRows | None = None

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
        batched = None
        if token_slots.numel() <= BATCHED_MAX_ROWS:
            group = max(rows.numel() for _, rows in groups)
            padded = torch.zeros((len(groups), group), dtype=torch.long)
            valid = torch.zeros((len(groups), group), dtype=torch.bool)
            for i, (_, rows) in enumerate(groups):
                padded[i, : rows.numel()] = rows.cpu()
                valid[i, : rows.numel()] = True
            batched = BatchedRows(
                torch.tensor(present),
                padded.flatten().to(token_slots.device),
                None if bool(valid.all()) else valid.reshape(-1, 1).to(token_slots.device),
                group,
                present == list(range(len(present))),
            )
        return cls(groups, token_slots, batched=batched)

    def to(self, device: torch.device) -> LoRAMapping:
        groups = tuple((s, rows.to(device)) for s, rows in self.groups)
        batched = self.batched.to(device) if self.batched is not None else None
        return LoRAMapping(groups, self.token_slots.to(device), self.full, batched)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``y[rows] += (x[rows] a[slot]^T) b[slot]^T`` for each ``(slot, rows)`` of ``mapping``; returns ``y``.

    ``x`` ``[T, in]``, ``y`` ``[T, out]``, ``a`` ``[slots, R, in]``, ``b`` ``[slots, out, R]``."""
    if mapping.full is not None:
        s = mapping.full
        return y.add_((x @ a[s].T) @ b[s].T)
    batched = mapping.batched
    if batched is not None:
        p, g = batched.slots.numel(), batched.group
        xs = x.index_select(0, batched.rows)
        if batched.valid is not None:
            xs.masked_fill_(~batched.valid, 0)
        xs = xs.view(p, g, -1)
        a_p = a[:p] if batched.leading else a.index_select(0, batched.slots)
        b_p = b[:p] if batched.leading else b.index_select(0, batched.slots)
        delta = torch.bmm(torch.bmm(xs, a_p.transpose(1, 2)), b_p.transpose(1, 2))
        return y.index_add_(0, batched.rows, delta.view(p * g, -1))
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
