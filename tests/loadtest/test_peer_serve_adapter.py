"""loadtest/peers/serve_adapter.py: the peer routers as Serve request routers.

No Ray cluster: the pure parts (request -> PeerRequest, the KV-event index, the
peer's candidates and policy) directly, and PeerRouter on Ray Serve's real
RequestRouter base class with fake replicas and a character tokenizer, its
requests going through the base class's own routing loop.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from prefixserve.loadtest.peers import PeerRequest
from prefixserve.loadtest.peers.serve_adapter import (
    MAX_BLOCKS_PER_KEY,
    KvEventIndex,
    PeerPolicy,
    PeerRouter,
    PeerServeReplica,
    PromptEncoder,
    peer_request,
    peer_view,
)
from prefixserve.replica.contract.kv_events import KVEventPublisher
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.kv.hashing import BlockHasher
from prefixserve.router.policies import Decision, Replica, ReplicaLoad
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.request_router import ServeReplicaView, replica_name

DEPLOYMENT = DeploymentID(name="Engine", app_name="peers")
BS = 4


class CharTokenizer:
    """One token per character; the chat template writes ``role:content|`` per message."""

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = True,
        return_dict: bool = False,
        add_generation_prompt: bool = False,
    ) -> list[int]:
        assert tokenize and not return_dict
        text = "".join(f"{m['role']}:{m['content']}|" for m in conversation)
        return self(text + ("assistant:" if add_generation_prompt else "")).input_ids


ENCODER = PromptEncoder(CharTokenizer())


def chat(system: str, user: str, **kwargs: Any) -> EngineRequest:
    return EngineRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}], **kwargs)


# --------------------------------------------------------------------------- the request


def test_encoder_tokenizes_as_the_engine_does():
    from prefixserve.replica.engine.input_processor import InputProcessor

    engine = SimpleNamespace(tokenizer=CharTokenizer(), chat_template=None, check_prompt_text=lambda text: None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ENCODER.encode(messages=messages) == InputProcessor.encode_chat(engine, messages)  # type: ignore[arg-type]
    assert ENCODER.encode(prompt="abc") == InputProcessor.tokenize(engine, "abc") == [97, 98, 99]  # type: ignore[arg-type]
    assert ENCODER.encode(prompt=[5, 6]) == [5, 6]
    with pytest.raises(ValueError):
        ENCODER.encode()


def test_encoder_renders_a_requests_tools_as_the_engine_does():
    """SmolLM2's template renders no tools: the engine renders a request with tools through the
    shipped tool template, and so does the encoder; the peers match the same tokens (and a
    different tool list is a different prompt)."""
    from model_helpers import _tokenizer_dir
    from tool_helpers import QUESTION, TOOLS, WEATHER
    from transformers import AutoTokenizer

    from prefixserve.replica.engine.input_processor import InputProcessor

    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
    engine = SimpleNamespace(tokenizer=tokenizer, chat_template=None)
    encoder = PromptEncoder(tokenizer)
    with_tools = encoder.encode(messages=QUESTION, tools=TOOLS)
    assert with_tools == InputProcessor.encode_chat(engine, QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    assert encoder.encode(messages=QUESTION) == InputProcessor.encode_chat(engine, QUESTION)  # type: ignore[arg-type]
    assert with_tools != encoder.encode(messages=QUESTION) != encoder.encode(messages=QUESTION, tools=[WEATHER])
    request = EngineRequest(messages=QUESTION, tools=TOOLS)
    assert peer_request(request, 0, 0.0, encoder, BlockHasher(), BS).tokens == tuple(with_tools)
    # The engine's --chat-template wins, with tools or without.
    configured = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    fixed = PromptEncoder(tokenizer, configured)
    engine.chat_template = configured
    assert fixed.encode(messages=QUESTION, tools=TOOLS) == InputProcessor.encode_chat(engine, QUESTION, tools=TOOLS)  # type: ignore[arg-type]


def test_peer_request_carries_tokens_contract2_hashes_and_the_key():
    hasher = BlockHasher()
    request = chat("system prompt", "question", routing_key="k1", cache_salt="s")
    req = peer_request(request, 7, 1.5, ENCODER, hasher, BS)
    tokens = ENCODER.encode(messages=request.messages)
    assert req.tokens == tuple(tokens) and req.index == 7 and req.now == 1.5 and req.block_size == BS
    assert req.key == "k1"
    assert list(req.block_hashes) == hasher.hash_blocks(tokens, BS, "s")
    assert len(req.block_hashes) == len(tokens) // BS
    unsalted = peer_request(chat("system prompt", "question"), 8, 0.0, ENCODER, hasher, BS)
    assert unsalted.key == "" and unsalted.tokens == req.tokens
    assert unsalted.block_hashes[0] != req.block_hashes[0]  # the salt is in block 0's hash
    text = peer_request(EngineRequest(prompt="abcdefgh"), 9, 0.0, ENCODER, hasher, BS)
    assert text.tokens == tuple(map(ord, "abcdefgh")) and len(text.block_hashes) == 2


# --------------------------------------------------------------------------- KV events


def test_kv_event_index_credits_the_leading_blocks_a_replicas_events_report():
    hasher = BlockHasher()
    a = hasher.hash_blocks(list(range(40)), BS)  # 10 blocks
    b = a[:6] + hasher.hash_blocks(list(range(24)) + [99] * 16, BS)[6:]  # shares 6 blocks with a
    index = KvEventIndex()
    index.remember("k", a)
    index.remember("k", b)  # the key's prefix narrows to the common run
    assert index.prefix("k") == a[:6]
    # The replica's publisher saw the same requests; its pool holds the first 4 blocks.
    pub = KVEventPublisher(snapshot_every=100)
    pub.remember("k", a)
    pub.remember("k", b)
    pool = set(a[:4])
    index.apply("r1", pub.publish(pool.__contains__))  # seq 1: a snapshot
    assert index.cached_blocks("r1", a) == 4 and index.cached_blocks("r1", b) == 4
    assert index.cached_blocks("r2", a) == 0  # no events from r2
    pool.update(a[4:6])
    index.apply("r1", pub.publish(pool.__contains__))  # a diff
    assert index.cached_blocks("r1", a) == 6
    pool.discard(a[0])
    index.apply("r1", pub.publish(pool.__contains__))
    assert index.cached_blocks("r1", a) == 0  # block 0 gone: nothing is hit
    index.forget("r1")
    assert index.cached_blocks("r1", a) == 0 and index.replicas() == []


def payload(seq: int, held: dict, snapshot: bool = False, epoch: str = "e1") -> dict:
    return {"format": 1, "epoch": epoch, "seq": seq, "snapshot": snapshot, "events": [], "held": held}


def test_a_snapshot_replaces_what_a_replica_held_and_old_payloads_are_ignored():
    index = KvEventIndex()
    index.remember("k", [b"1", b"2"])
    index.remember("j", [b"3"])
    assert index.apply("r", payload(1, {"k": [2, 2], "j": [1, 1]}, snapshot=True))
    assert index.cached_blocks("r", [b"1", b"2"]) == 2 and index.cached_blocks("r", [b"3"]) == 1
    assert index.apply("r", payload(2, {"j": [1, 1]}, snapshot=True))  # k is no longer listed
    assert index.cached_blocks("r", [b"1", b"2"]) == 0 and index.cached_blocks("r", [b"3"]) == 1
    assert not index.apply("r", payload(1, {"k": [2, 2]}, snapshot=True))  # older: ignored
    assert not index.apply("r", {"format": 99, "seq": 5, "held": {"k": [2, 2]}})  # unknown format
    assert index.cached_blocks("r", [b"1", b"2"]) == 0
    assert index.apply("r", payload(1, {"k": [1, 2]}, epoch="e2"))  # a new publisher: afresh
    assert index.cached_blocks("r", [b"1", b"2"]) == 1 and index.cached_blocks("r", [b"3"]) == 0


def test_a_diff_after_a_missed_report_still_updates_the_keys_it_lists():
    pub = KVEventPublisher(snapshot_every=100)
    index = KvEventIndex()
    k, j = [b"k1", b"k2"], [b"j1"]
    for key, hashes in (("k", k), ("j", j)):
        pub.remember(key, hashes)
        index.remember(key, hashes)
    pool = set(k)
    index.apply("r", pub.publish(pool.__contains__))
    pool |= set(j)
    pub.publish(pool.__contains__)  # the router misses this report (j stored)
    pool -= set(k)
    assert index.apply("r", pub.publish(pool.__contains__))  # after the gap: k removed
    assert index.cached_blocks("r", k) == 0  # the diff's own keys: their state now
    assert index.cached_blocks("r", j) == 0  # what only the missed report said stays unknown
    snap = KVEventPublisher(snapshot_every=1)  # the next snapshot tells everything again
    for key, hashes in (("k", k), ("j", j)):
        snap.remember(key, hashes)
    index.apply("r", {**snap.publish(pool.__contains__), "epoch": pub.epoch, "seq": 10})
    assert index.cached_blocks("r", j) == 1 and index.cached_blocks("r", k) == 0


def test_the_index_keeps_as_many_blocks_per_key_as_a_replica_reports():
    assert MAX_BLOCKS_PER_KEY == KVEventPublisher().max_blocks_per_key
    index = KvEventIndex(max_keys=2)
    index.remember("k", [bytes([i]) for i in range(100)])
    assert len(index.prefix("k")) == MAX_BLOCKS_PER_KEY
    index.remember("j", [b"j"])
    index.remember("i", [b"i"])
    assert index.prefix("k") == []  # the least recently seen key is forgotten


# --------------------------------------------------------------------------- candidates and policy


def test_peer_view_takes_the_reported_load_or_counts_own_requests_as_waiting():
    reported = ServeReplicaView(None, "a", 2, ReplicaLoad(num_waiting=5, num_running=1, kv_usage=0.7))
    view = peer_view(reported, num_gpu_blocks=64)
    assert view.load == ReplicaLoad(5, 1, 0.7) and view.in_flight == 2 and view.num_gpu_blocks == 64
    assert view.cached_blocks([b"x"]) == 0  # no index: nothing known cached
    assert peer_view(ServeReplicaView(None, "b", 3, None)).load == ReplicaLoad(num_waiting=3)


class CountingPeer:
    name = "counting"

    def __init__(self) -> None:
        self.routed: list[int] = []

    def route(self, candidates, request):  # noqa: ANN001, ANN201
        self.routed.append(request.index)
        return Decision(sorted(candidates, key=lambda c: c.name, reverse=True))

    def on_prefilled(self, replica: str, request: PeerRequest) -> None: ...

    def on_finish(self, replica: str, request: PeerRequest) -> None: ...


def test_peer_policy_routes_a_request_once_and_control_calls_by_load():
    peer = CountingPeer()
    policy = PeerPolicy(peer)  # type: ignore[arg-type]
    reps = [Replica("a", 0), Replica("b", 5), Replica("c", 1)]
    request = PeerRequest(0, (1, 2), (), "k", 0.0, BS)
    policy.expect("r0", request)
    assert [c.name for c in policy.rank(reps, "k").ranking] == ["c", "b", "a"]
    policy.expect("r0", request)  # Serve asks again for the same request: its first ranking, one route
    assert [c.name for c in policy.rank(reps[:2], "k").ranking] == ["b", "a"]
    assert peer.routed == [0]
    assert [c.name for c in policy.rank(reps, None).ranking] == ["a", "c", "b"]  # nothing expected: by load
    policy.forget("r0")
    policy.expect("r0", request)
    policy.rank(reps, "k")
    assert peer.routed == [0, 0]


# --------------------------------------------------------------------------- the Serve router


class FakeReplica:
    """RunningReplica's routing surface."""

    def __init__(self, unique_id: str) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.max_ongoing_requests = 16
        self.node_id = "node-1"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict = {}
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    @property
    def name(self) -> str:
        return replica_name(self.replica_id)


