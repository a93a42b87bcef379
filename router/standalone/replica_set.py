"""The replicas the standalone router fronts: which are admitted, what each has in flight, what it reports.

Job: the health and load state behind every decision, without any HTTP (the proxy
feeds it probe results, request starts and ends, load reports and failures).

Health transitions (one replica):

* admitted --``unhealthy_after`` failed probes in a row--> ejected
* admitted --died (refused a connection, or broke mid-answer)--> ejected at once:
  a replica that just failed a request is not offered the next one while probes
  catch up
* ejected --``healthy_after`` good probes in a row--> admitted

A good probe resets the failure count, a failed one the good count. While every
replica is ejected the candidates are all of them: a request tried on a replica
that may be back is better than a refusal from the router alone.

Load: a candidate's ``in_flight`` is the router's own count of the requests it
sent the replica that have not ended (fresh, but only this router's); its
``load`` is the replica's last ``/metrics`` report corrected by the router's
own change since the report arrived (requests sent since count as waiting;
requests ended since come off waiting first, then running), the same rule as the
Ray host's (router/serve/request_router.py), and none when older than
``load_max_age_s``. The policies take the larger of the two.

Pure Python: no HTTP, no asyncio; time from an injectable clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prefixserve.router.policies import ReplicaLoad

ADMITTED = "admitted"
EJECTED = "ejected"


@dataclass(frozen=True)
class Candidate:
    """A replica as a policy sees it (router/policies/base.py ReplicaView, with its load)."""

    name: str
    in_flight: int
    load: ReplicaLoad | None = None


@dataclass
class ReplicaState:
    """One replica's health and load bookkeeping."""

    name: str
    url: str
    admitted: bool = True
    failures: int = 0  # failed probes in a row
    successes: int = 0  # good probes in a row
    in_flight: int = 0
    report: ReplicaLoad | None = None
    own_at_report: int = 0  # this router's in-flight count on the replica when the report arrived
    report_at: float = 0.0


def corrected_load(report: ReplicaLoad, own_at_report: int, own_now: int) -> ReplicaLoad:
    """``report`` corrected by the router's own in-flight change since it arrived (the module docstring)."""
    return report.corrected(own_at_report, own_now)


class ReplicaSet:
    """Health, in-flight counts and load reports of a fixed list of replicas (name -> base URL)."""

    def __init__(
        self,
        urls: Mapping[str, str],
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        load_max_age_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("a replica set needs at least one replica")
        if unhealthy_after < 1 or healthy_after < 1:
            raise ValueError("unhealthy_after and healthy_after must be >= 1")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.load_max_age_s = load_max_age_s
        self._clock = clock
        self.replicas: dict[str, ReplicaState] = {n: ReplicaState(n, u) for n, u in urls.items()}

    def __getitem__(self, name: str) -> ReplicaState:
        return self.replicas[name]

    @property
    def names(self) -> list[str]:
        return list(self.replicas)

    def admitted(self) -> list[str]:
        """Names of the admitted replicas, in the configured order."""
        return [n for n, r in self.replicas.items() if r.admitted]

    # -- health -------------------------------------------------------------------
    def probe(self, name: str, ok: bool) -> str | None:
        """Record one health probe of ``name``; ADMITTED or EJECTED when it changed the replica's state."""
        r = self.replicas[name]
        if ok:
            r.failures = 0
            r.successes += 1
            if not r.admitted and r.successes >= self.healthy_after:
                r.admitted = True
                return ADMITTED
            return None
        r.successes = 0
        r.failures += 1
        if r.admitted and r.failures >= self.unhealthy_after:
            r.admitted = False
            return EJECTED
        return None

    def died(self, name: str) -> str | None:
        """``name`` failed a request (no connection, or broken mid-answer): ejected now; EJECTED if it was admitted."""
        r = self.replicas[name]
        r.successes = 0
        r.failures = max(r.failures, self.unhealthy_after)
        r.report = None  # what it reported before it died says nothing of the process that comes back
        if r.admitted:
            r.admitted = False
            return EJECTED
        return None

    # -- load ---------------------------------------------------------------------
    def started(self, name: str) -> None:
        self.replicas[name].in_flight += 1

    def ended(self, name: str) -> None:
        r = self.replicas[name]
        r.in_flight = max(0, r.in_flight - 1)

    def report_load(self, name: str, load: ReplicaLoad | None) -> None:
        """Take ``name``'s ``/metrics`` load (None: it reports none)."""
        r = self.replicas[name]
        r.report = load
        r.own_at_report = r.in_flight
        r.report_at = self._clock()

    def load(self, name: str) -> ReplicaLoad | None:
        """``name``'s reported load corrected by this router's change since (None: no recent report)."""
        r = self.replicas[name]
        if r.report is None or self._clock() - r.report_at > self.load_max_age_s:
            return None
        return corrected_load(r.report, r.own_at_report, r.in_flight)

    # -- the policy's view ----------------------------------------------------------
    def candidates(self, among: list[str] | None = None) -> list[Candidate]:
        """The admitted replicas (of ``among`` when given) as the policy sees them; all of them when none is admitted.

        The order is the configured one, so the policy's memo of the last candidate list holds.
        """
        pool = [n for n in self.replicas if among is None or n in among]
        chosen = [n for n in pool if self.replicas[n].admitted] or pool
        return [Candidate(n, self.replicas[n].in_flight, self.load(n)) for n in chosen]
