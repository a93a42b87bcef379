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

KV events (``--kv-events``, kv_events.py): with hints, the request's history is its
token-block hashes (computed off the event loop by the caller and passed to ``plan``),
not its text blocks; before ranking, what the events say each admitted replica holds of
them goes to ``rank`` beside the history index (``events_held``: the larger count wins)
and whether it holds the key's static prefix to ``set_cached``, the inputs the Ray host
feeds from its routing stats. The history index keeps recording what the router sent, so
missing events fall back to that record.

Pure Python: no HTTP, no asyncio (one event loop calls it, so it holds no lock).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from prefixserve.replica.contract.prompt_blocks import PromptBlocks, PromptHasher, UnhashablePrompt
from prefixserve.replica.contract.retention import RETENTION_24H
from prefixserve.router.policies import KIND_FALLBACK, Placed, Policy, effective_in_flight, landed_kind
from prefixserve.router.routing_key import DEFAULT_CONFIG, PrefixKeyConfig, routing_key
from prefixserve.router.standalone.kv_events import KVEventHints
from prefixserve.router.standalone.replica_set import ReplicaSet
from prefixserve.router.standalone.response_homes import ResponseHomes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """One request's decision.

    key: its routing key (None: routed by load). ranking: replica names, best first.
    owner: the key's ring owner (None without a key or ring). counted: ``placed``
    counted the request under ``key`` (so ``finished`` must end it). blocks: its
    history hashes (``placed`` with a history index), recorded where it lands.
    event_matched: the KV events said some admitted replica holds its leading blocks.
    """

    key: str | None
    ranking: list[str]
    owner: str | None = None
    counted: bool = False
    blocks: PromptBlocks | None = None
    event_matched: bool = False

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
        hints: KVEventHints | None = None,
    ) -> None:
        self.policy = policy
        self.replicas = replicas
        self.key_config = key_config
        self._hasher = hasher or PromptHasher()
        self.hints = hints if self.placed is not None else None
        self.response_homes = ResponseHomes()

    @property
    def placed(self) -> Placed | None:
        return self.policy if isinstance(self.policy, Placed) else None

    def key_of(self, body: Any, headers: Mapping[str, str], adapter: str | None = None) -> str | None:
        """The request's routing key (``adapter``: the LoRA adapter its model names); None when it has
        none or the router cannot read one."""
        if not isinstance(body, Mapping):
            return None
        try:
            return routing_key(body, headers, self.key_config, adapter=adapter)
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

    def plan(
        self,
        body: Any,
        headers: Mapping[str, str],
        among: Sequence[str] | None = None,
        token_blocks: PromptBlocks | None = None,
        adapter: str | None = None,
    ) -> Plan:
        """Rank the admitted replicas (of ``among``, e.g. those serving the request's model) for one request.

        ``body``: the parsed JSON body, or None when it is not JSON. ``token_blocks``: with
        KV-event hints, the prompt's token-block hashes (``hints.blocks(body)``; None when the
        router could not tokenize it: then it has no history). ``adapter``: the LoRA adapter the
        request's model names (a replica lists it with a ``parent``), part of its key.
        """
        key = self.key_of(body, headers, adapter)
        candidates = self.replicas.candidates(list(among) if among is not None else None)
        home = self.continuation_home(body)
        placed = self.placed
        if placed is None:
            decision = self.policy.rank(candidates, key)
            return Plan(key, _home_first([c.name for c in decision.ranking], home), decision.owner)
        events_held: dict[str, int] = {}
        if self.hints is not None:
            blocks = token_blocks
            if blocks is not None:
                events_held = self.learn(key, blocks)
        else:
            blocks = self.blocks_of(body)
        decision = placed.rank_prompt(candidates, key, blocks, events_held=events_held, adapter=adapter)
        if key is not None and isinstance(body, Mapping) and body.get("prompt_cache_retention") == RETENTION_24H:
            placed.retain(key)  # its replica pins its prefix: rebalancing keeps the key there
        ranking = _home_first([c.name for c in decision.ranking], home)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "key %s: %s, ranking %s, in flight %s (the key's %d), events' blocks %s, placement %s",
                key,
                decision.kind,
                ranking,
                {c.name: effective_in_flight(c) for c in candidates},
                placed.key_in_flight(key) if key is not None else 0,
                events_held or None,
                placed.placement(key) if key is not None else None,
            )
        return Plan(key, ranking, decision.owner, key is not None, blocks, bool(events_held))

    def continuation_home(self, body: Any) -> str | None:
        """The replica that stored the Response a ``/v1/responses`` body continues (its
        ``previous_response_id``), when the router relayed it; None otherwise."""
        previous = body.get("previous_response_id") if isinstance(body, Mapping) else None
        return self.response_homes.home(previous) if isinstance(previous, str) else None

    def landed(self, plan: Plan, name: str) -> str:
        """The request went to ``name``: its decision kind (router/policies/base.py KIND_*)."""
        kind = landed_kind(plan.key is not None, plan.owner, plan.first, name)
        placed = self.placed
        if kind == KIND_FALLBACK and plan.blocks is not None and placed is not None and placed.history is not None:
            placed.history.record(name, plan.blocks.hashes)  # the prompt is cached there, not on the first choice
        return kind

    def refused(self, plan: Plan) -> None:
        """The replica refused the request as a client error: its key's count taken back (the
        placement keeps no key of refused requests)."""
        placed = self.placed
        if placed is not None and plan.counted and plan.key is not None:
            placed.refused(plan.key)

    def finished(self, plan: Plan) -> None:
        """The request ended (answered, failed or abandoned)."""
        placed = self.placed
        if placed is not None and plan.counted and plan.key is not None:
            placed.done(plan.key)

    def observe(self, plan: Plan, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The request's prefill work from its answer's usage (``placed`` balances keys by it too, and
        learns the tokens of the key's static prefix from it)."""
        placed = self.placed
        if placed is not None and plan.key is not None:
            placed.observe(plan.key, prompt_tokens, cached_tokens)

    def forget(self, name: str) -> None:
        """``name`` died or was ejected: nothing the router believed it caches is trusted any more."""
        placed = self.placed
        if placed is not None and placed.history is not None:
            placed.history.forget(name)

    # -- KV events (the subscriber's seam) ------------------------------------------
    def learn(self, key: str | None, blocks: PromptBlocks) -> dict[str, int]:
        """What the KV events say the admitted replicas hold of ``blocks`` (replica -> leading blocks).

        Whether a replica holds the key (the static prefix's blocks, at least one) goes to
        ``placed``'s precise ``set_cached``; the counts go to this request's ``rank`` only, never
        into the history index: a block the events later say is gone stops counting at once.
        An ejected replica is told nothing: it is no candidate, and its record was forgotten.
        """
        placed = self.placed
        if placed is None or self.hints is None:
            return {}
        held = self.hints.held(blocks)
        need = max(1, blocks.static_blocks)
        known = set(self.hints.sources()) if key is not None else set()
        admitted: dict[str, int] = {}
        for name in self.replicas.names:
            if not self.replicas[name].admitted:
                continue
            n = held.get(name, 0)
            if n:
                admitted[name] = n
            if key is not None and (n or name in known):
                placed.set_cached(name, key, n >= need)
        return admitted

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


def _home_first(ranking: list[str], home: str | None) -> list[str]:
    """``ranking`` with ``home`` first when it is among them: a continuation's stored Response is there
    (its key's ranking follows, for when ``home`` cannot take it)."""
    if home is None or home not in ranking or ranking[0] == home:
        return ranking
    return [home, *(name for name in ranking if name != home)]