def make_router(peer: str, **kwargs: Any) -> PeerRouter:
    router = PeerRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True
    )
    router.initialize_state(peer=peer, block_size=BS, encoder=ENCODER, metrics=RouterMetrics(), **kwargs)
    return router


def pending(request: EngineRequest) -> PendingRequest:
    rid = uuid.uuid4().hex
    return PendingRequest(
        args=[request], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid, is_streaming=True)
    )


async def send(router: PeerRouter, request: PendingRequest) -> FakeReplica:
    """Route one request through the base class's loop, as Serve's Router does, and mark it routed."""
    replica = await asyncio.wait_for(router._choose_replica_for_request(request), timeout=10)
    router.on_request_routed(request, replica.replica_id, result=None)
    return replica


def stats(seq: int, waiting: int = 0, running: int = 0, kv_usage: float = 0.0, **extra: Any) -> dict:
    return {
        "seq": seq,
        "num_waiting": waiting,
        "num_running": running,
        "kv_usage": kv_usage,
        "queued_prefill_tokens": 0,
        **extra,
    }


def two_replicas(router: PeerRouter) -> list[FakeReplica]:
    reps = [FakeReplica("aaaa"), FakeReplica("bbbb")]
    router.update_replicas(reps)
    return reps


async def test_sglang_tree_sends_a_shared_prefix_back_to_its_replica():
    router = make_router("sglang_tree")
    two_replicas(router)
    first = await send(router, pending(chat("a long shared system prompt", "one")))
    other = await send(router, pending(chat("something else entirely", "two")))
    assert other.name != first.name  # no match: the replica with the smaller tree
    again = await send(router, pending(chat("a long shared system prompt", "three")))
    assert again.name == first.name
    assert router.peer.tree.sizes[first.name] > 0  # type: ignore[attr-defined]
    counted = router._metrics.registry.get_sample_value(
        "prefixserve_router_requests_total", {"deployment": "Engine", "policy": "sglang_tree", "replica": first.name}
    )
    assert counted == 2


