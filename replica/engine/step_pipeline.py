"""Asynchronous scheduling's step pipeline (EngineConfig.async_scheduling): depth 2.

While step N's forward pass and sampling run here, on the pipeline's one device thread,
the engine thread schedules step N+1 and builds its inputs, then processes step N-1's
outputs (tokens appended, detokenization, stop checks, stream deltas). A sequence that
step N samples has a placeholder for its next token (``Sequence.num_placeholders``):
step N+1 computes that token's KV, and its input id is taken from step N's sampled-token
tensor by row index when step N+1 starts on the device thread (``StepInputs.input_ids``
written from the tensor, never through a Python list). The device thread runs steps in
submission order, so step N's tensor is complete when step N+1 reads it.

A sequence that finishes or is aborted while a step in flight holds it (its row there is
discarded, its token never emitted) keeps its KV blocks until that step is done:
``defer`` holds the free until no step in flight schedules the sequence.

What needs step N's tokens on the host before step N+1 is scheduled (forks, grammars,
penalties, bad_words, prompt logprobs, a step that may preempt) is the engine's to route
to its synchronous step, after draining the pipeline (replica/engine/core.py).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from prefixserve.replica.core.request import Sequence
from prefixserve.replica.core.sched_output import ScheduledSeq
from prefixserve.replica.executor.model_runner import ModelRunner, PreparedStep, StepOutput


@dataclass(eq=False)
class InFlightStep:
    """A step submitted to the device thread whose outputs the engine has not processed."""

    future: Future[StepOutput]
    scheduled: list[ScheduledSeq]
    # The sequence of each sampled row (its result and its row of the sampled-token tensor).
    owners: list[Sequence]
    # Prompt tokens the step computes (the step metrics).
    num_prompt_tokens: int
    # Every sequence the step computes tokens for (its blocks are read and written).
    seqs: set[Sequence] = field(default_factory=set)
    row_of: dict[Sequence, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seqs = {s.seq for s in self.scheduled}
        self.row_of = {seq: i for i, seq in enumerate(self.owners)}


class StepPipeline:
    """The steps in flight on the device thread (at most two: one running, one queued behind it)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.in_flight: deque[InFlightStep] = deque()
        self._deferred: list[tuple[Sequence, Callable[[Sequence], None]]] = []
        self._executor: ThreadPoolExecutor | None = None
        # Steps submitted since the engine started (how often the pipeline was used).
        self.num_submitted = 0

    def adopt_executor(self, executor: ThreadPoolExecutor) -> None:
        """Run the steps on ``executor``'s one thread (the one the model was built on), not a new one."""
        if self._executor is not None:
            raise RuntimeError("the device thread is already running")
        self._executor = executor

    @property
    def busy(self) -> bool:
        """Whether a step is in flight (its outputs not processed yet)."""
        return bool(self.in_flight)

    @property
    def last(self) -> InFlightStep | None:
        """The step submitted last, whose sampled tokens the next step's placeholders read."""
        return self.in_flight[-1] if self.in_flight else None

    def submit(
        self,
        scheduled: list[ScheduledSeq],
        owners: list[Sequence],
        prepared: PreparedStep,
        placeholders: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        num_prompt_tokens: int,
    ) -> InFlightStep:
        """Queue a prepared step on the device thread.

        ``placeholders``: (index into ``scheduled``, row of the last submitted step's sampled
        tokens) for each sequence whose one new token is that step's; ``swap_in``: the swap-in
        copies to apply before the forward. Each owner gets a placeholder for its token.
        """
        prev = self.last
        if placeholders and prev is None:
            raise ValueError("placeholders need a step in flight to take their tokens from")
        runner = self.runner
        rows = torch.tensor([i for i, _ in placeholders], dtype=torch.long)
        sources = torch.tensor([r for _, r in placeholders], dtype=torch.long)

        def run() -> StepOutput:
            with torch.inference_mode():
                if swap_in:
                    runner.swap([], swap_in)
                if placeholders:
                    assert prev is not None
                    # Done: the device thread ran it before this one.
                    tokens = prev.future.result().tokens
                    assert tokens is not None
                    ids = prepared.inputs.input_ids
                    at = prepared.inputs.query_start_loc.index_select(0, rows).long()
                    ids.index_copy_(0, at, tokens.index_select(0, sources.to(tokens.device)).to(ids.device))
                return runner.run(prepared)

        if self._executor is None:
            self._executor = device_executor()
        step = InFlightStep(self._executor.submit(run), scheduled, owners, num_prompt_tokens)
        for seq in owners:
            seq.num_placeholders += 1
        self.in_flight.append(step)
        self.num_submitted += 1
        return step

    def wait_oldest(self) -> tuple[InFlightStep, StepOutput]:
        """Wait for the oldest step in flight and take it out of the pipeline: its owners lose
        their placeholder (the caller appends the tokens) and the deferred frees no step in
        flight holds any more run. Raises what the step raised (fatal to the engine)."""
        step = self.in_flight[0]
        try:
            out = step.future.result()
        finally:
            self.in_flight.popleft()
            for seq in step.owners:
                seq.num_placeholders -= 1
        self._release_deferred()
        return step, out

    def holds(self, seq: Sequence) -> bool:
        """Whether a step in flight computes tokens of ``seq`` (its blocks must stay)."""
        return any(seq in step.seqs for step in self.in_flight)

    def defer(self, seq: Sequence, free: Callable[[Sequence], None]) -> None:
        """Call ``free(seq)`` once no step in flight holds ``seq`` (now if none does)."""
        if self.holds(seq):
            self._deferred.append((seq, free))
        else:
            free(seq)

    def _release_deferred(self) -> None:
        if not self._deferred:
            return
        keep = []
        for seq, free in self._deferred:
            if self.holds(seq):
                keep.append((seq, free))
            else:
                free(seq)
        self._deferred = keep

    def reset(self) -> None:
        """Forget every step in flight and deferred free (after a fatal failure: the engine
        rebuilds its state); waits for the device thread to finish what it runs."""
        for step in self.in_flight:
            with contextlib.suppress(BaseException):
                step.future.result()
        self.in_flight.clear()
        self._deferred = []

    def close(self) -> None:
        """``reset``, then stop the device thread (idempotent)."""
        self.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def device_executor() -> ThreadPoolExecutor:
    """The one thread that runs the forward of an engine with async scheduling."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixserve-device")


class _Pipelined(Protocol):
    pipeline: StepPipeline


E = TypeVar("E", bound=_Pipelined)


def build_on_forward_thread(build: Callable[[], E], async_scheduling: bool) -> E:
    """``build()`` (an engine) on the thread that will run its forward: this one, or with async
    scheduling a new device thread that the engine's pipeline then adopts.

    On CPU every parallel region of the model (torch's, MKL's, the C kernels') then starts from
    that one thread, whose OpenMP pool is the process's only one. A model built on another
    thread leaves that thread's pool behind; with more pooled threads than cores libgomp
    throttles its workers' spinning, and every region of the forward waits for a worker to wake:
    the served forward ran 20% slower, and twice as slow with async scheduling
    (docs/benchmarks/layers.md).
    """
    if not async_scheduling:
        return build()
    device = device_executor()
    try:
        engine = device.submit(build).result()
    except BaseException:
        device.shutdown(wait=False)
        raise
    engine.pipeline.adopt_executor(device)
    return engine
