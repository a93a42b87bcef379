"""What one schedule decides: the sequences a step runs, and the block copies it needs first.

The scheduler (replica/core/scheduler.py) builds a :class:`SchedulerOutput` per step; the worker side
(step inputs, the model runner) reads it and imports these types, never the scheduler. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.replica.core.request import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step: first position computed now
    num_new_tokens: int
    block_table: list[int]  # the sequence's whole block table after this step's allocation

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last known token (so it has logits to sample).

        A placeholder counts as known (asynchronous scheduling); read it before the step's own
        placeholders are added.
        """
        return self.start + self.num_new_tokens == self.seq.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Waiting sequences that can never be admitted, removed from the queue (status FINISHED).
    rejected: list[Sequence] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to apply before the forward pass.
    copy_ops: list[tuple[int, int]] = field(default_factory=list)
    # Swap copies: (device block, host slot) out, applied first (before anything reuses the
    # blocks), then (host slot, device block) in, before the forward pass.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def changed_state(self) -> bool:
        """Whether this plan did anything (scheduled, preempted or rejected): if not, the
        next schedule is the same until a request arrives or leaves."""
        return bool(self.scheduled or self.preempted or self.rejected)
