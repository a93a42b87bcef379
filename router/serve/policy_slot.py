"""The request router's policy and the one lock every use of it holds.

Job: share the policy between the router's parts (ranking, KV-event intake, history
feed, placement sync) so that each reads the current one. Ray runs the router on its
own event-loop thread and the ingress calls it from another, so every use of the
policy holds ``lock``. A subclass may put another policy in (loadtest/peers/serve_adapter.py
runs a peer router's model this way).

Pure Python: no Ray.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prefixserve.router.policies import Placed, Policy
from prefixserve.router.serve.metrics import RouterMetrics


@dataclass
class PolicySlot:
    """The policy a router runs, and the lock that guards it."""

    policy: Policy
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def placed(self) -> Placed | None:
        """The policy when it is ``placed`` (placements, snapshots, history, precise hook), else None."""
        return self.policy if isinstance(self.policy, Placed) else None


class SlotPart:
    """A router part that uses the shared policy slot and records the deployment's metrics."""

    def __init__(self, slot: PolicySlot, metrics: RouterMetrics, deployment: str) -> None:
        self._slot = slot
        self._metrics = metrics
        self._deployment = deployment
