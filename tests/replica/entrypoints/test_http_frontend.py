"""The OpenAI front end in process (replica/entrypoints/openai/http_frontend.py over a real tiny engine): fast tests.

What the slow tests/replica/entrypoints/test_server.py cannot show cheaply: the event loop stays
free while a prompt is templated and tokenized, the cheap length bound, UTF-8
API keys, and the server stopping with a non-zero status once its engine is
dead for good.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from server_helpers import assert_openai_error, free_port, wait_for_health

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.errors import PromptTooLongError

MAX_MODEL_LEN = 128
# A deadlock breaker for the gated tests, never a measured duration.
GATE_TIMEOUT_S = 60
# conftest's replica: an InProcessReplica on the shared ckpt, with these options.
REPLICA_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, api_keys=["sk-ключ-é"], replica_name="in-process")


AUTH = {b"authorization": "Bearer sk-ключ-é".encode()}


def test_a_utf8_api_key_matches_and_a_wrong_one_does_not(replica):
    assert replica.request("GET", "/v1/models", headers=AUTH).status_code == 200
    wrong = replica.request("GET", "/v1/models", headers={b"authorization": "Bearer sk-ключ-e".encode()})
    assert assert_openai_error(wrong)["code"] == "invalid_api_key"
    # Latin-1 bytes of the same characters are other bytes: no match.
    latin = replica.request("GET", "/v1/models", headers={b"authorization": "Bearer sk-é".encode("latin-1")})
    assert latin.status_code == 401


def test_x_request_id_is_carried_to_the_engine_and_echoed(replica):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok = replica.request("POST", "/v1/chat/completions", json=body, headers={**AUTH, b"x-request-id": b"trace-42"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42"
    assert ok.json()["id"] == "chatcmpl-trace-42"  # the engine request carried it
    streamed = replica.request(
        "POST", "/v1/chat/completions", json={**body, "stream": True}, headers={**AUTH, b"x-request-id": b"trace-43"}
    )
    assert streamed.headers["x-request-id"] == "trace-43" and '"id":"chatcmpl-trace-43"' in streamed.text
    # Without one, the generated id is echoed; errors carry the id too.
    generated = replica.request("POST", "/v1/chat/completions", json=body, headers=AUTH)
    assert generated.headers["x-request-id"] == generated.json()["id"]
    refused = replica.request("POST", "/v1/chat/completions", json=body, headers={b"x-request-id": b"trace-44"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-44"
    bad = replica.request("POST", "/v1/chat/completions", json=body, headers={**AUTH, b"x-request-id": b"a b"})
    assert assert_openai_error(bad)["code"] == "invalid_request_id"


def test_health_answers_while_a_chat_template_and_tokenizer_run(replica, monkeypatch):
    """The template + tokenizer of a request is held until /health has answered.

    On a worker thread /health answers meanwhile; on the event loop the hold
    could never end (the loop would be blocked), the gate times out and the
    test fails.
    """
    rendering, health_answered = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    processor = replica.engine.engine.input_processor
    real = processor.encode_chat

    def gated(messages, **kwargs):
        seen["thread"] = threading.current_thread()
        rendering.set()
        seen["health_answered_first"] = health_answered.wait(timeout=GATE_TIMEOUT_S)
        return real(messages, **kwargs)

    monkeypatch.setattr(processor, "encode_chat", gated)
    # Inside the cheap bound but far over MAX_MODEL_LEN tokens: the tokenizer must run to tell.
    content = "alpha beta gamma " * 600

    async def main() -> tuple[httpx.Response, httpx.Response]:
        big = asyncio.create_task(
            replica.http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
                headers=AUTH,
            )
        )
        assert await asyncio.to_thread(rendering.wait, GATE_TIMEOUT_S), "the template never ran"
        health = await replica.http.get("/health")
        health_answered.set()
        return health, await big

    health, big = replica.loop.run_until_complete(main())
    assert health.status_code == 200
    assert seen["health_answered_first"] is True
    assert seen["thread"] is not threading.main_thread()
    assert assert_openai_error(big)["code"] == "context_length_exceeded"


def test_a_huge_prompt_is_refused_before_any_tokenization(replica, monkeypatch):
    calls = []
    processor = replica.engine.engine.input_processor
    real = processor.encode_chat
    monkeypatch.setattr(processor, "encode_chat", lambda m, **kw: calls.append(1) or real(m, **kw))
    huge = "x" * 3_900_000
    chat = replica.request(
        "POST",
        "/v1/chat/completions",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": huge}], "max_tokens": 1},
    )
    assert assert_openai_error(chat)["code"] == "context_length_exceeded"
    assert calls == []
    completion = replica.request("POST", "/v1/completions", headers=AUTH, json={"prompt": huge, "max_tokens": 1})
    assert assert_openai_error(completion)["code"] == "context_length_exceeded"
    ids = replica.request(
        "POST", "/v1/completions", headers=AUTH, json={"prompt": [17] * (MAX_MODEL_LEN + 1), "max_tokens": 1}
    )
    assert assert_openai_error(ids)["code"] == "context_length_exceeded"


def test_the_length_bound_never_refuses_a_prompt_that_fits(replica):
    """The worst case for the bound: the tokenizer's longest token, repeated as often as fits."""
    processor = replica.engine.engine.input_processor
    tokenizer = replica.engine.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i] or ""))
    text = tokenizer.decode([longest] * MAX_MODEL_LEN)
    assert len(tokenizer(text).input_ids) <= MAX_MODEL_LEN + 2
    processor.check_prompt_size(EngineRequest(prompt=text))
    processor.check_prompt_size(EngineRequest(messages=[{"role": "user", "content": text}]))
    limit = replica.engine.engine.input_processor.max_prompt_chars
    assert limit is not None and len(text) <= limit
    too_long = "x" * (limit + 1)
    for over in (EngineRequest(prompt=too_long), EngineRequest(messages=[{"role": "user", "content": too_long}])):
        with pytest.raises(PromptTooLongError):
            processor.check_prompt_size(over)


