"""Timing an engine's start-up by phase, for the log and the startup metric.

An engine wraps each step of its construction in ``timer.phase(name)``; the phases
are the keys of :data:`PHASES` (checkpoint: finding or building the converted
checkpoint; config; tokenizer; kernels: choosing and loading the attention/layer
kernels; weights: building the model and loading, packing its weights; kv_cache:
allocating the KV cache). ``EngineMetrics.observe_startup(timer.phases)`` exports them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("checkpoint", "config", "tokenizer", "kernels", "weights", "kv_cache")
log = logging.getLogger("prefixserve.startup")


@dataclass
class StartupTimer:
    """Seconds spent in each named phase (a phase entered twice adds up)."""

    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> str:
        """``"4.12 s: checkpoint 0.20, config 0.05, ..."`` for one log line."""
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases.items())
        return f"{self.total:.2f} s: {parts}"

    def log(self, model_name: str) -> None:
        log.info("engine %s started in %s", model_name, self.summary())
