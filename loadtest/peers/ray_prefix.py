"""Ray Serve LLM's ``PrefixCacheAffinityRouter``, modelled for the simulator.

Source: ray-project/ray 2.60,
``python/ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``
(``_prefix_match_best_replicas``, ``on_request_routed``) and ``prefix_tree.py``
(``prefix_match``, ``get_smallest_tenants``); the same class bench_cluster plugs
into the real cluster. Defaults: ``imbalanced_threshold = inf``,
``match_rate_threshold = 0.1``, ``do_eviction = False``. What this reproduces:

* a prefix tree of the prompts routed so far, one tenant per replica
  (``on_request_routed`` inserts the prompt under the replica it went to);
* if the queue-length spread ``max - min`` exceeds ``imbalanced_threshold``,
  the base power-of-two choice decides (never, with the default of infinity);
* otherwise the prompt is matched: if ``matched / len(prompt) >=
  match_rate_threshold`` the candidates are every replica holding the deepest
  matched node, else the replicas with the fewest characters in the tree
  ("smallest tenants");
* Ray's base router then takes the candidate with the shortest queue. When all
  of them are full Ray backs off and asks again, so the request waits for one
  of them; the model sends it to the shortest queue among them at once (it
  waits in that replica's queue instead of the router's: the same wait).

Difference: Ray matches characters of the concatenated message contents; the
model matches token ids. The tree is loadtest/peers/sglang.py's ApproxTree
(the same structure: tenant access times per node, per-tenant sizes).

Pure Python: no torch, no Ray, no HTTP.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from prefixserve.loadtest.peers import PeerReplica, PeerRequest, rest_by_load
from prefixserve.loadtest.peers.sglang import ApproxTree
from prefixserve.router.policies import Decision


class RayPrefixAffinity:
    """The peer (loadtest/peers): Ray's prefix-affinity choice over an approximate tree."""

    name = "ray_prefix"

    def __init__(
        self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1, seed: int = 0
    ) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = ApproxTree()
        self._rng = random.Random(seed)

    def route(self, candidates: Sequence[PeerReplica], request: PeerRequest) -> Decision[PeerReplica]:
        if not candidates:
            raise ValueError("a routing policy needs at least one candidate replica")
        queues = [c.in_flight for c in candidates]
        by_name = {c.name: c for c in candidates}
        chosen_set: list[PeerReplica] = []
        if max(queues) - min(queues) <= self.imbalanced_threshold and request.tokens:
            matched, holders = self.tree.match_all(request.tokens)
            if matched / len(request.tokens) >= self.match_rate_threshold and holders:
                chosen_set = [by_name[n] for n in holders if n in by_name]
            else:
                # Smallest tenants: replicas never routed to have size 0 (Ray adds every
                # replica as a tenant when it joins).
                sizes = {c.name: self.tree.sizes.get(c.name, 0) for c in candidates}
                low = min(sizes.values())
                chosen_set = [c for c in candidates if sizes[c.name] == low]
        if not chosen_set:  # the power-of-two fallback
            pair = self._rng.sample(list(candidates), min(2, len(candidates)))
            chosen_set = pair
        chosen = min(chosen_set, key=lambda c: (c.in_flight, c.name))
        self.tree.insert(request.tokens, chosen.name, request.now)  # on_request_routed
        return Decision(rest_by_load(chosen, candidates))

    def on_prefilled(self, replica: str, request: PeerRequest) -> None:
        """Nothing: Ray inserts the prompt when the request is routed."""

    def on_finish(self, replica: str, request: PeerRequest) -> None:
        """Nothing: queue lengths come from the replicas."""
