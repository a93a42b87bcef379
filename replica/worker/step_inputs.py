"""One step's model inputs, built once by the driver and sent whole to tensor-parallel workers.

:func:`build_step_inputs` turns a scheduler plan (``ScheduledSeq`` records, copy-on-write
copies, the rows that sample) into the tensors a forward pass reads: token ids and
positions of every scheduled sequence concatenated, the cache slot of each new token
(``block_table[pos // block_size] * block_size + pos % block_size``), the block tables,
context lengths and query offsets. Everything is int64/int32 on the CPU; each rank moves
it to its device.

:meth:`StepInputs.pack` lays every field out in one flat int64 buffer behind a small
header of sizes, and :func:`unpack_step_inputs` views it back without copying field by
field: a step reaches each worker as one message, not as pickled tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixserve.replica.core.sched_output import ScheduledSeq

# Header: number of tokens, sequences, block-table width, sampled rows, block copies.
_HEADER = 5


@dataclass
class StepInputs:
    """The tensors of one packed forward pass (CPU unless moved with :meth:`to`)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32, context length incl. the new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    sample_rows: torch.Tensor  # [R] int64, rows of the packed batch that go through the LM head
    copy_ops: torch.Tensor  # [C, 2] int64, (source block, destination block) copied before the pass

    def pack(self) -> torch.Tensor:
        """Every field in one flat int64 tensor: a header of sizes, then the fields in order."""
        t, (s, w), r, c = self.input_ids.numel(), self.block_tables.shape, self.sample_rows.numel(), len(self.copy_ops)
        header = torch.tensor([t, s, w, r, c], dtype=torch.int64)
        return torch.cat(
            [
                header,
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.block_tables.reshape(-1).long(),
                self.seq_lens.long(),
                self.query_start_loc.long(),
                self.sample_rows,
                self.copy_ops.reshape(-1),
            ]
        )

    def to(self, device: torch.device) -> StepInputs:
        """On ``device`` with one host-to-device copy: the packed buffer, viewed back there."""
        if device.type == "cpu":
            return self
        packed = self.pack()
        if device.type == "cuda":
            packed = packed.pin_memory()
        return unpack_step_inputs(packed.to(device, non_blocking=True), header=packed[:_HEADER].tolist())


def unpack_step_inputs(buffer: torch.Tensor, header: list[int] | None = None) -> StepInputs:
    """The inverse of :meth:`StepInputs.pack`; ``header``: the sizes when already known on
    the host (``buffer`` on a device is then never read back)."""
    t, s, w, r, c = header if header is not None else (int(x) for x in buffer[:_HEADER])
    sizes = [t, t, t, s * w, s, s + 1, r, 2 * c]
    if sum(sizes) != buffer.numel() - _HEADER:
        raise ValueError(f"step message of {buffer.numel()} int64 does not match its header {t, s, w, r, c}")
    fields = list(buffer[_HEADER:].split(sizes))
    return StepInputs(
        input_ids=fields[0],
        positions=fields[1],
        slot_mapping=fields[2],
        block_tables=fields[3].view(s, w).int(),
        seq_lens=fields[4].int(),
        query_start_loc=fields[5].int(),
        sample_rows=fields[6],
        copy_ops=fields[7].view(c, 2),
    )


def build_step_inputs(
    scheduled: list[ScheduledSeq],
    copy_ops: list[tuple[int, int]],
    sample_rows: list[int],
    block_size: int,
    *,
    sliding: bool,
    logit_spans: Sequence[tuple[int, int, int]] = (),
    placeholders: Sequence[int] = (),
) -> StepInputs:
    """The inputs of one step. ``sample_rows`` index ``scheduled``: the last token of each
    listed sequence goes through the LM head (a row may repeat: forked children sample
    their parent's prompt logits). ``logit_spans`` (scheduled index, first new token, count)
    add those tokens' rows after the sampled ones (prompt_logprobs). ``sliding``: tables may
    hold freed blocks (NULL_BLOCK, -1), read as block 0 and masked by the window.
    ``placeholders`` index ``scheduled``: sequences whose one new token is a placeholder
    (``Sequence.num_placeholders``; asynchronous scheduling), id 0 here, which the step
    pipeline overwrites with the previous step's sampled token before the forward."""
    held = set(placeholders)
    ids: list[int] = []
    starts: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    query_start = [0]
    for i, s in enumerate(scheduled):
        end = s.start + s.num_new_tokens
        ids.extend([0] if i in held else s.seq.token_ids[s.start : end])
        starts.append(s.start)
        q_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        tables.append(s.block_table)
        query_start.append(query_start[-1] + s.num_new_tokens)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    if sliding:
        table_t.clamp_(min=0)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens_t)
    offsets = torch.arange(query_start[-1]) - torch.tensor(query_start[:-1]).repeat_interleave(q_lens_t)
    positions = torch.tensor(starts).repeat_interleave(q_lens_t) + offsets
    slots = table_t[seq_index, positions // block_size].long() * block_size + positions % block_size
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_tables=table_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        sample_rows=torch.tensor(
            [query_start[i + 1] - 1 for i in sample_rows]
            + [
                r
                for i, first, count in logit_spans
                for r in range(query_start[i] + first, query_start[i] + first + count)
            ],
            dtype=torch.long,
        ),
        copy_ops=torch.tensor(copy_ops, dtype=torch.long).reshape(-1, 2),
    )
