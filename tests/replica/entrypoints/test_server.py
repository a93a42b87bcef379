"""replica/entrypoints/openai/server.py against a real ``prefixserve replica`` process and the official OpenAI client.

A tiny random Llama checkpoint (SmolLM2's tokenizer and chat template) keeps the
model cheap; one test serves SmolLM2 itself. Every test here starts real
processes, so all are marked slow.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ReplicaProcess, metric

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
REPLICA_NAME = "replica-under-test"
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 * 1024
BLOCK_SIZE = 16
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with ReplicaProcess(
        ckpt,
        "--api-key",
        API_KEY,
        "--replica-name",
        REPLICA_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-seqs",
        "64",
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as proc:
        yield proc
        assert proc.returncode is None, f"the replica died during the tests:\n{proc.log_tail()}"


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture()
def model_name(client) -> str:
    return client.models.list().data[0].id


def get_metrics(server) -> str:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    return response.text


def wait_until_idle(server, timeout_s: float = 60.0) -> str:
    """Poll /metrics until nothing runs or waits and no KV block is held; return the last text."""
    deadline = time.monotonic() + timeout_s
    text = get_metrics(server)
    while time.monotonic() < deadline:
        text = get_metrics(server)
        if (
            metric(text, "vllm:num_requests_running") == 0
            and metric(text, "vllm:num_requests_waiting") == 0
            and metric(text, "vllm:kv_cache_usage_perc") == 0
        ):
            return text
        time.sleep(0.2)
    raise AssertionError(f"the replica did not become idle:\n{text}")


# -- plain endpoints --------------------------------------------------------------


def test_models_health_metrics_and_replica_header(server, ckpt):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200
        assert health.headers["x-prefixserve-replica"] == REPLICA_NAME
        models = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert models.status_code == 200
        assert models.headers["x-prefixserve-replica"] == REPLICA_NAME
        data = models.json()
        assert data["object"] == "list"
        assert [m["id"] for m in data["data"]] == [Path(ckpt).name]
        assert data["data"][0]["max_model_len"] == MAX_MODEL_LEN
        scraped = http.get("/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            metric(scraped.text, name)


# -- the OpenAI client ---------------------------------------------------------------


def test_openai_client_chat_completion(client, model_name):
    rng = random.Random(1)
    messages = [{"role": "system", "content": words(rng, 12)}, {"role": "user", "content": words(rng, 6)}]
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=messages, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-prefixserve-replica"] == REPLICA_NAME
    first = raw.parse()
    assert first.object == "chat.completion" and first.model == model_name
    assert len(first.choices) == 1
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert first.usage.completion_tokens == 7
    assert first.usage.total_tokens == first.usage.prompt_tokens + 7
    assert first.usage.prompt_tokens_details.cached_tokens is not None
    # Greedy is deterministic: the same request answers the same text.
    again = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].message.content == choice.message.content


def test_openai_client_completions_text_and_token_prompts(client, model_name):
    rng = random.Random(2)
    prompt = words(rng, 20)
    text = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text.object == "text_completion"
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5
    prompt_ids = [rng.randrange(100, 40000) for _ in range(24)]
    ids = client.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert ids.usage.prompt_tokens == len(prompt_ids)
    logprobs = ids.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    # Completions default to 16 tokens, as OpenAI's do.
    default = client.completions.create(model=model_name, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16


def test_n_greater_than_one_non_streaming(client, model_name):
    rng = random.Random(3)
    messages = [{"role": "user", "content": words(rng, 10)}]
    request = dict(
        model=model_name,
        messages=messages,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=77,
        extra_body={"ignore_eos": True},
    )
    response = client.chat.completions.create(**request)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 18
    # Seeded sampling is reproducible through the server.
    again = client.chat.completions.create(**request)
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]


def test_streaming_equals_non_streaming(client, model_name):
    rng = random.Random(4)
    messages = [{"role": "system", "content": words(rng, 30)}, {"role": "user", "content": words(rng, 5)}]
    whole = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 12
    assert usage_chunks[0].usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens >= 0

    prompt = words(rng, 15)
    whole_text = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    streamed = list(
        client.completions.create(
            model=model_name, prompt=prompt, max_tokens=9, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole_text.choices[0].text
    assert all(c.usage is None for c in streamed)  # no include_usage: no usage chunk


def test_stream_n_greater_than_one_indexes_choices(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hello there"}],
        n=2,
        max_tokens=5,
        temperature=0.8,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}


def test_second_request_with_same_system_prompt_reports_cached_tokens(client, model_name):
    rng = random.Random(5)
    system = f"{rng.randrange(10**9)} " + words(rng, 120)  # a prompt no other test sent
    first = client.chat.completions.create(
        model=model_name,
        max_tokens=2,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": words(rng, 8)}],
    )
    second = client.chat.completions.create(
        model=model_name,
        max_tokens=2,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": words(rng, 8)}],
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0
    assert cached >= 112  # the ~120-word system prompt is more than 7 full blocks
    assert cached < second.usage.prompt_tokens
    # Another tenant's salt must not see this tenant's blocks.
    salted = client.chat.completions.create(
        model=model_name,
        max_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "tenant-b"},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": words(rng, 8)}],
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# -- bad input ------------------------------------------------------------------------


def _too_long_prompt() -> str:
    return words(random.Random(6), MAX_MODEL_LEN + 50)


BAD_REQUESTS = [
    # (name, path, raw body, expected status)
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400),
    ("missing messages", "/v1/chat/completions", {"model": None}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("negative max_tokens", "/v1/chat/completions", {"max_tokens": -1}, 400),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("absurd max_tokens", "/v1/chat/completions", {"max_tokens": 10**7}, 400),
    ("max_tokens over what fits", "/v1/chat/completions", {"max_tokens": MAX_MODEL_LEN}, 400),
    ("temperature too high", "/v1/chat/completions", {"temperature": 3.5}, 400),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-17"}, 404),
    ("unknown model (completions)", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404),
    ("prompt over max_model_len", "/v1/chat/completions", "LONG_CHAT", 400),
    ("prompt over max_model_len (completions)", "/v1/completions", "LONG_PROMPT", 400),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**7]}, 400),
]


@pytest.mark.parametrize("name, path, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error_and_honest_status(server, model_name, name, path, body, status):
    if body == "LONG_CHAT":
        body = {"messages": [{"role": "user", "content": _too_long_prompt()}], "max_tokens": 4}
    elif body == "LONG_PROMPT":
        body = {"prompt": _too_long_prompt(), "max_tokens": 4}
    if isinstance(body, dict):
        body = {"model": model_name, **body} if "model" not in body else {k: v for k, v in body.items() if v}
        if path.endswith("chat/completions") and "messages" not in body and name != "missing messages":
            body["messages"] = [{"role": "user", "content": "hi"}]
        body = json.dumps(body).encode()
    response = httpx.post(
        f"{server.base_url}{path}",
        content=body,
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    assert response.headers["x-prefixserve-replica"] == REPLICA_NAME
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]


def test_body_too_large_is_413_by_header_and_by_bytes(server, model_name):
    huge = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    declared = httpx.post(f"{server.base_url}/v1/chat/completions", content=huge, headers=headers, timeout=30)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "payload_too_large"

    def chunked():  # no Content-Length: only counting the bytes catches it
        data = huge.encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    streamed = httpx.post(f"{server.base_url}/v1/chat/completions", content=chunked(), headers=headers, timeout=30)
    assert streamed.status_code == 413
    assert set(streamed.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key_is_required(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0) as bad_client:
        with pytest.raises(openai.AuthenticationError):
            bad_client.chat.completions.create(model=model_name, messages=body["messages"], max_tokens=1)


def test_openai_client_sees_typed_errors(client, model_name):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}], temperature=9)
    assert "temperature" in bad.value.message


def test_unknown_route_gets_openai_error_body(server):
    response = httpx.get(f"{server.base_url}/v1/nothing-here", timeout=30)
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# -- disconnects and draining ------------------------------------------------------


async def _stream(http: httpx.AsyncClient, body: dict, stop_after_chunks: int | None) -> int:
    """Stream one chat completion; return the number of data events read before stopping."""
    events = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events += 1
            if stop_after_chunks is not None and events >= stop_after_chunks:
                break  # leaving the block closes the connection mid-stream
    return events


def test_32_concurrent_streams_with_early_disconnects_free_every_block(server, model_name):
    rng = random.Random(7)
    systems = [words(rng, 40) for _ in range(4)]
    bodies, stops = [], []
    for i in range(32):
        bodies.append(
            {
                "model": model_name,
                "stream": True,
                "max_tokens": 40,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
                "messages": [{"role": "system", "content": systems[i % 4]}, {"role": "user", "content": words(rng, 6)}],
            }
        )
        stops.append(rng.randrange(1, 4) if i % 3 == 0 else None)

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(_stream(http, b, s) for b, s in zip(bodies, stops, strict=True)))

    events = asyncio.run(main())
    for got, stop in zip(events, stops, strict=True):
        if stop is None:
            assert got >= 2  # role chunk + content/finish chunks
        else:
            assert got == stop
    text = wait_until_idle(server)
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0


def _idle_then_a_long_request(server, model_name: str, **fields: object) -> tuple[float, dict]:
    """Once ``server`` is idle: its generated-token count, and a chat request (with ``fields``)
    that would generate nearly the whole context unless it is aborted."""
    wait_until_idle(server)
    before = metric(get_metrics(server), "vllm:generation_tokens_total")
    body = {
        "model": model_name,
        **fields,
        "max_tokens": MAX_MODEL_LEN - 40,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "count"}],
    }
    return before, body


def test_disconnected_stream_is_aborted_not_run_to_completion(server, model_name):
    """A client that goes away mid-stream stops generation: far fewer tokens than max_tokens are made."""
    before, body = _idle_then_a_long_request(server, model_name, stream=True)
    max_tokens = body["max_tokens"]

    async def main() -> int:
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            return await _stream(http, body, stop_after_chunks=3)

    logged = len(server.log_tail(10**9))
    assert asyncio.run(main()) == 3
    text = wait_until_idle(server)
    generated = metric(text, "vllm:generation_tokens_total") - before
    assert 2 <= generated < max_tokens
    # A dropped stream is routine: one info line (below this server's warning level), no traceback.
    assert "Traceback" not in server.log_tail(10**9)[logged:]


def test_disconnected_non_streaming_request_is_aborted(server, model_name):
    before, body = _idle_then_a_long_request(server, model_name)
    max_tokens = body["max_tokens"]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            task = asyncio.create_task(http.post("/v1/chat/completions", json=body, timeout=300))
            # Hang up once the engine has produced some tokens for it.
            while metric(get_metrics(server), "vllm:generation_tokens_total") - before < 3:
                await asyncio.sleep(0.05)
                assert not task.done(), task.result().text
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    text = wait_until_idle(server)
    assert metric(text, "vllm:generation_tokens_total") - before < max_tokens


# -- queue full --------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after(ckpt, tmp_path):
    with ReplicaProcess(
        ckpt,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        log_dir=tmp_path,
    ) as proc:
        # A long ignore_eos budget keeps the one seat taken while all six requests arrive.
        body = {
            "messages": [{"role": "user", "content": "tell me more"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
        }

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=300) as http:
                return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(6)))

        responses = asyncio.run(main())
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429}, statuses
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 400
        # Once the queue drained, the replica serves again.
        again = httpx.post(f"{proc.base_url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=120)
        assert again.status_code == 200


# -- the real default model ------------------------------------------------------------


def test_smollm2_serves_a_chat_completion(tmp_path):
    with ReplicaProcess("smollm2", "--max-model-len", "1024", log_dir=tmp_path) as proc:
        with openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            response = c.chat.completions.create(
                model="smollm2",
                temperature=0,
                max_tokens=12,
                messages=[
                    {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
                    {"role": "user", "content": "What is the capital of France?"},
                ],
            )
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer
    assert response.usage.prompt_tokens_details.cached_tokens == 0


# -- a dead engine ---------------------------------------------------------------------


async def test_dead_engine_makes_health_and_requests_503(ckpt):
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.entrypoints.openai.server import build_app

    engine = AsyncEngine(EngineConfig(model=str(ckpt), max_model_len=128))
    app = build_app(engine, replica_name="in-process")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as http:
        assert (await http.get("/health")).status_code == 200
        ok = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        await engine.shutdown()
        health = await http.get("/health")
        assert health.status_code == 503 and health.headers["x-prefixserve-replica"] == "in-process"
        dead = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert dead.status_code == 503
        assert dead.json()["error"]["type"] == "service_unavailable"
        assert int(dead.headers["retry-after"]) >= 1
