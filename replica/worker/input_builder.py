"""One step's packed inputs built with numpy: a handful of array operations per step, no
per-token Python work and no torch operator per field.

Same contract and the same tensors, bit for bit, as
:func:`prefixserve.replica.worker.step_inputs.build_step_inputs` (the torch reference,
kept as the oracle of the tests). numpy runs these small operations on the calling
thread: torch's ``repeat_interleave`` and friends enter the intra-op thread pool, whose
wake-up dominates on tensors this small (and more so on a busy host). A pure decode step
(one new token per sequence) skips the repeats altogether.

Two ways to get the block tables. :func:`build_step_inputs` flattens every scheduled
sequence's list in one pass and scatters it into a padded table with a mask: stateless,
for one-off builds. :class:`StepInputBuilder` (the model runner's) keeps the tables in a
persistent array, one row per running sequence, and writes a row only from the first entry
that changed since the sequence's last step; the step's table is one gather of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from prefixserve.replica.core.request import SeqStatus
from prefixserve.replica.core.request import Sequence as Seq
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.worker.step_inputs import StepInputs


class _Builder:
    """Builds a step's inputs from the scheduler's plan; a subclass gathers the block tables."""

    def block_tables(self, scheduled: list[ScheduledSeq], sliding: bool) -> np.ndarray:
        """The step's block tables, one row per scheduled sequence, padded with 0 (NULL_BLOCK read as 0)."""
        raise NotImplementedError

    def __call__(
        self,
        scheduled: list[ScheduledSeq],
        copy_ops: list[tuple[int, int]],
        sample_rows: list[int],
        block_size: int,
        *,
        sliding: bool,
        logit_spans: Sequence[tuple[int, int, int]] = (),
        placeholders: Sequence[int] = (),
    ) -> StepInputs:
        """The inputs of one step (see ``step_inputs.build_step_inputs`` for the arguments)."""
        table = self.block_tables(scheduled, sliding)
        n = len(scheduled)
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        query_start = np.zeros(n + 1, np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        decode = bool((q_lens == 1).all())  # every sequence schedules exactly one token
        held = set(placeholders)
        if decode:
            if held:
                ids = np.fromiter(
                    (0 if i in held else s.seq.token_ids[s.start] for i, s in enumerate(scheduled)), np.int64, n
                )
            else:
                ids = np.fromiter((s.seq.token_ids[s.start] for s in scheduled), np.int64, n)
            seq_index = np.arange(n)
            positions = starts
        else:
            ids = np.fromiter(
                chain.from_iterable(
                    (0,) if i in held else s.seq.token_ids[s.start : s.start + s.num_new_tokens]
                    for i, s in enumerate(scheduled)
                ),
                np.int64,
                num_tokens,
            )
            seq_index = np.repeat(np.arange(n), q_lens)
            positions = np.repeat(starts - query_start[:-1], q_lens) + np.arange(num_tokens)
        slots = table[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
        rows = query_start[np.asarray(sample_rows, np.int64) + 1] - 1
        if logit_spans:
            rows = np.concatenate(
                [rows]
                + [np.arange(query_start[i] + first, query_start[i] + first + count) for i, first, count in logit_spans]
            )
        return StepInputs(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(table),
            seq_lens=torch.from_numpy((starts + q_lens).astype(np.int32)),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
            sample_rows=torch.from_numpy(rows.astype(np.int64)),
            copy_ops=torch.from_numpy(np.asarray(copy_ops, np.int64).reshape(-1, 2)),
        )


class _FlatTables(_Builder):
    """Flattens every scheduled sequence's table in one pass and scatters it into a padded
    table with a mask: stateless, for one-off builds."""

    def block_tables(self, scheduled: list[ScheduledSeq], sliding: bool) -> np.ndarray:
        n = len(scheduled)
        tables = [s.block_table for s in scheduled]
        lens = np.fromiter((len(t) for t in tables), np.int64, n)
        width = int(lens.max())
        table = np.zeros((n, width), np.int32)
        table[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int32, int(lens.sum()))
        if sliding:
            np.maximum(table, 0, out=table)
        return table


# The stateless builder: called like step_inputs.build_step_inputs.
build_step_inputs = _FlatTables()


@dataclass(slots=True)
class _Row:
    """What a sequence's row of the persistent table holds."""

    seq: Seq  # the owner (a request id may come back on another Sequence)
    index: int  # row of the table
    version: int  # the owner's num_preemptions when the row was written whole
    length: int  # entries written (the rest of the row is 0)
    last: int  # the entry at length - 1 (copy-on-write replaces it in place)
    skipped: int  # leading entries known to be NULL_BLOCK (sliding window)


class StepInputBuilder(_Builder):
    """Builds each step's inputs like :func:`build_step_inputs` (same arguments, same
    tensors) from a persistent block-table array, [max_num_seqs, max_blocks_per_seq].

    A running sequence owns a row. Between two of its steps its table only changes at the
    end: new blocks appended, the last known block replaced (copy-on-write of a shared
    partial block) and, with a sliding window, leading blocks freed to NULL_BLOCK; so a row
    is rewritten from the first of those entries only, all rows of a step in one scatter.
    Everything that replaces a table whole (preemption by recompute or swap, then
    re-admission with or without a prefix hit) goes through the waiting queue and counts in
    the sequence's ``num_preemptions``: a new count rewrites the row whole. Rows of
    sequences no longer running (finished, aborted, preempted) are released when a new
    sequence needs one and none is free. Either dimension grows when exceeded.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self._table = np.zeros((max(1, max_num_seqs), max(1, max_blocks_per_seq)), np.int32)
        self._free = list(range(len(self._table) - 1, -1, -1))
        self._rows: dict[str, _Row] = {}

    @property
    def table(self) -> np.ndarray:
        """The persistent array (rows of released sequences are 0)."""
        return self._table

    def block_tables(self, scheduled: list[ScheduledSeq], sliding: bool) -> np.ndarray:
        """The step's rows of the persistent array, each brought up to date first."""
        n = len(scheduled)
        rows = self._rows
        index = np.empty(n, np.int64)
        lens = np.empty(n, np.int64)
        # Changed tails: row, first entry, entry count, and the entries (chained at the end).
        seg_rows: list[int] = []
        seg_first: list[int] = []
        seg_count: list[int] = []
        tails: list[list[int]] = []
        for i, s in enumerate(scheduled):
            seq, t = s.seq, s.block_table
            size = len(t)
            r = rows.get(seq.seq_id)
            if r is None or r.seq is not seq or r.version != seq.num_preemptions or size < r.length:
                r = self._assign(seq, r, size)
                first = 0
            else:
                first = r.length
                if first and t[first - 1] != r.last:
                    first -= 1
                if sliding and r.skipped < size and t[r.skipped] < 0:
                    first = min(first, r.skipped)
            if size > self._table.shape[1]:
                self._grow(cols=size)
            if sliding and first <= r.skipped:
                k = r.skipped
                while k < size and t[k] < 0:
                    k += 1
                r.skipped = k
            if first < size:
                seg_rows.append(r.index)
                seg_first.append(first)
                seg_count.append(size - first)
                tails.append(t[first:])
                r.length = size
                r.last = t[-1]
            index[i] = r.index
            lens[i] = size
        if seg_rows:
            self._scatter(seg_rows, seg_first, seg_count, tails, sliding)
        return self._table[index, : int(lens.max())]  # a copy: the step keeps it, the array moves on

    def _scatter(
        self, seg_rows: list[int], seg_first: list[int], seg_count: list[int], tails: list[list[int]], sliding: bool
    ) -> None:
        counts = np.asarray(seg_count, np.int64)
        total = int(counts.sum())
        offsets = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=offsets[1:])
        row_of = np.repeat(np.asarray(seg_rows, np.int64), counts)
        col_of = np.repeat(np.asarray(seg_first, np.int64) - offsets, counts) + np.arange(total)
        values = np.fromiter(chain.from_iterable(tails), np.int32, total)
        if sliding:
            np.maximum(values, 0, out=values)
        self._table[row_of, col_of] = values

    def _assign(self, seq: Seq, old: _Row | None, size: int) -> _Row:
        """A zeroed row for ``seq`` (its old one when it had one)."""
        if old is not None:
            self._table[old.index, : old.length] = 0
            index = old.index
        else:
            if not self._free:
                self._release_idle()
            if not self._free:
                self._grow(rows=2 * len(self._table))
            index = self._free.pop()
        r = _Row(seq, index, seq.num_preemptions, 0, 0, 0)
        self._rows[seq.seq_id] = r
        return r

    def _release_idle(self) -> None:
        """Free the rows of sequences that no longer run."""
        for seq_id, r in list(self._rows.items()):
            if r.seq.status is not SeqStatus.RUNNING:
                del self._rows[seq_id]
                self._table[r.index, : r.length] = 0
                self._free.append(r.index)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old = self._table
        shape = (max(rows, len(old)), max(cols, 2 * old.shape[1] if cols else old.shape[1]))
        self._table = np.zeros(shape, np.int32)
        self._table[: len(old), : old.shape[1]] = old
        self._free[:0] = range(shape[0] - 1, len(old) - 1, -1)
