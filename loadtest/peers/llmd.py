"""llm-d's inference scheduler (the Gateway API Inference Extension's EPP), weighted scorers, for the simulator.

Sources: kubernetes-sigs/gateway-api-inference-extension,
``pkg/epp/scheduling/framework/plugins/prefixcachescorer/plugin.go`` (prefix
scorer, its LRU indexer), ``queuescorer/queue.go``,
``kvcacheutilizationscorer/kvcache_utilization.go`` and the max-score picker;
the weights are llm-d's default scheduling profile: prefix-cache-scorer 3,
queue-scorer 2, kv-cache-utilization-scorer 2. What this reproduces:

* prefix scorer ("approximate" mode): the prompt is cut into blocks and
  chain-hashed (at most 256 blocks); after each decision the target pod's LRU
  index gets all of the request's block hashes (capacity per pod = its number
  of KV blocks, as AutoTune reads it from the pod's metrics). The score of a
  pod is the number of leading blocks found (walking while any pod has the
  block) that the pod holds, over the request's block count;
* queue scorer: ``(max_q - q) / (max_q - min_q)`` over the pods' waiting queue
  sizes, 1 for every pod when all queues are equal;
* KV-cache utilization scorer: ``1 - kv_usage``;
* the picker takes the highest weighted sum; ties are broken at random
  (the picker shuffles before sorting);
* LoRA-affinity scorer (``llmd_lora``; ``loraaffinity`` in llm-d's router,
  ``pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go`` in the Gateway API
  Inference Extension): 1.0 when the request's adapter is active on the pod (in the
  ``running_lora_adapters`` of its ``vllm:lora_requests_info``), else 0.8 when the pod's
  active plus waiting adapters are fewer than its ``max_lora``, else 0.6 when the adapter
  is waiting there, else 0. It reads activity, not residency: an adapter loaded but idle
  scores as any other. Weight 4, as KServe's llm-d ``LLMInferenceService`` controller adds
  it to every scheduling profile when the service names adapters
  (``injectLoRAAffinityScorer``). A simulated replica offers ``running_adapters``,
  ``waiting_adapters`` and ``max_loras`` (loadtest/simulate.py ``SimReplica``).

Difference: EPP hashes 64-character blocks of the request body (≈ 16 tokens);
the model hashes the engine's 16-token blocks (Contract 2), the same granularity.

Pure Python: no torch, no Ray, no HTTP.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from prefixserve.loadtest.peers import PeerReplica, PeerRequest, rest_by_load
from prefixserve.router.policies import Decision

MAX_PREFIX_BLOCKS = 256
LORA_WEIGHT = 4.0
DEFAULT_LRU_CAPACITY = 31_250  # EPP's default when a pod reports no block count


class PrefixIndex:
    """Per pod, an LRU set of block hashes; per hash, the pods holding it."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[bytes, None]] = {}
        self.holders: dict[bytes, set[str]] = {}

    def add(self, hashes: Sequence[bytes], pod: str, capacity: int) -> None:
        lru = self.lru.setdefault(pod, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self.holders.setdefault(h, set()).add(pod)
            while len(lru) > capacity:
                old, _ = lru.popitem(last=False)
                pods = self.holders[old]
                pods.discard(pod)
                if not pods:
                    del self.holders[old]

    def longest_prefix(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """matchLongestPrefix: per pod, the leading blocks it holds while any pod holds the block."""
        res: dict[str, int] = {}
        for h in hashes:
            pods = self.holders.get(h)
            if not pods:
                break
            for p in pods:
                res[p] = res.get(p, 0) + 1
        return res


def lora_affinity(pod: object, adapter: str) -> float:
    """The LoRA-affinity scorer's score of ``pod`` for ``adapter`` (the module docstring)."""
    active = getattr(pod, "running_adapters", frozenset())
    waiting = getattr(pod, "waiting_adapters", frozenset())
    if adapter in active:
        return 1.0
    if len(active) + len(waiting) < getattr(pod, "max_loras", 0):
        return 0.8
    if adapter in waiting:
        return 0.6
    return 0.0


class LlmdScorer:
    """The peer (loadtest/peers): llm-d's weighted prefix/queue/KV-utilization scoring."""

    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        lru_capacity: int | None = None,
        seed: int = 0,
        lora_weight: float = 0.0,
        name: str = "llmd",
    ) -> None:
        self.name = name
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.lora_weight = lora_weight
        self.lru_capacity = lru_capacity
        self.index = PrefixIndex()
        self._rng = random.Random(seed)

    def route(self, candidates: Sequence[PeerReplica], request: PeerRequest) -> Decision[PeerReplica]:
        if not candidates:
            raise ValueError("a routing policy needs at least one candidate replica")
        hashes = list(request.block_hashes[:MAX_PREFIX_BLOCKS])
        matches = self.index.longest_prefix(hashes)
        total = len(hashes)
        queues = [c.load.num_waiting for c in candidates]
        qmin, qmax = min(queues), max(queues)
        wp, wq, wk = self.weights
        order = list(candidates)
        self._rng.shuffle(order)
        best, best_score = order[0], -1.0
        for c in order:
            prefix = matches.get(c.name, 0) / total if total else 0.0
            queue = 1.0 if qmax == qmin else (qmax - c.load.num_waiting) / (qmax - qmin)
            score = wp * prefix + wq * queue + wk * (1.0 - c.load.kv_usage)
            if self.lora_weight and request.adapter is not None:
                score += self.lora_weight * lora_affinity(c, request.adapter)
            if score > best_score:
                best, best_score = c, score
        capacity = self.lru_capacity or getattr(best, "num_gpu_blocks", None) or DEFAULT_LRU_CAPACITY
        self.index.add(hashes, best.name, capacity)  # PreRequest
        return Decision(rest_by_load(best, candidates))

    def on_prefilled(self, replica: str, request: PeerRequest) -> None:
        """Nothing: the index learns at routing time."""

    def on_finish(self, replica: str, request: PeerRequest) -> None:
        """Nothing: queue and KV usage come from the pods' metrics."""
