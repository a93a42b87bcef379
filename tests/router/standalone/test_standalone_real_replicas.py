"""``prefixserve router`` (a real process, its CLI) in front of two real ``prefixserve replica`` processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from process_helpers import ManagedProcess
from server_helpers import ReplicaProcess, free_port, metric, prefixserve_command

from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import prefix_hash

pytestmark = pytest.mark.slow

HEADER = "X-Prefixserve-Replica"


class RouterProcess(ManagedProcess):
    """``prefixserve router`` on a free local port over ``replica_urls``; stopped on leaving."""

    name = "router"

    def __init__(self, replica_urls: list[str], log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        replicas = [arg for url in replica_urls for arg in ("--replica", url)]
        super().__init__(
            [*prefixserve_command(), "router", *replicas, "--port", str(self.port), "--log-level", "warning", *args],
            log_path=log_dir / f"router-{self.port}.log",
            ready_url=f"{self.base_url}/health",
            startup_timeout_s=60.0,
            poll_s=0.2,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )


def test_the_router_routes_to_real_replicas_and_they_answer(
    ckpt: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = tmp_path_factory.mktemp("logs")
    args = ("--max-model-len", "512")
    with ReplicaProcess(ckpt, *args, log_dir=logs) as a, ReplicaProcess(ckpt, *args, log_dir=logs) as b:
        names = {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
        with RouterProcess([a.base_url, b.base_url], logs) as router, httpx.Client(timeout=120.0) as http:
            models = http.get(f"{router.base_url}/v1/models")
            assert models.status_code == 200
            model = models.json()["data"][0]["id"]
            landed: dict[str, set[str]] = {}
            for i in range(6):
                system = f"You are helper {i % 2}."
                body = {
                    "model": model,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                    "max_tokens": 4,
                    "temperature": 0.0,
                }
                r = http.post(f"{router.base_url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["role"] == "assistant"
                landed.setdefault(system, set()).add(r.headers[HEADER])
            assert all(len(v) == 1 for v in landed.values()) and set().union(*landed.values()) <= names
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
            with http.stream("POST", f"{router.base_url}/v1/completions", json=body) as r:
                assert r.status_code == 200 and r.headers[HEADER] in names
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
            assert metric(http.get(f"{router.base_url}/metrics").text, "prefixserve_router_requests_total") == 7
            assert (
                http.post(f"{router.base_url}/v1/chat/completions", json={**body, "model": "nope"}).status_code == 404
            )


def test_the_router_learns_from_real_replicas_kv_events(ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A prompt warmed on replica b behind the router's back is routed to b: b's KV events told the router."""
    logs = tmp_path_factory.mktemp("logs")
    ports = [free_port() for _ in range(4)]

    def events(pub: int, replay: int) -> tuple[str, ...]:
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
        return ("--max-model-len", "512", "--kv-events-config", json.dumps(config))

    with (
        ReplicaProcess(ckpt, *events(ports[0], ports[1]), log_dir=logs) as a,
        ReplicaProcess(ckpt, *events(ports[2], ports[3]), log_dir=logs) as b,
    ):
        names = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        sources = [
            f"{a.base_url}=tcp://127.0.0.1:{ports[0]},tcp://127.0.0.1:{ports[1]}",
            f"{b.base_url}=tcp://127.0.0.1:{ports[2]},tcp://127.0.0.1:{ports[3]}",
        ]
        flags = [arg for s in sources for arg in ("--kv-events", s)]
        with (
            RouterProcess([a.base_url, b.base_url], logs, *flags, "--tokenizer", str(ckpt)) as router,
            httpx.Client(timeout=120.0) as http,
        ):
            model = http.get(f"{router.base_url}/v1/models").json()["data"][0]["id"]
            # A system prompt the ring gives to a, so that without b's events the router would pick a.
            ring = HashRing([RingServer(n) for n in names])
            system = next(
                s for s in (f"You are assistant {i}." for i in range(1000)) if ring.owner(prefix_hash(s)) == names[0]
            )
            user = "Tell me a long story about a dragon who lives in a castle by the sea, and about the knight."
            body = {
                "model": model,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": 2,
                "temperature": 0.0,
            }
            assert http.post(f"{b.base_url}/v1/chat/completions", json=body).status_code == 200  # not via the router

            def b_blocks() -> float:
                return metric(
                    http.get(f"{router.base_url}/metrics").text, "prefixserve_router_kv_event_blocks", replica=names[1]
                )

            deadline = time.monotonic() + 60.0
            while b_blocks() == 0:
                assert time.monotonic() < deadline, "the router never heard b's KV events"
                time.sleep(0.2)
            r = http.post(f"{router.base_url}/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers[HEADER] == names[1]
            assert metric(http.get(f"{router.base_url}/metrics").text, "prefixserve_router_kv_event_matches_total") == 1


def test_responses_continue_on_the_replica_that_stored_them(
    ckpt: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each replica stores the Responses it answers: the router sends a continuation, a GET and a DELETE
    to the replica whose answer carried the id, streamed or not, whatever the routing key says."""
    logs = tmp_path_factory.mktemp("logs")
    args = ("--max-model-len", "512")
    with ReplicaProcess(ckpt, *args, log_dir=logs) as a, ReplicaProcess(ckpt, *args, log_dir=logs) as b:
        names = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        with (
            RouterProcess([a.base_url, b.base_url], logs, "--policy", "round_robin") as router,
            httpx.Client(timeout=120.0) as http,
        ):
            model = http.get(f"{router.base_url}/v1/models").json()["data"][0]["id"]
            base = {"model": model, "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0.0}
            first = http.post(f"{router.base_url}/v1/responses", json={**base, "input": "Hello"})
            assert first.status_code == 200, first.text
            home, previous = first.headers[HEADER], first.json()["id"]
            # Round robin alone would alternate; every turn goes back to the replica holding the chain.
            for i in range(3):
                body = {**base, "input": f"And then {i}?", "previous_response_id": previous}
                if i == 1:
                    with http.stream("POST", f"{router.base_url}/v1/responses", json={**body, "stream": True}) as r:
                        assert r.status_code == 200 and r.headers[HEADER] == home
                        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
                    # Four tokens: the answer ends at its length limit, stored all the same.
                    assert events[-1]["type"] in ("response.completed", "response.incomplete")
                    previous = events[-1]["response"]["id"]
                else:
                    r = http.post(f"{router.base_url}/v1/responses", json=body)
                    assert r.status_code == 200 and r.headers[HEADER] == home, r.text
                    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
                    previous = r.json()["id"]
            got = http.get(f"{router.base_url}/v1/responses/{previous}")
            assert got.status_code == 200 and got.json()["id"] == previous and got.headers[HEADER] == home
            other = names[1 - names.index(home)]
            # The other replica does not have it: asked directly it says 404, as OpenAI does.
            direct = http.get(f"http://{other}/v1/responses/{previous}")
            assert direct.status_code == 404
            assert http.delete(f"{router.base_url}/v1/responses/{previous}").status_code == 200
            gone = http.get(f"{router.base_url}/v1/responses/{previous}")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


# A greedy stream long enough to be mid-way when its replica dies, and one under a JSON schema
# (a list of 40 digits) whose grammar the continuation replays.
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40, "maxItems": 40}


def _stream_text(http: httpx.Client, url: str, body: dict, record: dict) -> None:
    record["chunks"] = 0
    text = []
    with http.stream("POST", url, json={**body, "stream": True}) as r:
        record["status"], record["replica"] = r.status_code, r.headers.get(HEADER)
        for line in r.iter_lines():
            assert not line.startswith(":"), f"a progress comment reached the client: {line!r}"
            if not line.startswith("data: ") or line == "data: [DONE]":
                record["done"] = record.get("done") or line == "data: [DONE]"
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record["error"] = event
                continue
            piece = (event["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            text.append(piece)
            record["chunks"] += bool(piece)
    record["text"] = "".join(text)


@pytest.mark.parametrize("stop", ["kill", "drain"])
def test_a_stream_whose_replica_dies_or_drains_continues_on_the_other_one_token_for_token(
    ckpt: str, tmp_path_factory: pytest.TempPathFactory, stop: str
) -> None:
    """Stop the replica serving most streams mid-way (SIGKILL; or SIGTERM, whose drain ends the streams
    in-band after its 1 s timeout): every stream ends whole, its text the one an undisturbed run gives
    (greedy), the JSON ones valid; the router counts the moves by reason."""
    import signal
    import threading

    import jsonschema

    logs = tmp_path_factory.mktemp("logs")
    args = ("--max-model-len", "1024", "--drain-timeout-s", "1")
    with ReplicaProcess(ckpt, *args, log_dir=logs) as a, ReplicaProcess(ckpt, *args, log_dir=logs) as b:
        by_name = {f"127.0.0.1:{a.port}": a, f"127.0.0.1:{b.port}": b}
        with RouterProcess([a.base_url, b.base_url], logs) as router, httpx.Client(timeout=300.0) as http:
            model = http.get(f"{router.base_url}/v1/models").json()["data"][0]["id"]
            url = f"{router.base_url}/v1/chat/completions"
            bodies = []
            for i in range(6):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": f"You are helper {i}."},
                        {"role": "user", "content": "go"},
                    ],
                    "temperature": 0.0,
                }
                if i % 2:
                    schema = {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS}}
                    body.update(max_tokens=700, response_format=schema)
                else:  # long enough to outlast the drain's 1 s
                    body.update(max_tokens=900, ignore_eos=True)
                bodies.append(body)
            reference = []
            for body in bodies:
                r = http.post(url, json=body)
                assert r.status_code == 200, r.text
                reference.append(r.json()["choices"][0]["message"]["content"])
            records: list[dict] = [{} for _ in bodies]
            threads = [
                threading.Thread(target=_stream_text, args=(http, url, body, rec), daemon=True)
                for body, rec in zip(bodies, records, strict=True)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while not all(r.get("chunks", 0) >= 10 or r.get("done") for r in records):
                assert time.monotonic() < deadline, records
                time.sleep(0.01)
            plain_served = [r.get("replica") for r, b in zip(records, bodies, strict=True) if "ignore_eos" in b]
            victim = max(by_name, key=plain_served.count)  # the plain streams outlast the drain
            assert by_name[victim].proc is not None
            by_name[victim].proc.send_signal(signal.SIGKILL if stop == "kill" else signal.SIGTERM)
            for t in threads:
                t.join(300)
            for rec, want in zip(records, reference, strict=True):
                assert rec.get("done") and "error" not in rec, rec
                assert rec["text"] == want
            for rec, body in zip(records, bodies, strict=True):
                if "response_format" in body:
                    jsonschema.validate(json.loads(rec["text"]), DIGITS)
            moved = metric(
                http.get(f"{router.base_url}/metrics").text,
                "prefixserve_router_stream_migrations_total",
                reason="replica_died" if stop == "kill" else "replica_stopping",
                result="migrated",
            )
            # Every plain stream on the victim was mid-way when it stopped; a JSON one may have ended first.
            plain_on_victim = sum(
                1 for r, b in zip(records, bodies, strict=True) if r["replica"] == victim and "ignore_eos" in b
            )
            assert moved >= plain_on_victim >= 1
