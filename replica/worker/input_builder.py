"""One step's packed inputs built with numpy: a handful of array operations per step, no
per-token Python work and no torch operator per field.

Same contract and the same tensors, bit for bit, as
:func:`prefixserve.replica.worker.step_inputs.build_step_inputs` (the torch reference,
kept as the oracle of the tests). numpy runs these small operations on the calling
thread: torch's ``repeat_interleave`` and friends enter the intra-op thread pool, whose
wake-up dominates on tensors this small (and more so on a busy host). Block tables are
flattened in one pass over the sequences' lists and scattered into the padded table with
a mask; a pure decode step (one new token per sequence) skips the repeats altogether.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.worker.step_inputs import StepInputs


def build_step_inputs(
    scheduled: list[ScheduledSeq],
    copy_ops: list[tuple[int, int]],
    sample_rows: list[int],
    block_size: int,
    *,
    sliding: bool,
    logit_spans: Sequence[tuple[int, int, int]] = (),
) -> StepInputs:
    """The inputs of one step (see ``step_inputs.build_step_inputs`` for the arguments)."""
    n = len(scheduled)
    starts = np.fromiter((s.start for s in scheduled), np.int64, n)
    q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
    query_start = np.zeros(n + 1, np.int64)
    np.cumsum(q_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    decode = bool((q_lens == 1).all())  # every sequence schedules exactly one token
    if decode:
        ids = np.fromiter((s.seq.token_ids[s.start] for s in scheduled), np.int64, n)
    else:
        ids = np.fromiter(
            chain.from_iterable(s.seq.token_ids[s.start : s.start + s.num_new_tokens] for s in scheduled),
            np.int64,
            num_tokens,
        )
    tables = [s.block_table for s in scheduled]
    lens = np.fromiter((len(t) for t in tables), np.int64, n)
    width = int(lens.max())
    table = np.zeros((n, width), np.int32)
    table[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int32, int(lens.sum()))
    if sliding:
        np.maximum(table, 0, out=table)
    if decode:
        seq_index = np.arange(n)
        positions = starts
    else:
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
