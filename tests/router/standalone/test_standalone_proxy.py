"""The standalone router over real HTTP: a router and fake upstream replicas, each a uvicorn server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from server_helpers import free_port, metric
from standalone_router_helpers import FakeReplica, RouterServerThread, ServerThread, wait_until

from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import prefix_hash
from prefixserve.router.standalone.config import StandaloneRouterConfig
from prefixserve.router.standalone.proxy import ROUTER_SELF, StandaloneRouter

HEADER = "X-Prefixserve-Replica"


@contextmanager
def replicas(*fakes: FakeReplica) -> Iterator[list[ServerThread]]:
    with ExitStack() as stack:
        yield [stack.enter_context(ServerThread(f.app)) for f in fakes]


@contextmanager
def router_over(urls: list[str], **settings: Any) -> Iterator[tuple[str, StandaloneRouter]]:
    """A running router over ``urls``; by default its probes run once at start only (tests that need them set it)."""
    config = StandaloneRouterConfig(replicas=urls, **{"health_interval_s": 60.0, **settings})
    router = StandaloneRouter(config)
    with RouterServerThread.for_router(router) as server:
        yield server.url, router


def system_owned_by(owner: str, names: list[str]) -> str:
    """A system prompt whose routing key the ring gives to ``owner``."""
    ring = HashRing([RingServer(n) for n in names])
    return next(s for s in (f"system prompt {i}" for i in range(10_000)) if ring.owner(prefix_hash(s)) == owner)


def chat(system: str | None, user: str = "hi", stream: bool = False, model: str = "m") -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": model, "messages": messages, "stream": stream}


def data_lines(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_stream_is_relayed_chunk_by_chunk() -> None:
    fake = FakeReplica()
    fake.gate = threading.Event()
    with replicas(fake) as (up,), router_over([up.url]) as (url, router), httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=chat("sys", stream=True)) as r:
            assert r.status_code == 200 and r.headers[HEADER] == up.name
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # The first event is here while the replica still holds the rest: nothing was buffered.
            assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "one"
            assert not fake.gate.is_set()
            # Counted where it landed once its first bytes went out, not again for each later chunk.
            landed = metric(client.get(f"{url}/metrics").text, "prefixserve_router_requests_total", replica=up.name)
            assert landed == 1
            fake.gate.set()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest == [json.dumps(json.loads(rest[0])), "[DONE]"]
        assert not fake.gate_timed_out
        wait_until(lambda: router.replicas[up.name].in_flight == 0, "the stream's in-flight count ended")
        assert metric(client.get(f"{url}/metrics").text, "prefixserve_router_requests_total", replica=up.name) == 1


@pytest.mark.parametrize("status", [503, 429])
def test_a_refusal_before_the_first_byte_moves_to_the_next_replica(status: int) -> None:
    a, b = FakeReplica(), FakeReplica()
    a.mode = str(status)
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], policy="consistent_hash") as (url, router):
        system = system_owned_by(ua.name, [ua.name, ub.name])
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ub.name
        assert len(a.received) == 1 and len(b.received) == 1
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "prefixserve_router_retries_total", replica=ua.name, reason=str(status)) == 1
        assert metric(text, "prefixserve_router_requests_total", replica=ub.name, kind="fallback") == 1
        assert router.replicas[ua.name].admitted  # a refusal is no failure


def test_the_last_replicas_refusal_is_passed_through() -> None:
    a = FakeReplica()
    a.mode = "503"
    with replicas(a) as (ua,), router_over([ua.url]) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("sys"), timeout=60)
        assert r.status_code == 503 and r.headers[HEADER] == ua.name and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "replica_busy"


def test_a_refused_connection_ejects_the_replica_and_moves_the_request() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    b = FakeReplica()
    with replicas(b) as (ub,), router_over([f"http://{dead}", ub.url], policy="consistent_hash") as (url, router):
        system = system_owned_by(dead, [dead, ub.name])
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ub.name
        assert not router.replicas[dead].admitted
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "prefixserve_router_ejections_total", replica=dead, reason="connect") == 1
        assert metric(text, "prefixserve_router_replica_admitted", replica=dead) == 0


def test_health_probes_eject_and_admit_again() -> None:
    a, b = FakeReplica(), FakeReplica()
    settings = {"policy": "consistent_hash", "health_interval_s": 0.02, "unhealthy_after": 2, "healthy_after": 2}
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], **settings) as (url, router):
        system = system_owned_by(ub.name, [ua.name, ub.name])
        b.healthy = False
        wait_until(lambda: not router.replicas[ub.name].admitted, "b ejected")
        for i in range(5):
            r = httpx.post(f"{url}/v1/chat/completions", json=chat(system, f"q{i}"), timeout=60)
            assert r.headers[HEADER] == ua.name
        assert b.received == []
        b.healthy = True
        wait_until(lambda: router.replicas[ub.name].admitted, "b admitted again")
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert r.headers[HEADER] == ub.name
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "prefixserve_router_ejections_total", replica=ub.name, reason="health") == 1
        assert metric(text, "prefixserve_router_readmissions_total", replica=ub.name) == 1


def test_a_replica_dying_mid_stream_ends_the_stream_in_band_and_takes_no_new_request() -> None:
    a, b = FakeReplica(), FakeReplica()
    a.mode = "die"
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], policy="consistent_hash") as (url, router):
        system = system_owned_by(ua.name, [ua.name, ub.name])
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(system, stream=True), timeout=60) as r:
            assert r.status_code == 200 and r.headers[HEADER] == ua.name
            events = data_lines(r)
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "one"
        assert json.loads(events[1])["error"]["code"] == "upstream_failed"
        assert events[2:] == ["[DONE]"]
        assert not router.replicas[ua.name].admitted
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ub.name
        assert len(a.received) == 1
        assert (
            metric(httpx.get(f"{url}/metrics").text, "prefixserve_router_upstream_broken_total", replica=ua.name) == 1
        )


def test_the_path_and_query_go_to_the_replica_as_the_client_sent_them() -> None:
    fake = FakeReplica()
    with replicas(fake) as (up,), router_over([up.url]) as (url, _):
        r = httpx.post(
            f"{url}/v1/completions?api-version=1%2F2&x=a%20b", json={"model": "m", "prompt": "p"}, timeout=60
        )
        assert r.status_code == 200 and r.headers[HEADER] == up.name
        r = httpx.get(f"{url}/v1/completions", timeout=60)  # not a generation method: the router's 405
        assert r.status_code == 405 and r.headers[HEADER] == ROUTER_SELF
    assert fake.targets == [b"/v1/completions?api-version=1%2F2&x=a%20b"]


def test_a_client_that_goes_away_closes_the_upstream_and_ends_its_counts() -> None:
    fake = FakeReplica()
    fake.gate = threading.Event()
    with replicas(fake) as (up,), router_over([up.url]) as (url, router):
        placed = router.routing.placed
        assert placed is not None
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("sys", stream=True), timeout=60) as r:
            # Held, so that the stream stays open until the client leaves (a dropped iterator closes it).
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert router.replicas[up.name].in_flight == 1
        wait_until(lambda: router.replicas[up.name].in_flight == 0, "in-flight ended after the client left")
        assert placed.key_in_flight(prefix_hash("sys")) == 0
        fake.gate.set()


def test_a_client_that_goes_away_before_the_first_event_closes_the_upstream() -> None:
    fake = FakeReplica()
    fake.hold_first = threading.Event()
    with replicas(fake) as (up,), router_over([up.url]) as (url, router):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("sys", stream=True), timeout=60) as r:
            assert r.status_code == 200  # the answer's head came; its first event is held
            assert router.replicas[up.name].in_flight == 1
        # Ended while the replica still holds its first event: the relay, waiting for it, was cancelled
        # (the upstream answer is closed before the counts end).
        wait_until(lambda: router.replicas[up.name].in_flight == 0, "in-flight ended after the client left")
        fake.hold_first.set()


def test_models_are_merged_and_a_model_goes_to_the_replicas_serving_it() -> None:
    a, b = FakeReplica(models=("m1",)), FakeReplica(models=("m1", "m2"))
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], policy="consistent_hash") as (url, _):
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 200 and r.headers[HEADER] == ROUTER_SELF
        assert [m["id"] for m in r.json()["data"]] == ["m1", "m2"]
        system = system_owned_by(ua.name, [ua.name, ub.name])
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system, model="m2"), timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ub.name


def test_an_unknown_model_is_answered_404_by_the_router() -> None:
    a = FakeReplica(models=("m1",))
    with replicas(a) as (ua,), router_over([ua.url]) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("sys", model="nope"), timeout=60)
        assert r.status_code == 404 and r.headers[HEADER] == ROUTER_SELF
        assert r.json()["error"]["code"] == "model_not_found"
        assert a.received == []


def test_every_answer_names_a_replica_or_the_router() -> None:
    a = FakeReplica()
    with replicas(a) as (ua,), router_over([ua.url], max_body_bytes=1000, h11_max_header_count=20) as (url, _):
        answers = {
            "health": httpx.get(f"{url}/health"),
            "metrics": httpx.get(f"{url}/metrics"),
            "unknown path": httpx.get(f"{url}/nope"),
            "body too large": httpx.post(f"{url}/v1/chat/completions", json=chat("x" * 2000)),
            "too many headers": httpx.get(f"{url}/health", headers={f"x-h{i}": "1" for i in range(30)}),
        }
        assert {k: r.status_code for k, r in answers.items()} == {
            "health": 200,
            "metrics": 200,
            "unknown path": 404,
            "body too large": 413,
            "too many headers": 431,
        }
        assert {r.headers.get(HEADER) for r in answers.values()} == {ROUTER_SELF}
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello"}, timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ua.name
        assert a.received == [{"model": "m", "prompt": "hello"}]


def test_the_same_system_prompt_lands_on_the_same_replica() -> None:
    fakes = [FakeReplica(), FakeReplica(), FakeReplica()]
    with replicas(*fakes) as ups, router_over([u.url for u in ups]) as (url, _), httpx.Client(timeout=60) as client:
        landed: dict[str, set[str]] = {}
        for turn in range(4):
            for tenant in range(4):
                system = f"You are assistant number {tenant}."
                r = client.post(f"{url}/v1/chat/completions", json=chat(system, f"question {turn}"))
                assert r.status_code == 200
                landed.setdefault(system, set()).add(r.headers[HEADER])
        assert all(len(names) == 1 for names in landed.values()), landed
        text = client.get(f"{url}/metrics").text
        assert metric(text, "prefixserve_router_requests_total") == 16


def test_a_repeated_prefix_hash_header_routes_and_goes_on_by_its_first_value() -> None:
    fakes = [FakeReplica(), FakeReplica()]
    with replicas(*fakes) as ups, router_over([u.url for u in ups]) as (url, _):
        ring = HashRing([RingServer(u.name) for u in ups])
        first = next(k for k in (f"key-{i}" for i in range(1000)) if ring.owner(k) == ups[1].name)
        second = next(k for k in (f"key-{i}" for i in range(1000)) if ring.owner(k) == ups[0].name)
        headers = [("X-Prefix-Hash", first), ("X-Prefix-Hash", second), ("X-Tenant-Note", "kept")]
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("s"), headers=headers, timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ups[1].name
    sent = fakes[1].headers[-1]
    assert sent["x-prefix-hash"] == first and sent["x-tenant-note"] == "kept"
    assert not fakes[0].received


def test_a_body_the_router_cannot_read_is_forwarded_by_load() -> None:
    a, b = FakeReplica(), FakeReplica()
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url]) as (url, _):
        r = httpx.post(
            f"{url}/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json", "X-Request-Id": "abc"},
            timeout=60,
        )
        assert r.status_code == 400 and r.headers[HEADER] in (ua.name, ub.name)
        got = a if a.received else b
        assert got.received == [b"{not json"] and got.headers[0]["x-request-id"] == "abc"
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "prefixserve_router_requests_total", kind="no_key") == 1


def test_replica_load_comes_from_its_metrics() -> None:
    a, b = FakeReplica(running=8, waiting=4), FakeReplica()
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], metrics_interval_s=0.02) as (url, router):
        wait_until(lambda: router.replicas.load(ua.name) is not None, "a's load read")
        load = router.replicas.load(ua.name)
        assert load is not None and (load.num_running, load.num_waiting) == (8, 4)
        # A request without a key goes by load: to the idle replica.
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(None), timeout=60)
        assert r.headers[HEADER] == ub.name


def test_a_body_not_sent_in_time_is_refused_408() -> None:
    a = FakeReplica()
    with replicas(a) as (ua,), router_over([ua.url], client_body_timeout_s=0.2) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f'{head}Content-Length: 100\r\n\r\n{{"model"'.encode())  # and never the rest
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and f"{HEADER.lower()}: {ROUTER_SELF}".encode() in answer.lower()
        assert a.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_answers_usage_is_the_keys_prefill_work(stream: bool) -> None:
    fake = FakeReplica()
    with replicas(fake) as (up,), router_over([up.url], policy="placed") as (url, router):
        placed = router.routing.placed
        assert placed is not None
        key = prefix_hash("tenant with work")
        body = {**chat("tenant with work", stream=stream), "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            r.read()
        wait_until(lambda: placed.key_in_flight(key) == 0, "the request ended")
        stats = placed.table.stats(key)
        assert stats is not None and stats[1] > 0  # 60 uncached tokens, decayed
        plain = prefix_hash("tenant without usage")
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("tenant without usage", stream=True), timeout=60)
        assert r.status_code == 200
        wait_until(lambda: placed.key_in_flight(plain) == 0, "the request ended")
        stats = placed.table.stats(plain)
        assert stats is not None and stats[1] == 0  # a stream without a usage chunk reports no work


def test_a_json_answer_broken_off_is_cut_for_the_client_too() -> None:
    a, b = FakeReplica(), FakeReplica()
    a.mode = "die_json"
    with replicas(a, b) as (ua, ub), router_over([ua.url, ub.url], policy="consistent_hash") as (url, router):
        system = system_owned_by(ua.name, [ua.name, ub.name])
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert not router.replicas[ua.name].admitted
        wait_until(lambda: router.replicas[ua.name].in_flight == 0, "the broken answer's count ended")
        # Counted once where it landed, though its answer broke off.
        assert metric(httpx.get(f"{url}/metrics").text, "prefixserve_router_requests_total", replica=ua.name) == 1
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(system), timeout=60)
        assert r.status_code == 200 and r.headers[HEADER] == ub.name


def test_a_request_for_an_adapter_goes_where_the_adapters_key_lands() -> None:
    from prefixserve.router.routing_key import adapter_key

    fakes = [FakeReplica(adapters=("ad",)), FakeReplica(adapters=("ad",))]
    with replicas(*fakes) as ups, router_over([u.url for u in ups], policy="consistent_hash") as (url, router):
        names = [u.name for u in ups]
        ring = HashRing([RingServer(n) for n in names])
        # A system prompt whose base key and adapter key land on different replicas.
        system = next(
            s
            for s in (f"system prompt {i}" for i in range(10_000))
            if ring.owner(prefix_hash(s)) != ring.owner(adapter_key(prefix_hash(s), "ad"))
        )
        with httpx.Client(timeout=60) as client:
            client.get(f"{url}/v1/models")  # the router reads which names are adapters
            base = client.post(f"{url}/v1/chat/completions", json=chat(system))
            lora = client.post(f"{url}/v1/chat/completions", json=chat(system, model="ad"))
        assert base.headers[HEADER] == ring.owner(prefix_hash(system))
        assert lora.headers[HEADER] == ring.owner(adapter_key(prefix_hash(system), "ad"))
        assert router.models.is_adapter("ad") and not router.models.is_adapter("m")
