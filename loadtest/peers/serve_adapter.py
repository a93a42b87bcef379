"""The peer routers of loadtest/peers as Ray Serve request routers on our engine deployment.

Job: run any peer model (``make_peer``: sglang_tree, ray_prefix, llmd, dynamo)
inside our Serve app, the way router/serve/request_router.py runs our own policies, so
that bench_cluster compares them on a real cluster. :class:`PeerRouter` is a
``PrefixRouter`` whose policy is the peer: it keeps that router's bookkeeping
(own in-flight counts, replica reports, KV-event consumer, metrics, tiers and
back-off, registration for the ingress) and hands the peer the signals a real
deployment of that router has. The peers follow their sources (cited in each
module): sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` and
``tree.rs`` (peers/sglang.py); ray-project/ray 2.60 ``prefix_aware_router.py``
(peers/ray_prefix.py); kubernetes-sigs/gateway-api-inference-extension's EPP
scorers with llm-d's weights 3/2/2 (peers/llmd.py); ai-dynamo/dynamo
``lib/kv-router/src/scheduling/selector.rs`` (peers/dynamo.py).

Signals, per request and candidate (:class:`PeerServeReplica`):

* prompt tokens: the engine call's first argument is replica/engine/request_runner.py's
  ``EngineRequest``; its ``messages`` go through the served model's chat
  template (with the request's ``tools``), a text ``prompt`` through its tokenizer,
  exactly as the engine does (:class:`PromptEncoder`; the tokenizer loads when the router starts, which
  holds the router's event loop for seconds once, before it knows any replica,
  and encoding runs in a worker thread). All four peers match these
  tokens (SGLang and Ray match characters; peers/*.py say why tokens are the
  same policy);
* block hashes: Contract 2 (replica/kv/hashing.py ``BlockHasher``) over the
  tokens with the request's ``cache_salt``, the engine's block size and hash
  algorithm (router kwargs): llm-d's prefix index and Dynamo's overlap use them;
* ``in_flight``: this router's own count of requests routed and not completed
  (sglang_tree's and ray_prefix's load counter, as the real routers count);
* ``load``: the replica's routing-stats report corrected by the router's own
  change since (router/serve/request_router.py ``corrected_load``), for llm-d's queue
  (``num_waiting``) and KV-utilization scorers; with no recent report, the own
  in-flight requests count as waiting. Reports are up to ``stats_period_s``
  (1 s) old where EPP scrapes every 50 ms;
* ``cached_blocks`` (Dynamo's overlap): a :class:`KvEventIndex` fed by the
  replicas' KV events (replica/contract/kv_events.py). Approximated: those events
  track each routing key's static-prefix blocks (at most 32 per key), not
  every block as Dynamo's KvIndexer does, so blocks beyond a key's static
  prefix (conversation history) are never credited; the index learns a
  key's hashes from the requests it routed and the replica's ``held``
  summary says how many leading ones the replica holds; events arrive with
  the routing stats (about 1 s late where Dynamo's arrive in milliseconds),
  and a report the router missed leaves what only it changed unknown until
  the next snapshot (:class:`KvEventIndex`);
* ``num_gpu_blocks`` (llm-d's LRU capacity per pod, which EPP reads from the
  pod's metrics): the ``num_gpu_blocks`` router kwarg (the deployer knows the
  engine's pool size; the routing stats do not carry it);
* ``on_prefilled`` (Dynamo: the request's prefill tokens leave the worker's
  queue at its first token). Approximated: a Serve request router does not
  see the response stream; the ingress reports each keyed request's first
  token to its router (``observe(key, ...)``, router/serve/ingress.py) but names
  only the routing key, so the first token is credited to the oldest routed,
  not yet prefilled request of that key. A request the ingress does not
  report (no routing key) counts as prefilled when it completes;
* ``on_finish``: Serve's ``on_request_completed`` for the replica that
  accepted the request (the end of its stream).

Limits: Serve asking again for a request whose tiers were all full gets the
peer's first ranking again (the peer routes a request once, as the real
routers do); a request cancelled before any replica accepted it is never
finished in the peer's books (Dynamo keeps counting its blocks as active).

Configuration (``RequestRouterConfig.request_router_kwargs``; router/serve/app.py's
``router: {router_class: "prefixserve.loadtest.peers.serve_adapter:PeerRouter",
kwargs: {...}}``): ``peer`` (a name of loadtest/peers), ``model`` (the served
model, for its tokenizer), ``chat_template`` (the engine's ``--chat-template`` file, if
any), ``block_size`` and ``hash_algo`` (the engine's),
``num_gpu_blocks``, ``seed``, and ``stats_max_age_s``.

Imports Ray Serve (through router/serve/request_router.py); router/ never imports this module.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from prefixserve.loadtest.peers import Peer, PeerRequest, make_peer
from prefixserve.replica.contract.kv_events import KV_EVENTS_FORMAT
from prefixserve.replica.kv.hashing import DEFAULT_HASH_ALGO, BlockHasher
from prefixserve.router.policies import Decision, ReplicaLoad, ReplicaView, by_load
from prefixserve.router.serve.request_router import PrefixRouter, ServeReplicaView, is_generation, replica_name

# Import path for RequestRouterConfig(request_router_class=...) / router/serve/app.py's router_class.
PEER_ROUTER_CLASS_PATH = "prefixserve.loadtest.peers.serve_adapter:PeerRouter"
# replica/contract/kv_events.py KVEventPublisher's max_blocks_per_key default: the most prefix blocks a replica
# reports per key.
MAX_BLOCKS_PER_KEY = 32
# Bounds on the router's memories (keys' prefix hashes; requests between routing and completion).
MAX_KEYS = 4096
MAX_TRACKED_REQUESTS = 10_000

V = TypeVar("V", bound=ReplicaView)


# --------------------------------------------------------------------------- the request


class Tokenizer(Protocol):
    """The part of a transformers tokenizer the encoder uses."""

    def __call__(self, text: str) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class PromptEncoder:
    """A request's prompt token ids, as the engine computes them (replica/engine/input_processor.py
    ``encode_chat``, ``tokenize``).

    A chat request's ``tools`` render through the chat template before the conversation, as
    the engine renders them (the model's template, or the shipped tool template for a model
    whose template renders none; ``chat_template``, the engine's ``--chat-template`` text,
    wins): they are part of the prompt the engine caches, and so of what the peers match.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def load(cls, model: str, chat_template: str | None = None) -> PromptEncoder:
        """The encoder of ``model`` (a short name, checkpoint directory or .gguf), as the engine loads its
        tokenizer; ``chat_template``: the engine's ``--chat-template`` file, if it has one."""
        from prefixserve.replica.model import loader
        from prefixserve.replica.tool_calling.templates import load_chat_template

        template = load_chat_template(chat_template) if chat_template is not None else None
        return cls(loader.load_tokenizer(loader.resolve(model)), template)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation (and its ``tools``) through the chat template, generation prompt added."""
        from prefixserve.replica.tool_calling.templates import template_for

        kwargs: dict[str, Any] = {"add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        template = template_for(getattr(self.tokenizer, "chat_template", None), self.chat_template, bool(tools))
        if template is not None:
            kwargs["chat_template"] = template
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))

    def encode(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` with ``tools`` (chat) or ``prompt`` (text or ids)."""
        if messages is not None:
            return self.encode_chat(messages, tools)
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if prompt is None:
            raise ValueError("encode needs a prompt or messages")
        return [int(t) for t in prompt]


