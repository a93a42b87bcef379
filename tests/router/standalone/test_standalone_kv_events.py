"""The standalone router reading its replicas' KV events (``--kv-events``): the settings, the prompt's
token ids, the decision fed by the index, and the whole path over real HTTP and ZMQ (our replica's
publisher in this process, fake upstream replicas).

The tokenizer is a small word-level one written here with the ``tokenizers`` library (one id per
word), with a chat template, so the tests load no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from kv_helpers import block_stored
from server_helpers import free_port, metric
from standalone_router_helpers import FakeReplica, RouterServerThread, ServerThread, wait_until

from prefixserve.replica.contract.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    encode_batch,
)
from prefixserve.replica.engine.kv_event_publisher import ZmqKVEventPublisher
from prefixserve.replica.kv.hashing import hash_blocks
from prefixserve.router.kv_index import EventSource, KVEventIndex, ZmqKVEventSubscriber, vllm_block_hashes
from prefixserve.router.policies import make_policy
from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import prefix_hash
from prefixserve.router.standalone.cli import add_arguments
from prefixserve.router.standalone.config import StandaloneRouterConfig, parse_kv_events
from prefixserve.router.standalone.kv_events import KVEventHints, block_hasher, event_sources
from prefixserve.router.standalone.prompt_tokens import PromptTokenizer
from prefixserve.router.standalone.proxy import StandaloneRouter
from prefixserve.router.standalone.replica_set import ReplicaSet
from prefixserve.router.standalone.routing import StandaloneRouting

HEADER = "X-Prefixserve-Replica"
WORDS = [f"w{i}" for i in range(400)]
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer folder: ``tokenizer.json`` and a chat template in ``tokenizer_config.json``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", ":", "system", "user", "assistant", *WORDS])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))
    return folder


def words(start: int, n: int) -> str:
    return " ".join(WORDS[start : start + n])


def chat(system: str | None, user: str, model: str = "m") -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": 2}


def owned_by(owner: str, names: list[str]) -> str:
    """A system prompt (made of the tokenizer's words) whose routing key the ring gives to ``owner``."""
    ring = HashRing([RingServer(n) for n in names])
    return next(s for s in (words(i, 3) for i in range(300)) if ring.owner(prefix_hash(s)) == owner)


# -- settings -------------------------------------------------------------------------------------


def test_a_kv_events_value_names_a_replica_and_its_publisher() -> None:
    urls = {"a:1": "http://a:1", "b:2": "http://b:2"}
    spec = parse_kv_events("http://b:2=tcp://b:5557,tcp://b:5558", urls)
    assert (spec.replica, spec.endpoint, spec.replay_endpoint) == ("b:2", "tcp://b:5557", "tcp://b:5558")
    assert parse_kv_events("http://a:1/=tcp://a:5557", urls).replay_endpoint is None
    for bad in (
        "http://c:3=tcp://c:5557",
        "http://a:1",
        "http://a:1=",
        "http://a:1=http://a:5557",
        "http://a:1=tcp://*:5557",
    ):
        with pytest.raises(ValueError):
            parse_kv_events(bad, urls)


def test_kv_events_need_placed_a_tokenizer_and_distinct_replicas(tokenizer_dir: Path) -> None:
    base: dict[str, Any] = {"replicas": ["http://a:1", "http://b:2"], "tokenizer": str(tokenizer_dir)}
    config = StandaloneRouterConfig(**base, kv_events=["http://a:1=tcp://a:5557"])
    assert config.policy_options["precise"] is True
    assert [s.replica for s in event_sources(config)] == ["a:1"]
    assert "precise" not in StandaloneRouterConfig(replicas=["http://a:1"]).policy_options
    with pytest.raises(ValueError, match="placed"):
        StandaloneRouterConfig(**base, kv_events=["http://a:1=tcp://a:5557"], policy="consistent_hash")
    with pytest.raises(ValueError, match="tokenizer"):
        StandaloneRouterConfig(replicas=base["replicas"], kv_events=["http://a:1=tcp://a:5557"])
    with pytest.raises(ValueError, match="twice"):
        StandaloneRouterConfig(**base, kv_events=["http://a:1=tcp://a:5557", "http://a:1=tcp://a:6000"])
    with pytest.raises(ValueError, match="kv_events_hash"):
        StandaloneRouterConfig(**base, kv_events_hash="md5")


def test_the_cli_takes_the_kv_event_flags(tokenizer_dir: Path) -> None:
    import argparse

    from prefixserve.common.config_util import from_cli_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--replica", "http://a:1", "--replica", "http://b:2",
            "--kv-events", "http://a:1=tcp://a:5557,tcp://a:5558", "--kv-events", "http://b:2=tcp://b:5557",
            "--kv-events-block-size", "32", "--kv-events-hash", "vllm", "--tokenizer", str(tokenizer_dir),
        ]
    )  # fmt: skip
    config = from_cli_args(StandaloneRouterConfig, args)
    assert [s.replica for s in config.kv_event_specs] == ["a:1", "b:2"]
    assert (config.kv_events_block_size, config.kv_events_hash) == (32, "vllm")


