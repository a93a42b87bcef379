"""NVIDIA Dynamo's KV router, modelled for the simulator.

Sources: ai-dynamo/dynamo, ``lib/kv-router/src/scheduling/selector.rs``
(``DefaultWorkerSelector::select_worker``) and ``docs/router/kv_cache_routing.md``;
defaults ``kv_overlap_score_weight = 1.0``, ``router_temperature = 0`` (the
lowest cost wins), KV events on. What this reproduces:

* cached blocks come from the workers' KV events (the KvIndexer's radix tree):
  ``overlap`` = the leading blocks of the prompt the worker holds. The model
  reads them from the replica's real KV cache at decision time (events with no
  delay: the best case for Dynamo);
* the router tracks its active sequences per worker: the prefill tokens of
  requests not yet past their first token, and the distinct KV blocks of every
  active request (shared prefix blocks count once);
* ``logit = overlap_weight * potential_prefill_blocks + potential_decode_blocks``
  with ``potential_prefill_blocks = (queued prefill tokens + this request's
  tokens - overlap * block_size) / block_size`` and ``potential_decode_blocks``
  = the worker's active blocks plus this request's blocks it does not already
  hold; the lowest logit wins, ties at random.

Simplification: a request's active blocks are its prompt blocks (output blocks
grow the same on every worker). Pure Python: no torch, no Ray, no HTTP.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from prefixserve.loadtest.peers import PeerReplica, PeerRequest, rest_by_load
from prefixserve.router.policies import Decision


class DynamoKvRouter:
    """The peer (loadtest/peers): Dynamo's prefill + decode block cost."""

    name = "dynamo"

    def __init__(self, overlap_weight: float = 1.0, seed: int = 0) -> None:
        self.overlap_weight = overlap_weight
        self._rng = random.Random(seed)
        self._prefill: dict[str, int] = {}  # worker -> queued prefill tokens
        self._blocks: dict[str, Counter[bytes]] = {}  # worker -> active blocks (with multiplicity)
        self._pending: dict[int, tuple[str, int]] = {}  # request -> (worker, its prefill tokens)

    def route(self, candidates: Sequence[PeerReplica], request: PeerRequest) -> Decision[PeerReplica]:
        if not candidates:
            raise ValueError("a routing policy needs at least one candidate replica")
        bs = request.block_size
        isl = len(request.tokens)
        hashes = request.block_hashes
        best: list[PeerReplica] = []
        best_logit = float("inf")
        new_tokens_of: dict[str, int] = {}
        for c in candidates:
            overlap = c.cached_blocks(hashes)
            new_tokens = max(0, isl - overlap * bs)
            new_tokens_of[c.name] = new_tokens
            prefill_blocks = (self._prefill.get(c.name, 0) + new_tokens) / bs
            active = self._blocks.get(c.name)
            # Chained hashes: the active blocks a prompt shares are a leading run.
            shared = 0
            if active:
                for h in hashes:
                    if h not in active:
                        break
                    shared += 1
            decode_blocks = (len(active) if active else 0) + -(-isl // bs) - shared
            logit = self.overlap_weight * prefill_blocks + decode_blocks
            if logit < best_logit:
                best, best_logit = [c], logit
            elif logit == best_logit:
                best.append(c)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        tokens = new_tokens_of[chosen.name]
        self._prefill[chosen.name] = self._prefill.get(chosen.name, 0) + tokens
        self._blocks.setdefault(chosen.name, Counter()).update(hashes)
        self._pending[request.index] = (chosen.name, tokens)
        return Decision(rest_by_load(chosen, candidates))

    def on_prefilled(self, replica: str, request: PeerRequest) -> None:
        """The first token: the request's prefill tokens leave the worker's queue."""
        worker, tokens = self._pending.get(request.index, (replica, 0))
        self._prefill[worker] = self._prefill.get(worker, 0) - tokens
        self._pending[request.index] = (worker, 0)

    def on_finish(self, replica: str, request: PeerRequest) -> None:
        """Completion: the request's blocks leave the worker's active set."""
        worker, _ = self._pending.pop(request.index, (replica, 0))
        active = self._blocks.get(worker)
        if active is not None:
            active.subtract(request.block_hashes)
            for h in request.block_hashes:
                if active[h] <= 0:
                    del active[h]