def peer_request(
    request: Any, index: int, now: float, encoder: PromptEncoder, hasher: BlockHasher, block_size: int
) -> PeerRequest:
    """The PeerRequest of an engine call's first argument (an ``EngineRequest``): tokens, hashes, key.

    Blocking (tokenizer and hashing): callers on an event loop run it in a thread.
    """
    tokens = encoder.encode(
        prompt=getattr(request, "prompt", None),
        messages=getattr(request, "messages", None),
        tools=getattr(request, "tools", None),
    )
    salt = getattr(request, "cache_salt", None)
    hashes = hasher.hash_blocks(tokens, block_size, salt or None)
    key = getattr(request, "routing_key", None)
    return PeerRequest(
        index=index,
        tokens=tuple(tokens),
        block_hashes=tuple(hashes),
        key=key if isinstance(key, str) else "",
        now=now,
        block_size=block_size,
    )


# --------------------------------------------------------------------------- what replicas hold


class KvEventIndex:
    """Which leading prompt blocks each replica holds, from its KV events (Dynamo's KvIndexer's role).

    A key's prefix hashes are learned from the requests routed with that key
    (``remember``: the common leading run of their block hashes, as the
    replica's publisher narrows it); a replica's ``held`` summaries
    (``{key: [leading, total]}``) say how many of them, from block 0, it holds.
    The replica's publisher only saw requests this router sent, so the
    router's run is a prefix of the replica's and its first ``leading``
    hashes are held.

    A ``held`` summary is absolute (the key's state at that publish), so every
    payload newer than the last one taken in is applied, also after a gap
    (routers miss reports often: Serve delivers the latest routing stats, not
    each one): it gives the keys it lists their current state, and the keys
    that only the missed payloads changed keep their last known state until
    the next snapshot (every ``snapshot_every`` publishes) replaces them all.
    This approximates Dynamo's lossless event stream with the latest known
    state, as router/serve/request_router.py's consumer (for ``placed``) does. Older or
    repeated payloads are ignored; a new epoch (a new publisher) starts the
    replica afresh.
    """

    def __init__(self, max_keys: int = MAX_KEYS, max_blocks: int = MAX_BLOCKS_PER_KEY) -> None:
        self.max_keys = max_keys
        self.max_blocks = max_blocks
        self._prefix: OrderedDict[str, list[bytes]] = OrderedDict()
        self._leading: dict[str, dict[str, int]] = {}  # replica -> key -> leading blocks held
        self._held: dict[str, frozenset[bytes]] = {}  # replica -> hashes held
        self._last: dict[str, tuple[str, int]] = {}  # replica -> (epoch, seq) taken in

    def remember(self, key: str, hashes: Sequence[bytes]) -> None:
        """A request of ``key`` whose prompt's leading full-block hashes are ``hashes``."""
        if not key:
            return
        hashes = list(hashes[: self.max_blocks])
        known = self._prefix.get(key)
        if known is None:
            if hashes:
                self._prefix[key] = hashes
                while len(self._prefix) > self.max_keys:
                    self._prefix.popitem(last=False)
            return
        self._prefix.move_to_end(key)
        n = 0
        for a, b in zip(known, hashes):
            if a != b:
                break
            n += 1
        del known[n:]

    def prefix(self, key: str) -> list[bytes]:
        return list(self._prefix.get(key, ()))

    def apply(self, replica: str, payload: Mapping[str, Any]) -> bool:
        """Take in one KV-event payload of ``replica`` (replica/contract/kv_events.py); False when it is not newer."""
        if payload.get("format") != KV_EVENTS_FORMAT:
            return False
        epoch, seq = str(payload.get("epoch")), int(payload.get("seq", 0))
        last = self._last.get(replica)
        if last is not None and last[0] == epoch and seq <= last[1]:
            return False
        self._last[replica] = (epoch, seq)
        held = payload.get("held") or {}
        fresh = payload.get("snapshot") or last is None or last[0] != epoch
        leading = {} if fresh else self._leading.setdefault(replica, {})
        for key, summary in held.items():
            n = int(summary[0])
            if n > 0:
                leading[str(key)] = n
            else:
                leading.pop(str(key), None)
        self._leading[replica] = leading
        self._held[replica] = frozenset(h for key, n in leading.items() for h in self._prefix.get(key, ())[:n])
        return True

    def cached_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``replica`` holds, as its events said."""
        held = self._held.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def replicas(self) -> list[str]:
        """The replicas whose events were taken in."""
        return list(self._leading)

    def forget(self, replica: str) -> None:
        self._leading.pop(replica, None)
        self._held.pop(replica, None)
        self._last.pop(replica, None)


# --------------------------------------------------------------------------- candidates and policy


@dataclass(frozen=True)
class PeerServeReplica:
    """A candidate as a peer sees it (loadtest/peers ``PeerReplica``): name, own in-flight, load, held blocks."""

    replica: Any  # RunningReplica (or a test double)
    name: str
    in_flight: int
    load: ReplicaLoad
    index: KvEventIndex | None = None
    num_gpu_blocks: int | None = None

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return 0 if self.index is None else self.index.cached_blocks(self.name, block_hashes)


def peer_view(
    view: ServeReplicaView, index: KvEventIndex | None = None, num_gpu_blocks: int | None = None
) -> PeerServeReplica:
    """The peer's candidate for a router view: its reported load, or (no recent report) its own in-flight as waiting."""
    load = view.load if view.load is not None else ReplicaLoad(num_waiting=view.in_flight)
    return PeerServeReplica(view.replica, view.name, view.in_flight, load, index, num_gpu_blocks)