async def test_llmd_reads_queue_and_kv_usage_from_the_replicas_reports():
    router = make_router("llmd", num_gpu_blocks=64)
    a, b = two_replicas(router)
    a.routing_stats = stats(1, waiting=6, kv_usage=0.9)
    b.routing_stats = stats(1, waiting=0, kv_usage=0.1)
    assert (await send(router, pending(chat("sys", "q1")))).name == b.name
    assert router.peer.index.holders  # type: ignore[attr-defined]  # the prefix index learned the request
    a.routing_stats = stats(2, waiting=0, kv_usage=0.1)
    b.routing_stats = stats(2, waiting=6, kv_usage=0.9)
    assert (await send(router, pending(chat("other", "q2")))).name == a.name
    view = router.view(a)
    assert view.num_gpu_blocks == 64 and view.load.kv_usage == pytest.approx(0.1)


async def test_dynamo_credits_blocks_the_kv_events_report_and_learns_prefill_and_finish():
    router = make_router("dynamo")
    a, b = two_replicas(router)
    system = "a system prompt long enough for several blocks"
    first = pending(chat(system, "one", routing_key="k"))
    landed = await send(router, first)
    peer = router.peer
    assert peer._prefill[landed.name] > 0  # type: ignore[attr-defined]  # queued prefill tokens
    # The ingress reports the first token of a request of key k: its prefill leaves the queue.
    router.observe("k", prompt_tokens=60, cached_tokens=0)
    assert peer._prefill[landed.name] == 0  # type: ignore[attr-defined]
    router.on_request_completed(landed.replica_id, first.metadata.internal_request_id)
    assert not peer._blocks[landed.name]  # type: ignore[attr-defined]  # finished: no active blocks
    assert router.in_flight(landed) == 0
    # The other replica's KV events say it holds the key's prefix: Dynamo's overlap sends k there.
    other = b if landed is a else a
    hashes = router.index.prefix("k")
    pub = KVEventPublisher()
    pub.remember("k", hashes)
    other.routing_stats = stats(1, kv_events=pub.publish(set(hashes).__contains__))
    second = await send(router, pending(chat(system, "two", routing_key="k")))
    assert second is other
    # The key's prefix narrowed to what both requests share; the replica is credited with exactly that.
    assert router.view(other).cached_blocks(hashes) == len(router.index.prefix("k")) > 0