# -- prompt tokens and hashes ------------------------------------------------------------------------


def test_a_chat_is_rendered_by_its_template_and_its_static_prefix_counted(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    ids = [1, 4, 3, 7, 8, 2, 1, 5, 3, 9, 2, 1, 6, 3]  # <s> system : w0 w1 </s> <s> user : w2 </s> <s> assistant :
    got = tok.of_body(chat("w0 w1", "w2"))
    assert got is not None and got.ids == ids and got.static_tokens == 6
    assert tok.of_body(chat(None, "w2")) == tok.chat([{"role": "user", "content": "w2"}])
    assert tok.of_body(chat(None, "w2")).static_tokens == 0  # type: ignore[union-attr]
    assert tok.of_body({"prompt": "w0 w1"}).ids == [7, 8]  # type: ignore[union-attr]
    assert tok.of_body({"prompt": [5, 6, 7]}).ids == [5, 6, 7]  # type: ignore[union-attr]
    # What the router cannot tell the replica's tokens of: no hint rather than a wrong one.
    unreadable = [
        {"messages": []},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {**chat(None, "w2"), "tools": [{"type": "function"}]},
        {"prompt": [1, "x"]},
        "text",
        None,
    ]
    for body in unreadable:
        assert tok.of_body(body) is None


def test_the_hash_schemes_are_the_replicas() -> None:
    ids = list(range(100, 140))
    assert block_hasher("prefixserve", 16)(ids) == hash_blocks(ids, 16) == hash_blocks(ids, 16, algo="sha256")
    assert block_hasher("prefixserve-sha256", 16)(ids) == hash_blocks(ids, 16, algo="sha256")
    assert block_hasher("prefixserve-xxh3_128", 16)(ids) == hash_blocks(ids, 16, algo="xxh3_128")
    assert block_hasher("vllm", 16)(ids) == vllm_block_hashes(ids, 16)
    assert block_hasher("vllm", 16, "42")(ids) == vllm_block_hashes(ids, 16, seed="42")
    with pytest.raises(ValueError):
        block_hasher("md5", 16)


# -- the decision ---------------------------------------------------------------------------------


def routing_with_events(tokenizer_dir: Path, names: list[str]) -> tuple[StandaloneRouting, KVEventHints]:
    tok = PromptTokenizer(tokenizer_dir)
    hints = KVEventHints(tok.of_body, block_hasher("prefixserve", BLOCK), BLOCK, KVEventIndex(10_000))
    replicas = ReplicaSet({n: f"http://{n}" for n in names})
    return StandaloneRouting(make_policy("placed", precise=True), replicas, hints=hints), hints


def stored_by(hints: KVEventHints, replica: str, body: Any, blocks: int | None = None) -> None:
    """The events of ``replica`` say it holds the first ``blocks`` (all) blocks of ``body``'s prompt."""
    got = hints.blocks(body)
    assert got is not None
    hashes = got.hashes[:blocks] if blocks is not None else got.hashes
    hints.index.apply(replica, KVEventBatch(ts=0.0, events=[block_stored(list(hashes))]))


def test_the_replica_the_events_say_holds_the_prompt_gets_it(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    body = chat(owned_by("a:1", names), words(20, 12))
    stored_by(hints, "b:2", body)
    plan = routing.plan(body, {}, token_blocks=hints.blocks(body))
    assert plan.first == "b:2" and plan.event_matched
    routing.finished(plan)
    # Without the events the key's owner would have had it.
    plain, plain_hints = routing_with_events(tokenizer_dir, names)
    plan = plain.plan(body, {}, token_blocks=plain_hints.blocks(body))
    assert plan.first == "a:1" and not plan.event_matched


def test_the_longest_held_prefix_wins(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2", "c:3"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    body = chat(owned_by("a:1", names), words(40, 20))
    stored_by(hints, "b:2", body, blocks=3)
    stored_by(hints, "c:3", body, blocks=5)
    assert routing.plan(body, {}, token_blocks=hints.blocks(body)).first == "c:3"


def test_blocks_the_events_say_are_gone_stop_counting_at_once(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    body = chat(owned_by("a:1", names), words(160, 12))
    stored_by(hints, "b:2", body)
    plan = routing.plan(body, {}, token_blocks=hints.blocks(body))
    assert plan.first == "b:2"
    routing.finished(plan)
    got = hints.blocks(body)
    assert got is not None
    hints.index.apply("b:2", KVEventBatch(ts=0.0, events=[BlockRemoved(list(got.hashes), "GPU")]))
    plan = routing.plan(body, {}, token_blocks=got)
    assert not plan.event_matched  # only the router's own record of what it sent b:2 is left
    routing.finished(plan)
    # A prompt the router never sent: held while b:2's events say so, not once they clear it.
    ring = HashRing([RingServer(n) for n in names])
    system = next(w for w in (words(i, 3) for i in range(1, 300)) if ring.owner(prefix_hash(w)) == "a:1"
                  and w != body["messages"][0]["content"])  # fmt: skip
    other = chat(system, words(200, 12))
    stored_by(hints, "b:2", other)
    other_blocks = hints.blocks(other)
    assert other_blocks is not None and routing.placed is not None and routing.placed.history is not None
    assert routing.learn(None, other_blocks) == {"b:2": len(other_blocks.hashes)}
    assert "b:2" not in routing.placed.history.held(other_blocks.hashes)  # the events' view is not stored
    hints.index.apply("b:2", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    plan = routing.plan(other, {}, token_blocks=hints.blocks(other))
    assert plan.first == "a:1" and not plan.event_matched


def test_a_publisher_that_starts_over_is_forgotten_before_its_new_events(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    sub = ZmqKVEventSubscriber([EventSource("b:2", "tcp://127.0.0.1:1")], hints.index)
    body = chat(owned_by("a:1", names), words(240, 12))
    got = hints.blocks(body)
    assert got is not None
    for seq in range(3):
        batch = KVEventBatch(ts=0.0, events=[block_stored([seq * 100 + 1])])
        sub.handle(sub.sources[0], [b"", seq.to_bytes(8, "big"), encode_batch(batch)])
    stored = KVEventBatch(ts=0.0, events=[block_stored(list(got.hashes))])
    sub.handle(sub.sources[0], [b"", (3).to_bytes(8, "big"), encode_batch(stored)])
    assert hints.index.num_blocks("b:2") == 3 + len(got.hashes)
    # Seq 0 again: a restarted replica; what it held before is forgotten, its new batch applied.
    sub.handle(sub.sources[0], [b"", (0).to_bytes(8, "big"), encode_batch(KVEventBatch(0.0, [block_stored([7])]))])
    assert hints.index.num_blocks("b:2") == 1 and sub.stats.restarts == 1
    assert routing.plan(body, {}, token_blocks=got).first == "a:1"


def test_an_ejected_replica_gets_nothing_whatever_its_events_say(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    body = chat(owned_by("a:1", names), words(60, 12))
    stored_by(hints, "b:2", body)
    routing.replicas.died("b:2")
    routing.forget("b:2")
    plan = routing.plan(body, {}, token_blocks=hints.blocks(body))
    assert plan.ranking == ["a:1"]


def test_without_events_the_router_follows_its_own_record(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    routing, hints = routing_with_events(tokenizer_dir, names)
    system = owned_by("a:1", names)
    first = chat(system, words(80, 12))
    plan = routing.plan(first, {}, token_blocks=hints.blocks(first))
    assert plan.first == "a:1"
    routing.finished(plan)
    # The next turn of that conversation: its history was sent to a:1, no event said otherwise.
    later = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "w1"},
                                   {"role": "user", "content": words(100, 8)}]}  # fmt: skip
    b = routing.plan(later, {}, token_blocks=hints.blocks(later))
    assert b.first == "a:1" and not b.event_matched


# -- the subscriber feeding the router ----------------------------------------------------------------


def test_malformed_or_flooding_events_never_grow_the_index_past_its_bound(tokenizer_dir: Path) -> None:
    names = ["a:1", "b:2"]
    tok = PromptTokenizer(tokenizer_dir)
    hints = KVEventHints(tok.of_body, block_hasher("prefixserve", BLOCK), BLOCK, KVEventIndex(64))
    routing = StandaloneRouting(make_policy("placed", precise=True), ReplicaSet({n: f"http://{n}" for n in names}),
                                hints=hints)  # fmt: skip
    sub = ZmqKVEventSubscriber([EventSource("b:2", "tcp://127.0.0.1:1")], hints.index)
    source = sub.sources[0]
    seq = 0
    for i in range(50):
        batch = KVEventBatch(ts=0.0, events=[block_stored(list(range(i * 1000, i * 1000 + 40)))])
        sub.handle(source, [b"", seq.to_bytes(8, "big"), encode_batch(batch)])
        sub.handle(source, [b"", (seq + 1).to_bytes(8, "big"), b"\xff not msgpack"])  # undecodable: forgotten
        sub.handle(source, [b"", b"bad"])  # wrong shape
        seq += 2
        assert len(hints.index) <= 64
    sub.handle(source, [b"", (seq + 5).to_bytes(8, "big"), encode_batch(KVEventBatch(0.0, [block_stored([1])]))])
    assert len(hints.index) <= 64 and sub.stats.malformed >= 100 and sub.stats.gaps == 1
    body = chat(owned_by("a:1", names), words(120, 12))
    assert routing.plan(body, {}, token_blocks=hints.blocks(body)).first == "a:1"  # nothing of it is held


# -- over real HTTP and ZMQ ----------------------------------------------------------------------------


@contextmanager
def publisher() -> Iterator[tuple[ZmqKVEventPublisher, str]]:
    port = free_port()
    pub = ZmqKVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))  # binds: a wildcard
    try:
        yield pub, f"tcp://127.0.0.1:{port}"
    finally:
        pub.close()


def test_the_router_learns_from_a_replicas_events_over_zmq(tokenizer_dir: Path) -> None:
    fakes = [FakeReplica(), FakeReplica()]
    with ExitStack() as stack:
        a, b = (stack.enter_context(ServerThread(f.app)) for f in fakes)
        pub, endpoint = stack.enter_context(publisher())
        config = StandaloneRouterConfig(
            replicas=[a.url, b.url],
            health_interval_s=60.0,
            kv_events=[f"{b.url}={endpoint}"],
            kv_events_block_size=BLOCK,
            tokenizer=str(tokenizer_dir),
        )
        router = StandaloneRouter(config)
        server = stack.enter_context(RouterServerThread.for_router(router))
        http = stack.enter_context(httpx.Client(timeout=30.0))
        body = chat(owned_by(a.name, [a.name, b.name]), words(140, 16))
        hints = router.routing.hints
        assert hints is not None
        got = hints.blocks(body)
        assert got is not None

        def held_by_b() -> bool:  # PUB drops frames until the SUB's subscription arrives: publish until seen
            pub.publish([BlockStored(list(got.hashes), None, [], BLOCK, None, "GPU", None)])
            return hints.index.num_blocks(b.name) > 0

        wait_until(held_by_b, "the router's index learned b's blocks", timeout_s=30.0)
        r = http.post(f"{server.url}/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers[HEADER] == b.name
        text = http.get(f"{server.url}/metrics").text
        assert metric(text, "prefixserve_router_kv_event_matches_total") == 1
        assert metric(text, "prefixserve_router_kv_event_blocks", replica=b.name) == len(got.hashes)
        # b dies: its events still say it holds the prompt, but the health state wins.
        fakes[1].healthy = False
        router.replica_failed(b.name, "connect")
        r = http.post(f"{server.url}/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers[HEADER] == a.name


def test_a_request_asking_for_retention_keeps_its_key_where_it_is_placed() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet({n: f"http://{n}" for n in ["a:1", "b:2"]}))
    kept = {**chat("kept system", "w2"), "prompt_cache_retention": "24h"}
    plain = {**chat("plain system", "w2"), "prompt_cache_retention": "in_memory"}
    plans = [routing.plan(kept, {}), routing.plan(plain, {})]
    placed = routing.placed
    assert placed is not None and plans[0].key is not None and plans[1].key is not None
    assert placed.table.retained(plans[0].key) and not placed.table.retained(plans[1].key)
