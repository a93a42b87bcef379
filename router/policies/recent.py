"""Per-replica decayed counts of the requests a router sent (``placed``'s conversation balance).

Job: how many requests each replica was sent recently, exponentially decayed with
time constant ``tau_s``. ``placed`` (router/policies/placed.py) starts a new
conversation on the replica of its key's set with the fewest recent requests: a
conversation stays where it starts, so a replica's recent requests are its
sessions' share of the traffic, which in-flight counts (a snapshot of a few
requests) do not show.

Each event adds ``exp((now - t0) / tau)`` to its replica (so adding is O(1));
reading multiplies by ``exp(-(now - t0) / tau)``; the reference ``t0`` moves to
``now`` (every value rescaled) once it is ``_MAX_AGE_TAUS`` time constants old.
Replicas never sent a request read 0; ``forget(name)`` drops one, and a rescale
drops every value decayed below 1e-12, so a replica that left is gone within 50
time constants. Each router process counts its own decisions (a follower's are
its share of the traffic). Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# exp(50) is far from float overflow, and one rescale every 50 time constants is free.
_MAX_AGE_TAUS = 50.0


class RecentCounts:
    """Replica name -> its decayed count of requests sent (see the module docstring)."""

    def __init__(self, tau_s: float) -> None:
        if isinstance(tau_s, bool) or not isinstance(tau_s, (int, float)) or not (tau_s > 0 and math.isfinite(tau_s)):
            raise ValueError(f"tau_s must be a finite number > 0, got {tau_s!r}")
        self.tau_s = float(tau_s)
        self._t0: float | None = None
        self._values: dict[str, float] = {}

    def _age(self, now: float) -> float:
        """``(now - t0) / tau`` after moving ``t0`` to ``now`` if it was too old (or unset)."""
        if self._t0 is None:
            self._t0 = now
        age = (now - self._t0) / self.tau_s
        if age > _MAX_AGE_TAUS:
            f = math.exp(-age)
            self._values = {n: v * f for n, v in self._values.items() if v * f > 1e-12}
            self._t0 = now
            age = 0.0
        return age

    def add(self, name: str, now: float) -> None:
        """One request was sent to ``name`` at ``now`` (seconds, monotonic)."""
        unit = math.exp(self._age(now))  # first: it may rescale the values
        self._values[name] = self._values.get(name, 0.0) + unit

    def counts(self, names: Sequence[str], now: float) -> list[float]:
        """The decayed counts of ``names`` at ``now``, in their order."""
        f = math.exp(-self._age(now))
        get = self._values.get
        return [get(n, 0.0) * f for n in names]

    def forget(self, name: str) -> None:
        """Drop ``name`` (it left the candidates)."""
        self._values.pop(name, None)

    def __len__(self) -> int:
        return len(self._values)