async def test_a_request_finished_without_a_first_token_report_is_prefilled_then_finished():
    router = make_router("dynamo")
    two_replicas(router)
    request = pending(chat("no key here", "q"))
    landed = await send(router, request)
    router.on_request_completed(landed.replica_id, "some-rejected-attempt")  # not this request
    assert router.peer._prefill[landed.name] > 0  # type: ignore[attr-defined]
    router.on_request_completed(landed.replica_id, request.metadata.internal_request_id)
    assert router.peer._prefill[landed.name] == 0  # type: ignore[attr-defined]
    assert not router.peer._pending  # type: ignore[attr-defined]


async def test_control_calls_route_by_load_without_the_peer():
    router = make_router("sglang_tree")
    reps = two_replicas(router)
    control = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="c", internal_request_id="c"))
    tiers = await router.choose_replicas(reps, control)
    assert sorted(t[0].name for t in tiers) == sorted(r.name for r in reps)
    assert router.peer.tree.sizes == {}  # type: ignore[attr-defined]


def test_unknown_peer_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown peer"):
        make_router("nope")
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        make_router("llmd", num_gpu_blocks=0)


def test_candidates_satisfy_the_peer_interface():
    view = PeerServeReplica(None, "r", 1, ReplicaLoad(), KvEventIndex(), 8)
    assert (view.name, view.in_flight, view.num_gpu_blocks, view.cached_blocks([b"h"])) == ("r", 1, 8, 0)


