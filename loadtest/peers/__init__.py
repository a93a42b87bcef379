"""Faithful models of the peer routers the simulator compares ``placed`` against.

Job: one small module per peer, each following a named source (cited in its
docstring), all behind one interface so that ``loadtest/simulate.py`` can run
them on the same traffic as our own policies:

* ``sglang.py``: sglang-router's ``cache_aware`` (approximate radix tree, load-imbalance fallback).
* ``ray_prefix.py``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (prefix tree of routed prompts).
* ``llmd.py``: llm-d's inference scheduler (weighted scorers: prefix 3, queue 2, KV utilization 2;
  ``llmd_lora`` adds its LoRA-affinity scorer, weight 4).
* ``dynamo.py``: NVIDIA Dynamo's KV router (cost = prefill blocks after overlap + decode blocks).

The interface (``Peer``): ``route(candidates, request) -> Decision`` ranks the
candidates for one request, best first; ``on_prefilled`` / ``on_finish`` tell
the peer what a real router learns from the response stream (first token,
completion). A candidate (``PeerReplica``) is a ReplicaView with the replica's
reported ``load`` (router/policies/base.py's ReplicaLoad) and ``cached_blocks``:
how many leading blocks of a prompt its KV cache holds, which stands in for a
KV-event-fed index (Dynamo's KvIndexer) with no event delay.

Pure Python: no torch, no Ray, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixserve.router.policies import Decision, ReplicaLoad


@dataclass(frozen=True)
class PeerRequest:
    """One request as a peer router sees it.

    tokens: the prompt's token ids (peers that match text match these instead).
    block_hashes: the prompt's full-block chained hashes (design Contract 2).
    key: the routing key (Contract 1), for peers that use one.
    now: the arrival time (seconds).
    adapter: the LoRA adapter the request's ``model`` names (None: the base model).
    """

    index: int
    tokens: tuple[int, ...]
    block_hashes: Sequence[bytes]
    key: str
    now: float
    block_size: int
    adapter: str | None = None


class PeerReplica(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def load(self) -> ReplicaLoad: ...

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> int: ...


class Peer(Protocol):
    name: str

    def route(self, candidates: Sequence[PeerReplica], request: PeerRequest) -> Decision[PeerReplica]: ...

    def on_prefilled(self, replica: str, request: PeerRequest) -> None: ...

    def on_finish(self, replica: str, request: PeerRequest) -> None: ...


def rest_by_load(chosen: PeerReplica, candidates: Sequence[PeerReplica]) -> list[PeerReplica]:
    """``chosen`` first, then the others by in-flight count (ties by name)."""
    others = sorted((c for c in candidates if c is not chosen), key=lambda c: (c.in_flight, c.name))
    return [chosen, *others]


def make_peer(name: str, seed: int = 0) -> Peer:
    """Build the peer called ``name`` with its source's defaults (ValueError lists the names)."""
    try:
        factory = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer router {name!r}; choose one of {sorted(PEERS)}") from None
    return factory(seed)


def _sglang(seed: int) -> Peer:
    from prefixserve.loadtest.peers.sglang import SGLangCacheAware

    return SGLangCacheAware()


def _ray(seed: int) -> Peer:
    from prefixserve.loadtest.peers.ray_prefix import RayPrefixAffinity

    return RayPrefixAffinity(seed=seed)


def _llmd(seed: int) -> Peer:
    from prefixserve.loadtest.peers.llmd import LlmdScorer

    return LlmdScorer(seed=seed)


def _llmd_lora(seed: int) -> Peer:
    from prefixserve.loadtest.peers.llmd import LORA_WEIGHT, LlmdScorer

    return LlmdScorer(lora_weight=LORA_WEIGHT, seed=seed, name="llmd_lora")


def _dynamo(seed: int) -> Peer:
    from prefixserve.loadtest.peers.dynamo import DynamoKvRouter

    return DynamoKvRouter(seed=seed)


PEERS = {"sglang_tree": _sglang, "ray_prefix": _ray, "llmd": _llmd, "llmd_lora": _llmd_lora, "dynamo": _dynamo}