class PeerPolicy:
    """A peer behind router/policies/base.py's Policy interface, for PrefixRouter to run.

    ``expect(request_id, request)`` names the request the next ``rank`` is for;
    ``rank`` hands it to the peer once per request id (asked again, it returns
    the first ranking, over the candidates still offered). A ``rank`` with no
    request expected (a control call, no prompt) ranks by load.
    """

    def __init__(self, peer: Peer, max_requests: int = MAX_TRACKED_REQUESTS) -> None:
        self.peer = peer
        self.max_requests = max_requests
        self._next: tuple[str, PeerRequest] | None = None
        self._rankings: OrderedDict[str, list[str]] = OrderedDict()

    @property
    def name(self) -> str:
        return self.peer.name

    def expect(self, request_id: str | None, request: PeerRequest | None) -> None:
        self._next = None if request_id is None or request is None else (request_id, request)

    def rank(self, candidates: Sequence[V], key: str | None) -> Decision[V]:
        if not candidates:
            raise ValueError("a routing policy needs at least one candidate replica")
        current, self._next = self._next, None
        if current is None:
            return Decision(by_load(candidates))
        request_id, request = current
        names = self._rankings.get(request_id)
        if names is not None:
            order = {name: i for i, name in enumerate(names)}
            known = sorted((c for c in candidates if c.name in order), key=lambda c: order[c.name])
            return Decision(known + by_load([c for c in candidates if c.name not in order]))
        decision = self.peer.route(candidates, request)  # type: ignore[arg-type]  # candidates are PeerReplicas
        self._rankings[request_id] = [c.name for c in decision.ranking]
        while len(self._rankings) > self.max_requests:
            self._rankings.popitem(last=False)
        return Decision(list(decision.ranking))  # type: ignore[arg-type]

    def forget(self, request_id: str) -> None:
        self._rankings.pop(request_id, None)


