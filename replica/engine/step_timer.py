"""The engine's own step timers: where one ``LLMEngine.step()`` spends its time, by phase.

A step runs its phases in order, and each phase ends with a lap (one ``perf_counter``
call): ``schedule`` (the scheduler's plan), ``prepare`` (swap copies, sampling specs,
the step's packed inputs and block tables), ``forward`` (the model, LM head included),
``sample``, ``detokenize`` (appending the sampled tokens, grammar advances, incremental
detokenization, stop checks, forks) and ``output`` (stream deltas, finished outputs,
step metrics). ``kv_manager`` is the time spent inside the KV manager (prefix lookup,
allocation, free, fork, swaps), measured around each of those calls wherever it
happens (mostly inside ``schedule``) and taken out of the phase it happened in, so the
phases are disjoint and add up to the step's wall time from its start to its last lap.

Nothing here changes what a step does: the timers read the clock and nothing else. On
CUDA the forward is asynchronous and the timers never synchronize, so there the device
time lands in whichever phase first waits for it (``sample``).

:class:`StepTimer` keeps the last step's phases (``last``), for a benchmark reading
them in-process, and observes each phase into ``prefixserve:step_phase_seconds{phase}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from prefixserve.replica.kv.manager import KVCacheManager

PHASES = ("schedule", "kv_manager", "prepare", "forward", "sample", "detokenize", "output")
# A phase takes microseconds (a KV lookup at batch 1) to seconds (a long prefill's forward).
PHASE_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass
class StepPhases:
    """One step's seconds per phase (keys: ``PHASES``) and its wall time, start to last lap."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall: float = 0.0
    # Sequences the step scheduled (0: nothing ran).
    num_seqs: int = 0

    @property
    def host(self) -> float:
        """Everything but the forward."""
        return self.wall - self.seconds["forward"]


class StepTimer:
    """Laps of the step in progress; the finished step's phases in ``last`` and the histogram."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "", engine: str = "0") -> None:
        self.last: StepPhases | None = None
        self.steps = 0
        self._current = StepPhases()
        self._start = self._mark = time.perf_counter()
        self._kv = 0.0
        self._observers: dict[str, Any] = {}
        if registry is not None:
            hist = Histogram(
                "prefixserve:step_phase_seconds",
                "Seconds each engine step spent per phase (kv_manager: inside the KV manager, "
                "taken out of the phase it ran in; docs/observability.md).",
                ["model_name", "engine", "phase"],
                buckets=PHASE_BUCKETS,
                registry=registry,
            )
            self._observers = {p: hist.labels(model_name, engine, p) for p in PHASES}

    def start(self) -> None:
        """A step begins."""
        self._current = StepPhases()
        self._kv = 0.0
        self._start = self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The phase ``phase`` ends now (it runs from the previous lap, KV manager time excluded)."""
        now = time.perf_counter()
        seconds = self._current.seconds
        seconds[phase] += now - self._mark - self._kv
        seconds["kv_manager"] += self._kv
        self._kv = 0.0
        self._mark = now

    def add_kv(self, seconds: float) -> None:
        """Time spent inside one KV manager call during the current phase."""
        self._kv += seconds

    def finish(self, phase: str, num_seqs: int) -> None:
        """The step ends with ``phase``; record and observe it."""
        self.lap(phase)
        step = self._current
        step.wall = self._mark - self._start
        step.num_seqs = num_seqs
        self.last = step
        self.steps += 1
        for name, observer in self._observers.items():
            observer.observe(step.seconds[name])


class TimedKVCacheManager(KVCacheManager):
    """A KVCacheManager whose lookups, allocations, frees, forks and swaps report their time
    to ``step_timer`` (set by the engine); results are the base class's, untouched."""

    step_timer: StepTimer | None = None

    def _timed(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        timer = self.step_timer
        if timer is None:
            return method(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timer.add_kv(time.perf_counter() - t0)

    def get_computed_blocks(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().get_computed_blocks, *args, **kwargs)

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().allocate_slots, *args, **kwargs)

    def free(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().free, *args, **kwargs)

    def fork(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().fork, *args, **kwargs)

    def swap_out(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().swap_out, *args, **kwargs)

    def swap_in(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().swap_in, *args, **kwargs)
