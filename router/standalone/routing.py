"""The standalone router's decision: a request body in, the replicas to try (best first) out.

Job: drive a router/policies/ policy as the Ray host does (router/serve/request_router.py),
over the replica set's candidates: the routing key of router/routing_key.py (Contract 1),
for ``placed`` the prompt's text blocks (replica/contract/prompt_blocks.py) for its history
index, one ``rank`` per request (counted once: retries walk the same ranking, which falls
back in ring order as nginx would), the history recorded on the replica the request
really landed on, and ``done`` when the request ends.

A body the router cannot read for a key (not JSON, a malformed field, a bad
``X-Prefix-Hash``) is routed by load, never refused here: the replica answers it
(most likely with its own 400).

KV events (the seam for a subscriber to replicas' KV events): ``set_cached(replica, key,
holds)`` feeds ``placed``'s precise placement and ``report_history(...)`` its history
index, the same two inputs the Ray host feeds from its routing stats.

Pure Python: no HTTP, no asyncio (one event loop calls it, so it holds no lock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from prefixserve.replica.contract.prompt_blocks import PromptBlocks, PromptHasher, UnhashablePrompt
from prefixserve.router.policies import KIND_FALLBACK, Placed, Policy, landed_kind
from prefixserve.router.routing_key import DEFAULT_CONFIG, PrefixKeyConfig, routing_key
from prefixserve.router.standalone.replica_set import ReplicaSet


@dataclass(frozen=True)
class Plan:
    """One request's decision.

    key: its routing key (None: routed by load). ranking: replica names, best first.
    owner: the key's ring owner (None without a key or ring). counted: ``placed``
    counted the request under ``key`` (so ``finished`` must end it). blocks: its
    history hashes (``placed`` with a history index), recorded where it lands.
    """

    key: str | None
    ranking: list[str]
    owner: str | None = None
    counted: bool = False
    blocks: PromptBlocks | None = None

    @property
    def first(self) -> str:
        return self.ranking[0]

    def attempts(self, max_attempts: int) -> list[str]:
        """The replicas to try, in order: the ranking's first ``max_attempts``."""
        return self.ranking[: max(1, max_attempts)]


class StandaloneRouting:
    """One policy over one replica set: ``plan`` per request, ``landed`` and ``finished`` per outcome."""

    def __init__(
        self,
        policy: Policy,
        replicas: ReplicaSet,
        key_config: PrefixKeyConfig = DEFAULT_CONFIG,
        hasher: PromptHasher | None = None,
    ) -> None:
        self.policy = policy
        self.replicas = replicas
        self.key_config = key_config
        self._hasher = hasher or PromptHasher()

    @property
    def placed(self) -> Placed | None:
        return self.policy if isinstance(self.policy, Placed) else None

    def key_of(self, body: Any, headers: Mapping[str, str]) -> str | None:
        """The request's routing key; None when it has none or the router cannot read one."""
        if not isinstance(body, Mapping):
            return None
        try:
            return routing_key(body, headers, self.key_config)
        except (ValueError, TypeError):
            return None

    def blocks_of(self, body: Any) -> PromptBlocks | None:
        """The prompt's history hashes for ``placed``; None when unused or unreadable."""
        placed = self.placed
        if placed is None or placed.history is None or not isinstance(body, Mapping):
            return None
        request = SimpleNamespace(messages=body.get("messages"), prompt=body.get("prompt"))
        try:
            return self._hasher.blocks(request)
        except (UnhashablePrompt, TypeError, ValueError):
            return None

    def plan(self, body: Any, headers: Mapping[str, str], among: Sequence[str] | None = None) -> Plan:
        """Rank the admitted replicas (of ``among``, e.g. those serving the request's model) for one request.

        ``body``: the parsed JSON body, or None when it is not JSON.
        """
        key = self.key_of(body, headers)
        candidates = self.replicas.candidates(list(among) if among is not None else None)
        placed = self.placed
        if placed is None:
            decision = self.policy.rank(candidates, key)
            return Plan(key, [c.name for c in decision.ranking], decision.owner)
        blocks = self.blocks_of(body)
        decision = placed.rank(
            candidates,
            key,
            count=True,
            history=blocks.hashes if blocks is not None else None,
            static_blocks=blocks.static_blocks if blocks is not None else 0,
        )
        return Plan(key, [c.name for c in decision.ranking], decision.owner, key is not None, blocks)

    def landed(self, plan: Plan, name: str) -> str:
        """The request went to ``name``: its decision kind (router/policies/base.py KIND_*)."""
        kind = landed_kind(plan.key is not None, plan.owner, plan.first, name)
        placed = self.placed
        if kind == KIND_FALLBACK and plan.blocks is not None and placed is not None and placed.history is not None:
            placed.history.record(name, plan.blocks.hashes)  # the prompt is cached there, not on the first choice
        return kind

    def finished(self, plan: Plan) -> None:
        """The request ended (answered, failed or abandoned)."""
        placed = self.placed
        if placed is not None and plan.counted and plan.key is not None:
            placed.done(plan.key)

    def observe(self, plan: Plan, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The request's prefill work from its answer's usage (``placed`` balances keys by it too)."""
        placed = self.placed
        if placed is not None and plan.key is not None:
            placed.observe(plan.key, prompt_tokens, cached_tokens)

    def forget(self, name: str) -> None:
        """``name`` died or was ejected: nothing the router believed it caches is trusted any more."""
        placed = self.placed
        if placed is not None and placed.history is not None:
            placed.history.forget(name)

    # -- KV events (the subscriber's seam) ------------------------------------------
    def set_cached(self, replica: str, key: str, holds: bool) -> None:
        """Whether ``replica`` holds ``key``'s prefix blocks (``placed`` with ``precise``)."""
        placed = self.placed
        if placed is not None:
            placed.set_cached(replica, key, holds)

    def report_history(
        self, replica: str, stored: Sequence[bytes], removed: Iterable[bytes], reset: bool = False
    ) -> None:
        """``replica``'s history events: which of the router's text blocks it still caches."""
        placed = self.placed
        if placed is not None and placed.history is not None:
            placed.history.report(replica, stored, removed, reset)