# --------------------------------------------------------------------------- the Serve router


@dataclass
class _Tracked:
    """A request between its routing and its completion."""

    request: PeerRequest
    replica: ReplicaID | None = None  # the replica that accepted it
    prefilled: bool = False


class PeerRouter(PrefixRouter):
    """A PrefixRouter whose policy is a loadtest/peers model (see the module docstring for its signals)."""

    def initialize_state(  # type: ignore[override]
        self,
        peer: str = "sglang_tree",
        model: str = "smollm2",
        block_size: int = 16,
        hash_algo: str = DEFAULT_HASH_ALGO,
        num_gpu_blocks: int | None = None,
        seed: int = 0,
        chat_template: str | None = None,
        encoder: PromptEncoder | None = None,
        **router_options: Any,
    ) -> None:
        """``router_options``: PrefixRouter's own (``stats_max_age_s``, ``metrics``, ``tracer``,
        ``otlp_traces_endpoint``); ``encoder``: a ready PromptEncoder (tests) instead of loading ``model``'s."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_gpu_blocks is not None and num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 or None, got {num_gpu_blocks}")
        super().initialize_state(policy="round_robin", **router_options)
        self._peer_policy = PeerPolicy(make_peer(peer, seed))
        self._policy = self._peer_policy  # PrefixRouter runs it (and labels its metrics with the peer's name)
        self._block_size = int(block_size)
        self._hasher = BlockHasher(hash_algo)
        self._num_gpu_blocks = num_gpu_blocks
        self._index = KvEventIndex()
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()
        self._next_index = 0
        # Loaded before the router serves (seconds, once), as a real router loads its tokenizer at
        # start-up: the router's replica view, which a deployment waits for, comes after it.
        self._encoder = encoder if encoder is not None else PromptEncoder.load(model, chat_template)

    @property
    def peer(self) -> Peer:
        return self._peer_policy.peer

    @property
    def index(self) -> KvEventIndex:
        return self._index

    def view(self, replica: RunningReplica) -> PeerServeReplica:  # type: ignore[override]
        return peer_view(super().view(replica), self._index, self._num_gpu_blocks)

    async def _peer_request(self, request_id: str, request: Any) -> PeerRequest:
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                return tracked.request
            index = self._next_index
            self._next_index += 1
        now = time.monotonic()
        req = await asyncio.to_thread(peer_request, request, index, now, self._encoder, self._hasher, self._block_size)
        with self._lock:
            self._tracked[request_id] = _Tracked(req)
            while len(self._tracked) > MAX_TRACKED_REQUESTS:
                self._tracked.popitem(last=False)
            self._index.remember(req.key, req.block_hashes)
        return req

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request_id: str | None = None
        request: PeerRequest | None = None
        if candidate_replicas and pending_request is not None and is_generation(pending_request):
            request_id = pending_request.metadata.internal_request_id
            request = await self._peer_request(request_id, pending_request.args[0])
        # PrefixRouter.choose_replicas ranks without awaiting anything, so no other
        # request's choice can run between ``expect`` and the ``rank`` it is for.
        with self._lock:
            self._peer_policy.expect(request_id, request)
        try:
            return await super().choose_replicas(candidate_replicas, pending_request)
        finally:
            with self._lock:
                self._peer_policy.expect(None, None)

    # -- KV events, prefill and completion ------------------------------------------------
    def _take_kv_events(self, name: str, payload: Any) -> None:
        super()._take_kv_events(name, payload)
        if isinstance(payload, Mapping):
            with self._lock:
                self._index.apply(name, payload)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        with self._lock:
            tracked = self._tracked.get(pending_request.metadata.internal_request_id)
            if tracked is not None:
                tracked.replica = replica_id

    def observe(self, key: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The ingress saw the first token of a request of ``key``: the oldest such request is prefilled."""
        super().observe(key, prompt_tokens, cached_tokens)
        with self._lock:
            for tracked in self._tracked.values():
                if tracked.replica is not None and not tracked.prefilled and tracked.request.key == key:
                    tracked.prefilled = True
                    self.peer.on_prefilled(replica_name(tracked.replica), tracked.request)
                    return

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        with self._lock:
            tracked = self._tracked.get(internal_request_id)
            if tracked is None or tracked.replica != replica_id:
                return  # not ours, or a rejected attempt (the request goes on elsewhere)
            del self._tracked[internal_request_id]
            self._peer_policy.forget(internal_request_id)
            name = replica_name(replica_id)
            if not tracked.prefilled:
                self.peer.on_prefilled(name, tracked.request)
            self.peer.on_finish(name, tracked.request)

    def _forget_departed(self) -> None:
        super()._forget_departed()
        if hasattr(self, "_index"):  # the base class calls this before initialize_state ran
            live = {replica_name(r) for r in self.curr_replicas}
            for name in [n for n in self._index.replicas() if n not in live]:
                self._index.forget(name)
