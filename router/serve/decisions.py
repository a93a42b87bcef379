"""The request router's bookkeeping between a decision and a request's end.

Job: remember each request's decision until Serve says where it landed (for the
decision-kind and spill metrics, and the key ``placed`` counted it under), and count
the requests this router routed that have not completed, per replica.

The in-flight count is this router's own bookkeeping (``on_request_routed`` ..
``on_request_completed``): fresh, but it sees only this router's requests. Not Serve's
queue-length cache: its entries mix in queue-length probes that can land after the
completion they predate, and leave an idle replica looking busy for up to the cache
timeout, which made bounded_load spill keys with nothing in flight.

Pure Python: Ray only for type checking.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.replica.contract.prompt_blocks import PromptBlocks
from prefixserve.router.policies import KIND_FALLBACK, KIND_NO_KEY, KIND_NO_RING, KIND_OWNER, KIND_SPILL

if TYPE_CHECKING:
    from ray.serve.request_router import ReplicaID

# Remembered decisions (key owner per request) waiting for their routing outcome;
# bounded so that requests cancelled before routing cannot grow it without end.
MAX_PENDING_DECISIONS = 10_000


@dataclass(frozen=True)
class Choice:
    """What the policy decided for one request: the key's ring owner and its own first choice.

    key: the routing key ``placed`` counted the request under (None: not counted);
    blocks: the prompt's history hashes, recorded on the replica it lands on.
    """

    keyed: bool
    owner: str | None
    first: str | None
    key: str | None = None
    blocks: PromptBlocks | None = None


def decision_kind(choice: Choice | None, landed: str) -> str:
    """The decision kind of a request that landed on ``landed`` (router/policies/base.py's KIND_*)."""
    if choice is None or not choice.keyed:
        return KIND_NO_KEY
    if choice.owner is not None and landed == choice.owner:
        return KIND_OWNER
    if choice.first is not None and landed != choice.first:
        return KIND_FALLBACK
    return KIND_SPILL if choice.owner is not None else KIND_NO_RING


class PendingDecisions:
    """Each request's latest decision until it is routed, the oldest dropped beyond ``limit``."""

    def __init__(self, limit: int = MAX_PENDING_DECISIONS) -> None:
        self._limit = limit
        self._choices: OrderedDict[str, Choice] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._choices

    def get(self, request_id: str) -> Choice | None:
        return self._choices.get(request_id)

    def pop(self, request_id: str) -> Choice | None:
        return self._choices.pop(request_id, None)

    def remember(self, request_id: str, choice: Choice) -> list[Choice]:
        """Record ``choice`` as the request's latest; the decisions dropped to stay in bounds (never routed)."""
        self._choices[request_id] = choice
        self._choices.move_to_end(request_id)
        dropped = []
        while len(self._choices) > self._limit:
            dropped.append(self._choices.popitem(last=False)[1])
        return dropped


class OwnRequests:
    """The requests this router routed that have not completed: per request, its replica and counted key."""

    def __init__(self) -> None:
        self._routed: dict[str, tuple[ReplicaID, str | None]] = {}
        self.counts: defaultdict[ReplicaID, int] = defaultdict(int)  # per replica

    def count(self, replica_id: ReplicaID) -> int:
        """Requests this router sent to the replica that have not completed."""
        return self.counts.get(replica_id, 0)

    def routed(self, request_id: str, replica_id: ReplicaID, key: str | None) -> int | None:
        """The request landed on the replica: its new count (None: the request was already counted)."""
        if request_id in self._routed:
            return None
        self._routed[request_id] = (replica_id, key)
        self.counts[replica_id] += 1
        return self.counts[replica_id]

    def completed(self, request_id: str) -> tuple[ReplicaID, str | None, int | None] | None:
        """The request ended: (its replica, its counted key, the replica's new count or None when the replica
        left); None for a request never counted (a rejected attempt)."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return None
        routed_to, key = routed
        if routed_to not in self.counts:
            return routed_to, key, None
        count = max(0, self.counts[routed_to] - 1)
        self.counts[routed_to] = count
        return routed_to, key, count

    def forget(self, live: set[ReplicaID]) -> None:
        """Drop the counts of replicas not in ``live`` (their requests' completions then change nothing)."""
        for rid in [r for r in self.counts if r not in live]:
            del self.counts[rid]