def test_every_4xx_of_the_front_end_has_a_code(replica):
    cases = [
        ("POST", "/v1/completions", {"prompt": [1, 10**7]}),  # outside the vocabulary
        ("POST", "/v1/completions", {"prompt": "x", "model": "nope"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "bogus": 1}]}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**70}),
        ("GET", "/v1/nothing", None),
    ]
    for method, path, body in cases:
        response = replica.request(method, path, headers=AUTH, json=body)
        error = assert_openai_error(response)
        assert "Python" not in error["message"] and "overflow" not in error["message"].lower()
        assert response.headers["x-prefixserve-replica"] == "in-process"


def test_the_server_exits_non_zero_once_its_engine_is_dead_for_good(ckpt):
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.entrypoints.openai.server import EXIT_ENGINE_DEAD, serve

    engine = AsyncEngine(EngineConfig(model=ckpt, max_model_len=MAX_MODEL_LEN))
    port = free_port()
    status: list[int] = []
    thread = threading.Thread(
        target=lambda: status.append(
            serve(engine, host="127.0.0.1", port=port, log_level="warning", engine_watch_period_s=0.05)
        ),
        daemon=True,
    )
    thread.start()
    try:
        wait_for_health(f"http://127.0.0.1:{port}")  # until the server listens
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200
        asyncio.run(engine.shutdown())  # the engine is gone for good: is_running is False
        thread.join(timeout=GATE_TIMEOUT_S)
        assert not thread.is_alive(), "the server kept running with a dead engine"
        assert status == [EXIT_ENGINE_DEAD]
    finally:
        if thread.is_alive():
            asyncio.run(engine.shutdown())


def test_header_limits_of_the_front_end_are_431_before_the_key_check():
    from starlette.requests import Request

    from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions, check_auth
    from prefixserve.replica.errors import AuthenticationError, HeaderFieldsTooLargeError

    options = FrontendOptions.build(["sk"], 1024, max_header_count=3, max_header_bytes=200)

    def request(headers: list[tuple[bytes, bytes]]) -> Request:
        return Request(
            {"type": "http", "method": "GET", "path": "/v1/models", "raw_path": b"/v1/models", "headers": headers}
        )

    with pytest.raises(HeaderFieldsTooLargeError, match="header fields"):
        check_auth(request([(b"x-%d" % i, b"1") for i in range(4)]), options)
    with pytest.raises(HeaderFieldsTooLargeError, match="200 bytes"):
        check_auth(request([(b"x-big", b"a" * 300)]), options)
    with pytest.raises(AuthenticationError):  # within the limits: the key is checked
        check_auth(request([(b"x-small", b"a")]), options)
    check_auth(request([(b"authorization", b"Bearer sk")]), options)
