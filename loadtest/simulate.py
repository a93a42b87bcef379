"""Discrete-event simulation of a cluster of engine replicas under each routing policy.

Job: answer "which router, at what scale" without a cluster. R replicas, each a
real ``prefixserve.replica.kv.manager.KVCacheManager`` (real block accounting, hashing,
eviction policy ``--eviction-policy``), routed by the real policies of
``router/policies/`` (``placed``, the default, is the baseline of the tables)
and by faithful models of the peer routers in ``loadtest/peers/`` (SGLang's
cache_aware, Ray's PrefixCacheAffinityRouter, llm-d's weighted scorers,
Dynamo's KV router), on Zipf tenant traffic
(``prefixserve.loadtest.workloads.zipf_tenant_sequence``: the same tenant
sequence the locust workload sends).

Signals: every policy sees what a real router would. Our policies get each
replica's in-flight count (routed, not finished) and its reported load
(``ReplicaLoad``: waiting, running, KV usage, queued prompt tokens, updated on
every event of that replica); ``placed`` runs on the simulated clock, learns
each request's prefill work at completion (``observe`` with the prompt and
cached tokens the response reports), and ``placed_precise`` also gets
``set_cached`` from the replicas' real KV caches (whether the key's first
prefix block is cached) for the key's placement and ring successors at each
decision and for every placed key before a rebalance: KV events without delay.
``placed_events`` is ``placed`` whose history index also takes the replicas' history
events (replica/contract/history_events.py, the real publisher, tracker and consumer):
every ``report_s`` of simulated time (Serve's routing-stats period) each replica
publishes which of its finished requests' blocks its cache holds and the router applies
them (the simulator's history hashes are Contract-2 hashes: each maps to itself).
Peers get the prompt tokens, block hashes and the same loads (see
loadtest/peers/__init__.py).

The model, per replica:

* requests are routed on arrival (Poisson); the policy sees each replica's
  in-flight count (routed and not finished) and the request's routing key (the
  tenant's prefix hash, Contract 1);
* prefill is compute-bound and serialized: the head of the replica's FIFO queue
  is admitted when the prefill slot is free, fewer than ``max_num_seqs``
  requests run, and the KV manager can allocate its prompt and output slots
  (else it waits for a finish: head-of-line blocking, no preemption);
* admission looks the prompt up (``get_computed_blocks``) and allocates the
  prompt then the output tokens; prefill takes
  ``overhead + uncached_tokens * s_per_token`` (``loadtest/cost_model.py``);
  TTFT = prefill end - arrival;
* KV tiers (``host_blocks_per_replica``, ``shared_disk``): each replica's KV manager keeps
  its evicted blocks in a host tier of that many blocks, and with ``shared_disk`` every
  replica's computed blocks and host-tier leavers go to one disk store all replicas read
  (an unbounded set of hashes: the directory every replica mounts). A prompt token served
  by a tier costs its copy (``CostProfile.tier_load_s``) instead of its prefill, and counts
  as a hit (``cached_tokens`` counts every tier);
* decode runs alongside (batched) and holds the blocks for ``output_len``
  steps of ``decode_step_s + B * decode_per_seq_s`` (B: the batch it joined);
  then the request is freed. Prefill and decode do not slow each other down
  (a simplification: the hot replica's cost shows as prefill queueing).

Tokens: tenant t's system prompt is a deterministic array of token ids drawn
from a seeded generator; each request appends its own question and output ids.
No tokenizer is involved. The oracle is one replica with an unbounded cache
replaying the arrivals in order, hashing with the same ``BlockHasher``; a
replica's hits can never exceed it (a replica caches only what it admitted
earlier, which arrived earlier).

Outputs: a markdown table per policy (hit rate, of-oracle ratio, load max/mean,
TTFT p50/p99), sweeps over the replica count and one policy's epsilon (placed's by default),
``results/simulate.json`` and ``results/simulate.png``.

Imports: numpy, the KV manager, router policies, matplotlib lazily (Agg). No
torch, no Ray, no HTTP.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from prefixserve.common.config_util import from_cli_args
from prefixserve.loadtest.conversations import CONVERSATION_WORKLOADS, ConversationTraffic, preset
from prefixserve.loadtest.cost_model import PROFILE_NAMES, CostProfile, get_profile
from prefixserve.loadtest.harness.cli import add_flags, flag_field
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import markdown_table, write_json
from prefixserve.loadtest.peers import PEERS, PeerRequest, make_peer
from prefixserve.loadtest.peers.sglang import SGLangCacheAware, SGLangConfig
from prefixserve.loadtest.workloads import zipf_tenant_sequence
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.history_events import HistoryTracker
from prefixserve.replica.contract.kv_events import KVEventConsumer, KVEventPublisher
from prefixserve.replica.kv.hashing import BlockHasher
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.router.policies import Placed, ReplicaLoad, make_policy, pick_options
from prefixserve.router.routing_key import adapter_key, prefix_hash

# Our policies, then the peers; "placed" (the default) is the tables' baseline.
OWN_POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "consistent_hash",
    "bounded_load",
    "placed",
    "placed_static",
    "placed_precise",
    "placed_events",
)
POLICY_NAMES = OWN_POLICIES + tuple(PEERS)
BASELINE = "placed"
WORKLOADS = ("tenants", *CONVERSATION_WORKLOADS)
VOCAB = 49152  # SmolLM2's vocabulary; any size works


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster and its traffic.

    utilization: offered prefill load if no request hit the cache (arrival rate =
        utilization * R / prefill time of a whole prompt); hits lower the real load.
    blocks_per_replica: KV blocks of one replica; the default holds ~1/30 of the
        tenants' system prompts, so the working set exceeds one replica's cache
        and routing decides the hit rate.
    """

    num_replicas: int = flag_field(64, flag="--replicas")
    num_tenants: int = flag_field(2000, flag="--tenants")
    num_requests: int = flag_field(100_000, flag="--requests")
    zipf_s: float = flag_field(0.8)
    hot_share: float = flag_field(0.05)
    system_prompt_len: int = flag_field(256, flag="--system-len")
    question_len: int = flag_field(32)
    output_len: int = flag_field(128)
    block_size: int = 16
    blocks_per_replica: int = flag_field(1024)
    max_num_seqs: int = flag_field(64)
    utilization: float = flag_field(0.6)
    # The cost model (loadtest/cost_model.py): cluster.yaml's 4 x H100 replica of Llama-3.1-70B by
    # default; "cpu" models this project's CPU replicas.
    profile: str = flag_field("h100-70b-tp4", choices=PROFILE_NAMES)
    epsilon: float = flag_field(0.25, "bounded_load's epsilon")
    placed_epsilon: float | None = flag_field(None, "placed's epsilon (unset: the policy's own)")
    # More options of placed (and placed_static / placed_precise), as (name, value) pairs
    # (router/policies/placed.py PlacedOptions); the policy validates them.
    placed_options: tuple[tuple[str, Any], ...] = ()
    # The engine's defaults (EngineConfig.eviction_policy, evict_generated_first): the simulator
    # models the replicas as they ship. "cold": a finished request's generated blocks enter the
    # pool's cold end (KVCacheManager.free's generated_cold; every simulated request is a one-shot,
    # none a conversation turn).
    eviction_policy: str = flag_field(
        EngineConfig.eviction_policy, "the replicas' KV eviction policy (replica/kv/block_pool.py EVICTION_POLICIES)"
    )
    generated_blocks: str = flag_field(
        "cold" if EngineConfig.evict_generated_first else "warm",
        "cold: a finished request's generated blocks enter the KV pool's cold end",
        choices=("warm", "cold"),
    )
    # EngineConfig.protect_static_prefix: a finished request's system-prompt blocks are freed as
    # reused (KVCacheManager.free's static_prefix_tokens), also on a replica's first sight of them.
    protect_static_prefix: bool = EngineConfig.protect_static_prefix
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    seed: int = flag_field(0)
    # "tenants" (the Zipf tenant sequence above) or a conversation workload of
    # loadtest/conversations.py ("multi_turn", "agent": its preset; the tenant and
    # prompt-length fields above are then unused).
    workload: str = flag_field(
        "tenants",
        "tenants (Zipf tenant one-shots) or a conversation workload (loadtest/conversations.py)",
        choices=WORKLOADS,
    )
    # KV tiers: host-tier blocks per replica (0 = none) and one disk store shared by every
    # replica (needs the host tier: disk reads land in it, as in the engine).
    host_blocks_per_replica: int = flag_field(0, "host KV tier (0: none)")
    shared_disk: bool = flag_field(False, "one disk tier every replica reads (needs a host tier)")
    # placed_events: seconds between the replicas' KV event reports (router.stats_period_s).
    report_s: float = 1.0
    # LoRA adapters (tenants workload): tenant t's requests run adapter ``lora-{t mod N}`` (0: none);
    # a replica holds ``max_loras`` of them loaded, least recently used evicted unless in use, and
    # one it lacks is loaded before the request's prefill (CostProfile.adapter_load_s), counted.
    num_adapters: int = flag_field(0, "LoRA adapters: tenant t runs adapter t mod N (0: none)", flag="--adapters")
    max_loras: int = flag_field(4, "LoRA adapters a replica holds loaded")

    def __post_init__(self) -> None:
        for name in (
            "num_replicas",
            "num_tenants",
            "num_requests",
            "output_len",
            "block_size",
            "blocks_per_replica",
            "max_num_seqs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len + self.question_len < 1:
            raise ValueError("a prompt needs at least one token: raise system_prompt_len or question_len")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.num_adapters < 0 or self.max_loras < 1:
            raise ValueError(f"num_adapters must be >= 0 and max_loras >= 1, got {self.num_adapters}, {self.max_loras}")
        if self.num_adapters and self.workload != "tenants":
            raise ValueError("LoRA adapters are simulated on the tenants workload")
        if self.host_blocks_per_replica < 0:
            raise ValueError(f"SimConfig.host_blocks_per_replica must be >= 0, got {self.host_blocks_per_replica}")
        if self.shared_disk and not self.host_blocks_per_replica:
            raise ValueError("shared_disk needs the host tier (host_blocks_per_replica > 0)")
        if self.generated_blocks not in ("warm", "cold"):
            raise ValueError(f"generated_blocks must be 'warm' or 'cold', got {self.generated_blocks!r}")
        if not 0 < self.utilization:
            raise ValueError(f"utilization must be > 0, got {self.utilization}")
        need = -(-(self.system_prompt_len + self.question_len + self.output_len) // self.block_size)
        if need > self.blocks_per_replica:
            raise ValueError(
                f"one request needs {need} blocks but a replica has {self.blocks_per_replica}: "
                "raise blocks_per_replica or shorten the prompts"
            )

    @property
    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len


# ------------------------------------------------------------------ traffic


@dataclass
class Traffic:
    """The requests of one run: tenants, token arrays, unit-rate arrival gaps, oracle hits."""

    tenants: list[int]
    system_tokens: list[list[int]]  # per tenant
    system_hashes: list[list[bytes]]  # per tenant: its full system blocks' chained hashes
    keys: list[str]  # per tenant routing key
    tail_tokens: np.ndarray  # [num_requests, question_len + output_len]
    unit_gaps: np.ndarray  # exponential inter-arrival gaps at rate 1
    oracle_hits: list[int]  # per request, tokens an unbounded single cache would hit
    conv: ConversationTraffic | None = None  # a conversation workload's sessions (tenants = its apps)
    previous: list[int] = field(default_factory=list)  # conv: per request its session's previous one, or -1
    adapters: list[str | None] = field(default_factory=list)  # per tenant its LoRA adapter (SimConfig.num_adapters)

    def adapter(self, i: int) -> str | None:
        """The LoRA adapter request ``i`` runs with (None: the base model)."""
        return self.adapters[self.tenants[i]] if self.adapters else None

    def prompt(self, i: int, config: SimConfig) -> list[int]:
        if self.conv is not None:
            return self.conv.prompt(i)
        return self.system_tokens[self.tenants[i]] + self.tail_tokens[i, : config.question_len].tolist()

    def output(self, i: int, config: SimConfig) -> list[int]:
        if self.conv is not None:
            return self.conv.output(i)
        return self.tail_tokens[i, config.question_len :].tolist()

    def prompt_len(self, i: int, config: SimConfig) -> int:
        return self.conv.prompt_lens[i] if self.conv is not None else config.prompt_len

    def static_len(self, i: int, config: SimConfig) -> int:
        return self.conv.static_len(i) if self.conv is not None else config.system_prompt_len


def make_traffic(config: SimConfig) -> Traffic:
    """Deterministic traffic for ``config`` (everything but the replica count and policy)."""
    if config.workload != "tenants":
        return _conversation_traffic(config)
    tenants = zipf_tenant_sequence(
        config.num_tenants, config.num_requests, config.zipf_s, config.hot_share, config.seed
    )
    hasher = BlockHasher()
    bs = config.block_size
    system_tokens, system_hashes, keys = [], [], []
    adapters: list[str | None] = []
    for t in range(config.num_tenants):
        toks = np.random.default_rng([config.seed, 1, t]).integers(0, VOCAB, config.system_prompt_len).tolist()
        system_tokens.append(toks)
        system_hashes.append(hasher.hash_blocks(toks, bs, None))
        key = prefix_hash(f"tenant-{t}:" + " ".join(map(str, toks[:32])))
        if config.num_adapters:
            # The adapter's key (Contract 1). Its blocks' hashes need no adapter here: each tenant
            # runs one adapter over a system prompt of its own, so no two adapters share a block.
            adapters.append(f"lora-{t % config.num_adapters}")
            key = adapter_key(key, adapters[-1])
        keys.append(key)
    rng = np.random.default_rng([config.seed, 2])
    tail = rng.integers(0, VOCAB, (config.num_requests, config.question_len + config.output_len), dtype=np.int64)
    gaps = rng.exponential(1.0, config.num_requests)
    traffic = Traffic(tenants, system_tokens, system_hashes, keys, tail, gaps, [], adapters=adapters)
    traffic.oracle_hits = _oracle(traffic, config, hasher)
    return traffic


def _conversation_traffic(config: SimConfig) -> Traffic:
    """A conversation workload's traffic; its oracle: an unbounded cache holds every earlier block.

    Sessions share nothing but their app's static prefix (their tokens are drawn
    independently), so the oracle's hit is the previous turn's prompt and output
    (all its full blocks), or on a session's first turn the static prefix's full
    blocks once any earlier request of the app arrived; capped, as the engine
    does, below the last prompt token.
    """
    conv = ConversationTraffic(preset(config.workload), config.num_requests, config.seed)
    hasher = BlockHasher()
    bs = config.block_size
    keys = [prefix_hash(f"app-{a}:" + " ".join(map(str, toks[:32]))) for a, toks in enumerate(conv.static_tokens)]
    static_hashes = [hasher.hash_blocks(toks, bs, None) for toks in conv.static_tokens]
    previous = [-1] * len(conv)
    for i, nxt in enumerate(conv.next_turn):
        if nxt >= 0:
            previous[nxt] = i
    seen_apps: set[int] = set()
    hits = []
    for i, app in enumerate(conv.apps):
        limit = (conv.prompt_lens[i] - 1) // bs
        prev = previous[i]
        if prev >= 0:
            covered = (conv.prompt_lens[prev] + conv.output_lens[prev]) // bs
        else:
            covered = len(static_hashes[app]) if app in seen_apps else 0
        seen_apps.add(app)
        hits.append(min(limit, covered) * bs)
    traffic = Traffic(
        list(conv.apps),
        conv.static_tokens,
        static_hashes,
        keys,
        np.zeros((0, 0), dtype=np.int64),
        np.zeros(0),
        hits,
        conv,
        previous,
    )
    return traffic


def _oracle(traffic: Traffic, config: SimConfig, hasher: BlockHasher) -> list[int]:
    """Hit tokens per request for one replica with an unbounded cache, in arrival order."""
    bs = config.block_size
    seen: set[bytes] = set()
    hits = []
    for i, t in enumerate(traffic.tenants):
        prompt = traffic.prompt(i, config)
        base = traffic.system_hashes[t]
        hashes = base + hasher.hash_blocks(prompt, bs, None, start=len(base), parent=base[-1] if base else None)
        limit = (len(prompt) - 1) // bs  # the last prompt token is always computed
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        hits.append(n * bs)
        seen.update(hashes)
    return hits


# ---------------------------------------------------------------- simulation


class SharedDisk:
    """The shared disk tier as every simulated replica's KV manager sees it (a ``BlockStore``):
    the hashes any replica stored; payloads carry nothing (the simulator moves no KV)."""

    enabled = True

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def load(self, block_hash: bytes) -> bytes | None:
        return b"" if block_hash in self.hashes else None

    def take(self, kv: KVCacheManager) -> None:
        """Apply the writes a replica's KV manager queued (what the engine's disk writer does)."""
        ops = kv.take_tier_ops()
        self.hashes.update(h for _, h in ops.host_stores)
        self.hashes.update(h for _, h in ops.device_stores)


class SimReplica:
    """One replica: a ReplicaView (with reported load) for the policies, a KV manager, a queue, a prefill slot."""

    __slots__ = (
        "index",
        "name",
        "in_flight",
        "kv",
        "queue",
        "busy",
        "running",
        "routed",
        "peak",
        "load",
        "queued_tokens",
        "num_gpu_blocks",
        "adapters",
        "max_loras",
        "adapter_loads",
        "waiting",
    )

    def __init__(self, index: int, config: SimConfig, disk: SharedDisk | None = None) -> None:
        self.index = index
        self.name = f"10.0.{index // 256}.{index % 256}:8000"
        self.in_flight = 0
        self.kv = KVCacheManager(
            config.blocks_per_replica,
            config.block_size,
            eviction_policy=config.eviction_policy,
            num_host_blocks=config.host_blocks_per_replica,
            host_tier=config.host_blocks_per_replica > 0,
            disk=disk,
        )
        self.num_gpu_blocks = config.blocks_per_replica
        self.queue: deque[int] = deque()
        self.busy = False
        self.running = 0
        self.routed = 0
        self.peak = 0
        self.queued_tokens = 0
        self.load = ReplicaLoad()
        # LoRA adapters held loaded -> their running requests (least recently used first); the
        # adapters of the queued requests; loads so far (SimConfig.num_adapters).
        self.adapters: OrderedDict[str, int] = OrderedDict()
        self.max_loras = config.max_loras
        self.adapter_loads = 0
        self.waiting: Counter[str] = Counter()

    def refresh_load(self) -> None:
        """What the replica reports after a change: queue, running, KV usage, queued prompt tokens, adapters held."""
        held = frozenset(self.adapters) if self.adapters else frozenset()
        self.load = ReplicaLoad(
            len(self.queue), self.running, self.kv.usage, self.queued_tokens, held, self.max_loras if held else 0
        )

    @property
    def running_adapters(self) -> frozenset[str]:
        """Adapters of the running requests (vLLM's ``running_lora_adapters``)."""
        return frozenset(a for a, n in self.adapters.items() if n)

    @property
    def waiting_adapters(self) -> frozenset[str]:
        """Adapters of the queued requests (vLLM's ``waiting_lora_adapters``)."""
        return frozenset(a for a, n in self.waiting.items() if n)

    def use_adapter(self, name: str) -> bool:
        """A request of adapter ``name`` starts here: True when the adapter had to be loaded.
        Past ``max_loras`` the least recently used adapter no request runs is dropped (as the engine's
        LoRAManager does: one in use stays, so more than ``max_loras`` may be held)."""
        held = self.adapters
        loaded = name not in held
        if loaded:
            self.adapter_loads += 1
            held[name] = 0
            idle = [a for a, n in held.items() if n == 0 and a != name]
            for a in idle[: max(0, len(held) - self.max_loras)]:
                del held[a]
        held[name] += 1
        held.move_to_end(name)
        return loaded

    def end_adapter(self, name: str) -> None:
        self.adapters[name] -= 1

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of a prompt this replica's KV cache holds (what KV events would tell a router)."""
        get = self.kv.pool.hash_to_block.get
        n = 0
        for h in block_hashes:
            if get(h) is None:
                break
            n += 1
        return n


@dataclass
class PolicyResult:
    policy: str
    num_replicas: int
    epsilon: float | None
    num_requests: int
    finished: int
    prompt_tokens: int
    hit_tokens: int
    miss_tokens: int
    hit_rate: float
    oracle_hit_rate: float
    of_oracle: float  # hit_rate / oracle_hit_rate
    oracle_violations: int  # requests that hit more than the oracle (must be 0)
    load_max_over_mean: float  # requests routed: busiest replica / mean
    peak_in_flight: int
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    kv_query_tokens: int  # the KV managers' own counters, for the balance check
    kv_hit_tokens: int
    leaked_blocks: int  # blocks still in use after every request finished (must be 0)
    # Prompt tokens short of the oracle, by cause: the request's key had never been admitted on
    # that replica before (a first touch there: the price of spreading a key over replicas) or it
    # had (the replica evicted the prefix, or the key's earlier request is still being admitted).
    first_touch_miss_tokens: int
    evicted_miss_tokens: int
    sim_seconds: float  # simulated time
    wall_seconds: float
    host_hit_tokens: int = 0  # of hit_tokens, served by a host tier (disk reads included)
    disk_hit_tokens: int = 0  # of those, read from the shared disk first
    adapter_loads: int = 0  # LoRA adapters loaded by the replicas (SimConfig.num_adapters)
    adapter_loads_per_1000: float = 0.0  # per 1,000 finished requests


class _Router:
    """Runs one policy (ours or a peer) with the signals a real router has (see the module docstring)."""

    def __init__(
        self, policy: str, config: SimConfig, traffic: Traffic, replicas: list[SimReplica], clock: list[float]
    ) -> None:
        self.config, self.traffic, self.replicas = config, traffic, replicas
        self.peer = None
        self.tree: SGLangCacheAware | None = None
        self.precise = policy == "placed_precise"
        # placed_events: the replicas' history events, published every report_s.
        self.events = policy == "placed_events"
        self._publishers = [KVEventPublisher(history=HistoryTracker()) for _ in replicas] if self.events else []
        self._consumer = KVEventConsumer()
        self._next_report = 0.0
        self._sent: dict[int, list[bytes]] = {}  # request -> its block hashes (placed_events, in flight)
        # placed matches each request's whole-prompt block hashes against its history index;
        # placed_static is the same policy keyed by the static prefix alone.
        self.history = policy != "placed_static"
        self.placed: Placed | None = None
        self.options: dict = {}
        self._hasher = BlockHasher()
        if policy == "sglang_tree":
            self.tree = SGLangCacheAware(config.sglang)
        elif policy in PEERS:
            self.peer = make_peer(policy, config.seed)
        else:
            name = "placed" if policy in ("placed_precise", "placed_static", "placed_events") else policy
            settings = {"seed": config.seed, "epsilon": config.epsilon}
            if name == "placed":
                settings["epsilon"] = config.placed_epsilon
            self.options = pick_options(name, settings)
            extra: dict = {}
            if name == "placed":
                extra = {**dict(config.placed_options), "clock": lambda: clock[0], "precise": self.precise}
            self.ring_policy = make_policy(name, **self.options, **extra)
            if isinstance(self.ring_policy, Placed):
                self.placed = self.ring_policy
                self.options["epsilon"] = self.placed.epsilon
        self._requests: dict[int, PeerRequest] = {}

    def request(self, i: int, now: float) -> PeerRequest:
        cfg, tr = self.config, self.traffic
        t = tr.tenants[i]
        prompt = tr.prompt(i, cfg)
        base = tr.system_hashes[t]
        hashes = base + self._hasher.hash_blocks(
            prompt, cfg.block_size, None, start=len(base), parent=base[-1] if base else None
        )
        return PeerRequest(i, tuple(prompt), hashes, tr.keys[t], now, cfg.block_size, tr.adapter(i))

    def route(self, i: int, now: float) -> SimReplica:
        tr = self.traffic
        if self.tree is not None:
            return self.tree.choose(self.replicas, tuple(tr.prompt(i, self.config)), now).chosen
        if self.peer is not None:
            req = self._requests[i] = self.request(i, now)
            chosen = self.peer.route(self.replicas, req).chosen
            assert isinstance(chosen, SimReplica)
            return chosen
        key = tr.keys[tr.tenants[i]]
        if self.precise:
            self._feed_cached(i, key)
        if self.placed is not None and self.history:
            if self.events and now >= self._next_report:
                self._report(now)
            req = self.request(i, now)
            static_blocks = len(tr.system_hashes[tr.tenants[i]])
            chosen = self.placed.rank(
                self.replicas, key, history=req.block_hashes, static_blocks=static_blocks, adapter=tr.adapter(i)
            ).chosen
            if self.events:
                self._publishers[chosen.index].history.begin(req.block_hashes)  # type: ignore[union-attr]
                self._sent[i] = req.block_hashes
            return chosen
        return self.ring_policy.rank(self.replicas, key).chosen

    def _report(self, now: float) -> None:
        """Every replica's KV event payload, applied by the router (placed_events)."""
        assert self.placed is not None and self.placed.history is not None
        self._next_report = now + self.config.report_s
        for rep, pub in zip(self.replicas, self._publishers, strict=True):
            kv = rep.kv
            medium = kv.tier_medium if self.config.host_blocks_per_replica > 0 else None
            self._consumer.apply(rep.name, pub.publish(kv.pool.hash_to_block.__contains__, medium))
            for report in self._consumer.take_history():
                self.placed.history.report(report.replica, report.stored, report.removed, report.reset)

    def _feed_cached(self, i: int, key: str) -> None:
        """Precise mode's KV events: which replicas hold the key's first prefix block, read from their caches."""
        placed = self.placed
        assert placed is not None
        by_name = {r.name: r for r in self.replicas}
        if placed.rebalance_due():
            for k in placed.table.keys():
                for name in placed.placement(k):
                    self._tell(k, by_name[name])
        ring = placed.ring_for(self.replicas)
        for name in dict.fromkeys([*placed.placement(key), *ring.successors(key, limit=4)]):
            self._tell(key, by_name[name])

    def _tell(self, key: str, rep: SimReplica) -> None:
        first = self._first_hash.get(key)
        if first is None:
            return
        assert self.placed is not None
        self.placed.set_cached(rep.name, key, rep.kv.pool.hash_to_block.get(first) is not None)

    @property
    def _first_hash(self) -> dict[str, bytes]:
        cache = getattr(self, "_first_hash_cache", None)
        if cache is None:
            tr = self.traffic
            cache = {tr.keys[t]: h[0] for t, h in enumerate(tr.system_hashes) if h}
            self._first_hash_cache = cache
        return cache

    def prefilled(self, i: int, rep: SimReplica) -> None:
        if self.peer is not None:
            self.peer.on_prefilled(rep.name, self._requests[i])

    def finished(self, i: int, rep: SimReplica, prompt_tokens: int, hit_tokens: int) -> None:
        if self.peer is not None:
            self.peer.on_finish(rep.name, self._requests.pop(i))
        elif self.placed is not None:
            hashes = self._sent.pop(i, None)
            if hashes is not None:
                tracker = self._publishers[rep.index].history
                assert tracker is not None
                tracker.end(hashes)
                tracker.remember(zip(hashes, hashes, strict=True))
            # What the response's usage tells the router: prompt and cached tokens.
            key = self.traffic.keys[self.traffic.tenants[i]]
            self.placed.observe(key, prompt_tokens, hit_tokens)
            self.placed.done(key)


_ARRIVE, _PREFILLED, _FINISH = 0, 1, 2


def simulate(
    config: SimConfig,
    policy: str,
    traffic: Traffic | None = None,
    profile: CostProfile | None = None,
    check_invariants: bool = False,
) -> PolicyResult:
    """Run one policy over the traffic; returns its figures (see PolicyResult)."""
    started = time.perf_counter()
    traffic = traffic if traffic is not None else make_traffic(config)
    profile = profile if profile is not None else get_profile(config.profile)
    disk = SharedDisk() if config.shared_disk else None
    replicas = [SimReplica(r, config, disk) for r in range(config.num_replicas)]
    tiers = config.host_blocks_per_replica > 0
    clock = [0.0]  # the simulated time, the placed policy's clock
    router = _Router(policy, config, traffic, replicas, clock)
    options = router.options

    conv = traffic.conv
    n = len(conv) if conv is not None else config.num_requests
    if conv is None:
        rate = config.utilization * config.num_replicas / profile.prefill_s(config.prompt_len)
        arrivals = np.cumsum(traffic.unit_gaps / rate).tolist()
    else:
        # Sessions start at a rate that offers `utilization` of the cluster's prefill time
        # if every turn computed only its new tokens (the oracle's work).
        work = sum(profile.prefill_s(conv.new_tokens(i, p)) for i, p in enumerate(traffic.previous))
        rate = config.utilization * config.num_replicas / (work / len(conv.starts))
        arrivals = [0.0] * n  # set as each request arrives (a turn follows its predecessor's finish)
    decode_step = profile.decode_step
    adapter_load_s = profile.adapter_load_s()
    per_token, overhead = profile.prefill_s_per_token, profile.prefill_overhead_s
    max_seqs = config.max_num_seqs
    cold_generated = config.generated_blocks == "cold"
    static_tokens = config.system_prompt_len if config.protect_static_prefix else 0
    ttft = [0.0] * n
    hits = [0] * n
    tier_tokens = [0, 0]  # host-tier hit tokens (disk reads included), of which disk reads
    replica_of = [0] * n
    admitted_keys: set[tuple[int, int]] = set()  # (tenant, replica) pairs admitted so far
    first_touch_short = evicted_short = 0
    decode_s = [0.0] * n
    prompt_tokens = 0
    finished = 0
    if conv is None:
        events: list[tuple[float, int, int, int]] = [(arrivals[0], 0, _ARRIVE, 0)]
    else:
        events = [(t / rate, s, _ARRIVE, first) for s, (t, first) in enumerate(conv.starts)]
        heapq.heapify(events)
    seq = len(events)  # tie-breaker: equal times keep push order
    push, pop = heapq.heappush, heapq.heappop

    def try_admit(rep: SimReplica, now: float) -> None:
        nonlocal seq, prompt_tokens, first_touch_short, evicted_short
        if rep.busy or not rep.queue or rep.running >= max_seqs:
            return
        i = rep.queue[0]
        prompt = traffic.prompt(i, config)
        kv = rep.kv
        rid = str(i)
        before = kv.stats.tiers if tiers else None
        blocks, num_hit = kv.get_computed_blocks(prompt)
        out = traffic.output(i, config)
        if not kv.can_allocate(rid, len(prompt) + len(out) - num_hit, blocks):
            if tiers:
                kv.take_swap_ops()  # the lookup's pins and load budget end with the step
                if disk is not None:
                    disk.take(kv)
            return  # wait for a finish on this replica to free blocks
        ok = kv.allocate_slots(rid, prompt, len(prompt) - num_hit, blocks)
        ok2 = kv.allocate_slots(rid, prompt + out, len(out))
        assert ok is not None and ok2 is not None
        load_s = 0.0
        if before is not None:
            kv.take_swap_ops()
            if disk is not None:
                disk.take(kv)
            after = kv.stats.tiers
            host_t = after.host_hit_tokens - before.host_hit_tokens
            disk_t = after.disk_hit_tokens - before.disk_hit_tokens
            tier_tokens[0] += host_t
            tier_tokens[1] += disk_t
            load_s = profile.tier_load_s(host_t, disk_t)
        adapter = traffic.adapter(i)
        if adapter is not None:
            rep.waiting[adapter] -= 1
            if rep.use_adapter(adapter):
                load_s += adapter_load_s
        rep.queue.popleft()
        rep.queued_tokens -= len(prompt)
        rep.running += 1
        rep.busy = True
        rep.refresh_load()
        hits[i] = num_hit
        prompt_tokens += len(prompt)
        short = traffic.oracle_hits[i] - num_hit
        if short > 0:
            if (traffic.tenants[i], rep.index) in admitted_keys:
                evicted_short += short
            else:
                first_touch_short += short
        admitted_keys.add((traffic.tenants[i], rep.index))
        # Decode time is fixed at admission from the batch it joins.
        decode_s[i] = len(out) * decode_step(rep.running)
        push(events, (now + overhead + (len(prompt) - num_hit) * per_token + load_s, seq, _PREFILLED, i))
        seq += 1

    while events:
        now, _, kind, i = pop(events)
        clock[0] = now
        if kind == _ARRIVE:
            if conv is not None:
                arrivals[i] = now
            elif i + 1 < n:
                push(events, (arrivals[i + 1], seq, _ARRIVE, i + 1))
                seq += 1
            rep = router.route(i, now)
            replica_of[i] = rep.index
            rep.in_flight += 1
            rep.routed += 1
            if rep.in_flight > rep.peak:
                rep.peak = rep.in_flight
            rep.queue.append(i)
            if (adapter := traffic.adapter(i)) is not None:
                rep.waiting[adapter] += 1
            rep.queued_tokens += traffic.prompt_len(i, config)
            rep.refresh_load()
            try_admit(rep, now)
        elif kind == _PREFILLED:
            rep = replicas[replica_of[i]]
            ttft[i] = now - arrivals[i]
            rep.busy = False
            router.prefilled(i, rep)
            push(events, (now + decode_s[i], seq, _FINISH, i))
            seq += 1
            try_admit(rep, now)
        else:
            rep = replicas[replica_of[i]]
            rep.kv.free(
                str(i),
                generated_cold=cold_generated,
                static_prefix_tokens=traffic.static_len(i, config) if static_tokens else 0,
            )
            rep.running -= 1
            rep.in_flight -= 1
            finished += 1
            if (adapter := traffic.adapter(i)) is not None:
                rep.end_adapter(adapter)
            rep.refresh_load()
            router.finished(i, rep, traffic.prompt_len(i, config), hits[i])
            if conv is not None and conv.next_turn[i] >= 0:
                nxt = conv.next_turn[i]
                push(events, (now + conv.think[nxt], seq, _ARRIVE, nxt))
                seq += 1
            try_admit(rep, now)
            if check_invariants:
                rep.kv.check_invariants()

    hit_tokens = sum(hits)
    oracle_tokens = sum(traffic.oracle_hits)
    routed = [rep.routed for rep in replicas]
    stats = [rep.kv.stats for rep in replicas]
    ttft_arr = np.asarray(ttft)
    oracle_rate = oracle_tokens / prompt_tokens if prompt_tokens else 0.0
    hit_rate = hit_tokens / prompt_tokens if prompt_tokens else 0.0
    return PolicyResult(
        policy=policy,
        num_replicas=config.num_replicas,
        epsilon=options.get("epsilon"),
        num_requests=n,
        finished=finished,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        miss_tokens=prompt_tokens - hit_tokens,
        hit_rate=hit_rate,
        oracle_hit_rate=oracle_rate,
        of_oracle=hit_rate / oracle_rate if oracle_rate else 0.0,
        oracle_violations=sum(1 for h, o in zip(hits, traffic.oracle_hits) if h > o),
        load_max_over_mean=max(routed) / (sum(routed) / len(routed)),
        peak_in_flight=max(rep.peak for rep in replicas),
        ttft_p50=float(np.percentile(ttft_arr, 50)),
        ttft_p99=float(np.percentile(ttft_arr, 99)),
        ttft_mean=float(ttft_arr.mean()),
        kv_query_tokens=sum(s.prefix_query_tokens for s in stats),
        kv_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
        leaked_blocks=sum(s.num_used_blocks for s in stats),
        first_touch_miss_tokens=first_touch_short,
        evicted_miss_tokens=evicted_short,
        sim_seconds=max(arrivals),
        wall_seconds=time.perf_counter() - started,
        host_hit_tokens=tier_tokens[0],
        disk_hit_tokens=tier_tokens[1],
        adapter_loads=(loads := sum(rep.adapter_loads for rep in replicas)),
        adapter_loads_per_1000=1000 * loads / finished if finished else 0.0,
    )


# ------------------------------------------------------------------- reports


def render_table(results: Sequence[PolicyResult], baseline: str | None = BASELINE) -> str:
    """One row per result; with ``baseline``, its ratios against each row.

    "hit x" is the baseline's hit rate over the row's; "TTFT /" the baseline's
    TTFT over the row's (below 1: the baseline is faster). "short: first touch /
    evicted": points of prompt tokens the row missed where the oracle hit, by cause.
    """
    # The baseline row of the same cluster size (sweeps hold several sizes).
    bases = {r.num_replicas: r for r in reversed(results) if baseline and r.policy == baseline}
    head = (
        "policy | R | hit rate | of oracle | short: first touch / evicted | load max/mean"
        " | peak in-flight | TTFT p50 (s) | TTFT p99 (s)"
    )
    adapters = any(r.adapter_loads for r in results)
    if adapters:
        head += " | adapter loads / 1,000 requests"
    if bases:
        head += f" | {baseline} hit x | {baseline} p50 TTFT / | {baseline} p99 TTFT /"
    rows = []
    for r in results:
        tokens = max(r.prompt_tokens, 1)
        row = [
            r.policy if r.epsilon is None else f"{r.policy} (eps={r.epsilon:g})",
            r.num_replicas,
            f"{r.hit_rate:.1%}",
            f"{r.of_oracle:.2f}",
            f"{100 * r.first_touch_miss_tokens / tokens:.2f} / {100 * r.evicted_miss_tokens / tokens:.2f}",
            f"{r.load_max_over_mean:.2f}",
            r.peak_in_flight,
            f"{r.ttft_p50:.3f}",
            f"{r.ttft_p99:.3f}",
        ]
        if adapters:
            row.append(f"{r.adapter_loads_per_1000:.1f}")
        base = bases.get(r.num_replicas)
        if bases and base is None:
            row += ["-", "-", "-"]
        elif base is not None:
            row += [
                f"{base.hit_rate / r.hit_rate:.2f}" if r.hit_rate else "inf",
                f"{base.ttft_p50 / r.ttft_p50:.2f}" if r.ttft_p50 else "-",
                f"{base.ttft_p99 / r.ttft_p99:.2f}" if r.ttft_p99 else "-",
            ]
        rows.append(row)
    return markdown_table(head, rows)


def plot(
    main: Sequence[PolicyResult], by_replicas: Sequence[PolicyResult], by_epsilon: Sequence[PolicyResult], path: Path
) -> None:
    with figure(path, 110, 1, 3, figsize=(17, 5)) as (_, axes):
        ax = axes[0]
        names = [r.policy for r in main]
        x = np.arange(len(main))
        ax.bar(x, [r.hit_rate * 100 for r in main], color="tab:blue", alpha=0.7, label="hit rate")
        ax.axhline(main[0].oracle_hit_rate * 100, color="tab:blue", ls=":", label="oracle")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_ylabel("prefix-cache hit rate (%)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(x, [r.ttft_p50 for r in main], "o-", color="tab:red", label="TTFT p50")
        ax2.plot(x, [r.ttft_p99 for r in main], "s--", color="tab:red", label="TTFT p99")
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT (s, log)", color="tab:red")
        ax.set_title(f"{main[0].num_replicas} replicas: hit rate against TTFT")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)

        ax = axes[1]
        for name in dict.fromkeys(r.policy for r in by_replicas):
            rows = [r for r in by_replicas if r.policy == name]
            ax.plot([r.num_replicas for r in rows], [r.hit_rate * 100 for r in rows], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel("hit rate (%)")
        ax.set_title("hit rate against cluster size")
        ax.legend(fontsize=8)

        ax = axes[2]
        eps = [r.epsilon for r in by_epsilon]
        ax.plot(eps, [r.hit_rate * 100 for r in by_epsilon], "o-", color="tab:blue", label="hit rate")
        ax.set_xscale("log")
        ax.set_xlabel(f"{by_epsilon[0].policy} epsilon")
        ax.set_ylabel("hit rate (%)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(eps, [r.ttft_p99 for r in by_epsilon], "s--", color="tab:red", label="TTFT p99")
        ax2.plot(eps, [r.load_max_over_mean for r in by_epsilon], "^:", color="tab:gray", label="load max/mean")
        ax2.set_ylabel("TTFT p99 (s) / load max/mean")
        ax.set_title(f"{by_epsilon[0].policy}: epsilon sweep")
        ax2.legend(loc="upper left", fontsize=8)


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, file=sys.stderr)


def add_placed_option_flag(parser: argparse.ArgumentParser) -> None:
    """``--placed-option NAME=JSON``, repeatable; read back with :func:`parse_placed_options`."""
    parser.add_argument(
        "--placed-option",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="another option of placed (PlacedOptions), its value as JSON (null: None); repeatable",
    )


def parse_placed_options(pairs: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """``NAME=JSON`` strings as (name, value) pairs; ValueError naming a malformed one."""
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--placed-option wants NAME=JSON, got {pair!r}")
        try:
            out.append((name, json.loads(value)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--placed-option {name}: the value is not JSON ({exc.msg}): {value!r}") from None
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixserve.loadtest.simulate", description=__doc__.split("\n\n")[0])
    d = SimConfig()
    add_flags(p, SimConfig, "cluster and traffic")
    add_placed_option_flag(p)
    p.add_argument(
        "--static-prefix",
        choices=("protected", "plain"),
        default="protected" if d.protect_static_prefix else "plain",
        help="protected: the system prompt's blocks are freed as reused (EngineConfig.protect_static_prefix)",
    )
    p.add_argument("--host-gbps", type=float, default=None, help="device <-> host copy rate (default: the profile's)")
    p.add_argument("--disk-gbps", type=float, default=None, help="disk read rate (default: the profile's)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    p.add_argument("--sweep-replicas", default="8,16,32,64", help="comma list; empty to skip")
    p.add_argument("--sweep-epsilons", default="0.05,0.1,0.25,0.5,1,2", help="comma list; empty to skip")
    p.add_argument(
        "--sweep-policy", default=BASELINE, choices=("placed", "bounded_load"), help="the policy whose epsilon is swept"
    )
    p.add_argument("--sweep-requests", type=int, default=20_000, help="requests per sweep run")
    p.add_argument("--out", default="results/simulate.json")
    p.add_argument("--png", default="results/simulate.png")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    policies = [s for s in args.policies.split(",") if s]
    unknown = set(policies) - set(POLICY_NAMES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {POLICY_NAMES}")
    try:
        config = replace(
            from_cli_args(SimConfig, args),
            placed_options=parse_placed_options(args.placed_option),
            protect_static_prefix=args.static_prefix == "protected",
        )
        KVCacheManager(1, config.block_size, eviction_policy=config.eviction_policy)  # validates the name
        make_policy("placed", **dict(config.placed_options))  # validates the placed options
        profile = get_profile(config.profile)
        if args.host_gbps is not None:
            profile = replace(profile, host_copy_gbps=args.host_gbps)
        if args.disk_gbps is not None:
            profile = replace(profile, disk_read_gbps=args.disk_gbps)
    except ValueError as exc:
        p.error(str(exc))
    show = not args.no_progress

    t0 = time.perf_counter()
    traffic = make_traffic(config)
    main_results = [
        simulate(config, name, traffic, profile)
        for name in _progress(policies, len(policies), f"R={config.num_replicas}", show)
    ]
    main_wall = time.perf_counter() - t0

    sweep_cfg = replace(config, num_requests=min(args.sweep_requests, config.num_requests))
    sweep_traffic = make_traffic(sweep_cfg) if args.sweep_replicas or args.sweep_epsilons else None
    by_replicas: list[PolicyResult] = []
    reps = [int(s) for s in args.sweep_replicas.split(",") if s]
    jobs = [(r, name) for r in reps for name in policies]
    for r, name in _progress(jobs, len(jobs), "replica sweep", show):
        by_replicas.append(simulate(replace(sweep_cfg, num_replicas=r), name, sweep_traffic, profile))
    by_epsilon: list[PolicyResult] = []
    eps_list = [float(s) for s in args.sweep_epsilons.split(",") if s]
    for eps in _progress(eps_list, len(eps_list), "epsilon sweep", show):
        eps_cfg = replace(sweep_cfg, epsilon=eps, placed_epsilon=eps)
        by_epsilon.append(simulate(eps_cfg, args.sweep_policy, sweep_traffic, profile))

    what = f"{config.num_tenants} tenants" if config.workload == "tenants" else f"{config.workload} sessions"
    print(
        f"## Simulator: {config.num_replicas} replicas x {what} x "
        f"{config.num_requests} requests ({profile.name} profile; {profile.source})\n"
    )
    if config.workload == "tenants":
        shape = (
            f"prompts {config.system_prompt_len}+{config.question_len} tokens, {config.output_len} out; "
            f"Zipf s={config.zipf_s}, hot tenant +{config.hot_share:.0%}; offered utilization "
            f"{config.utilization} (all-miss)"
        )
    else:
        shape = (
            f"{config.workload} sessions (loadtest/conversations.py preset), {len(traffic.conv or ())} "
            f"requests; offered utilization {config.utilization} (each turn's new tokens)"
        )
    print(
        f"KV blocks per replica {config.blocks_per_replica} x {config.block_size} tokens; {shape}; "
        f"KV eviction {config.eviction_policy}, generated blocks {config.generated_blocks}, "
        f"static prefix {'protected' if config.protect_static_prefix else 'plain'}; "
        f"oracle hit rate {main_results[0].oracle_hit_rate:.1%}. "
        f"All policies simulated in {main_wall:.1f} s wall.\n"
    )
    print(render_table(main_results))
    if config.host_blocks_per_replica:
        print(
            f"\nKV tiers: {config.host_blocks_per_replica} host blocks per replica"
            f"{', one shared disk' if config.shared_disk else ''}; host copies {profile.host_copy_gbps:g} GB/s, "
            f"disk reads {profile.disk_read_gbps:g} GB/s, {profile.kv_bytes_per_token} KV bytes a token. "
            "Prompt tokens served by: "
            + "; ".join(
                f"{r.policy} host {(r.host_hit_tokens - r.disk_hit_tokens) / max(r.prompt_tokens, 1):.1%}, "
                f"disk {r.disk_hit_tokens / max(r.prompt_tokens, 1):.1%}"
                for r in main_results
            )
        )
    if by_replicas:
        print(f"\n### Sweep over replicas ({sweep_cfg.num_requests} requests)\n")
        print(render_table(by_replicas))
    if by_epsilon:
        print(
            f"\n### {args.sweep_policy} epsilon sweep at {sweep_cfg.num_replicas} replicas "
            f"({sweep_cfg.num_requests} requests)\n"
        )
        print(render_table(by_epsilon, baseline=None))

    out = write_json(
        args.out,
        {
            "config": asdict(config),
            "profile": asdict(profile),
            "main_wall_seconds": main_wall,
            "main": [asdict(r) for r in main_results],
            "sweep_replicas": [asdict(r) for r in by_replicas],
            "sweep_epsilon": [asdict(r) for r in by_epsilon],
        },
        announce=False,
    )
    if by_replicas and by_epsilon:
        plot(main_results, by_replicas, by_epsilon, Path(args.png))
    print(f"\nwrote {out}" + (f" and {args.png}" if by_replicas and by_epsilon else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