# --------------------------------------------------------------------------- a real cluster


@pytest.mark.slow
def test_bench_cluster_runs_the_peer_routers_on_a_local_cluster(tmp_path):
    import json

    from model_helpers import tiny_checkpoint
    from server_helpers import free_port

    from prefixserve.loadtest import bench_cluster as B

    model = tiny_checkpoint(tmp_path / "tiny", seed=5)
    out = tmp_path / "out"
    policies = list(B.PEER_POLICIES)
    small = "--tenants 4 --requests 12 --system-len 48 --question-len 8 --output-len 4 --concurrency 2 --seed 5"
    where = ["--port", str(free_port()), "--out-dir", str(out), "--timeout", "300"]
    code = B.main(["--model", str(model), "--policies", ",".join(policies), *small.split(), *where])
    data = json.loads((out / "bench_cluster.json").read_text())
    assert data["failures"] == {} and code == 0
    assert [r["policy"] for r in data["results"]] == policies
    for r in data["results"]:
        # Every request was routed by the peer (a router that failed would fail the requests) and served.
        assert r["succeeded"] == r["requests"] == 12, r["errors"]
        assert r["routed"] == 12  # the router counted every request under the peer's name
        assert sum(v["requests"] for v in r["replicas"].values()) == 12
        assert r["hit_rate"] is not None and 0.0 <= r["hit_rate"] <= 1.0
        if r["preemptions"] == 0:
            assert r["hit_rate"] <= data["oracle_hit_rate"] + 0.02
        assert r["cached_token_ratio"] == pytest.approx(r["hit_rate"], abs=0.02)
