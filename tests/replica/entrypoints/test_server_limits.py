"""Hostile clients against a real ``replica/entrypoints/openai/server.py`` (uvicorn on loopback, raw sockets).

Huge or numerous headers are refused (431) before the API-key check; a head
or body that does not arrive is timed out (408); connections beyond the limit
get 503; a client that sends its body slowly holds no in-flight slot; a client
that never reads its stream is disconnected and its request aborted. Timeouts
are configured small and asserted by status codes and metrics, never by clocks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from server_helpers import free_port, metric, wait_for_health

pytestmark = pytest.mark.slow

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH_LINE = f"Authorization: Bearer {KEY}\r\n".encode()
HEAD_LIMIT = 8 * 1024
# Bounded waits for what the server does on its own (generous: no timing assertion).
WAIT_S = 60.0


@contextmanager
def running_server(model, **limits) -> Iterator[str]:
    """``serve()`` with ServerConfig(**limits) on a free loopback port, in a thread; yields its base URL."""
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.entrypoints.openai.server import ServerConfig, serve

    engine = AsyncEngine(EngineConfig(model=str(model), max_model_len=1024))
    port = free_port()
    config = ServerConfig(**limits)
    thread = threading.Thread(
        target=serve,
        args=(engine,),
        daemon=True,
        kwargs=dict(host="127.0.0.1", port=port, log_level="warning", api_keys=[KEY], config=config),
    )
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base)
        yield base
    finally:
        # With its engine gone the server stops itself (its engine watchdog), so no thread outlives the test.
        asyncio.run(engine.shutdown())
        thread.join(timeout=WAIT_S)


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def exchange(base: str, data: bytes, *, read_s: float = WAIT_S) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``read_s`` passes)."""
    with socket.create_connection(("127.0.0.1", port_of(base))) as sock:
        sock.settimeout(read_s)
        try:
            sock.sendall(data)
        except OSError:  # the server answered and closed before taking everything: read its answer
            pass
        return read_until_closed(sock)


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def status_and_error(answer: bytes) -> tuple[int, dict]:
    """The status code and the OpenAI error of a raw HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), answer[:200]
    status = int(head.split()[1])
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return status, json.loads(body)["error"]


def post_head(path: str, content_length: int, *, auth: bool = True) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: replica\r\nContent-Type: application/json\r\n"
        + (f"Authorization: Bearer {KEY}\r\n" if auth else "")
        + f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


@pytest.fixture(scope="module")
def strict(ckpt):
    """Small limits and 0.5 s timeouts, one request in flight at most."""
    with running_server(
        ckpt,
        max_in_flight=1,
        h11_max_incomplete_event_size=HEAD_LIMIT,
        h11_max_header_count=50,
        limit_concurrency=8,
        client_header_timeout_s=0.5,
        client_body_timeout_s=0.5,
        send_timeout_s=0.5,
    ) as base:
        yield base


def test_a_header_over_the_size_limit_is_431_before_the_key_is_checked(strict):
    whole = b"GET /v1/models HTTP/1.1\r\nHost: replica\r\nX-Big: " + b"a" * (4 * HEAD_LIMIT) + b"\r\n\r\n"
    status, error = status_and_error(exchange(strict, whole))
    assert status == 431 and error["code"] == "request_header_fields_too_large", error
    # An unfinished head is refused once the limit is buffered, not held until it ends.
    unfinished = b"GET /v1/models HTTP/1.1\r\nHost: replica\r\nX-Big: " + b"a" * (2 * HEAD_LIMIT)
    status, error = status_and_error(exchange(strict, unfinished))
    assert status == 431, error
    # Within the limit, the same request reaches the API-key check.
    small = b"GET /v1/models HTTP/1.1\r\nHost: replica\r\nConnection: close\r\nX-Big: aaaa\r\n\r\n"
    status, error = status_and_error(exchange(strict, small))
    assert status == 401 and error["code"] == "invalid_api_key"


def test_too_many_headers_are_431(strict):
    many = b"GET /v1/models HTTP/1.1\r\nHost: replica\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(60)) + b"\r\n"
    status, error = status_and_error(exchange(strict, many))
    assert status == 431 and "header fields" in error["message"], error


def test_a_head_that_does_not_arrive_is_408(strict):
    status, error = status_and_error(exchange(strict, b"GET /v1/models HTTP/1.1\r\nHost: replica\r\n"))
    assert status == 408 and error["code"] == "request_timeout", error


def test_a_body_that_does_not_arrive_is_408_and_holds_no_slot(strict):
    status, error = status_and_error(exchange(strict, post_head("/v1/completions", 100) + b'{"prompt"'))
    assert status == 408 and error["code"] == "request_timeout", error
    ok = httpx.post(f"{strict}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=WAIT_S)
    assert ok.status_code == 200, ok.text


@pytest.fixture
def eight_connections(ckpt):
    """At most 8 connections, and idle ones kept (strict's 0.5 s head timeout would close them)."""
    with running_server(ckpt, limit_concurrency=8, client_header_timeout_s=WAIT_S) as base:
        yield base


def test_connections_over_the_limit_get_503_with_retry_after(eight_connections):
    strict = eight_connections
    idle = [socket.create_connection(("127.0.0.1", port_of(strict))) for _ in range(8)]
    try:
        answer = exchange(strict, b"GET /v1/models HTTP/1.1\r\nHost: replica\r\n" + AUTH_LINE + b"\r\n")
        status, error = status_and_error(answer)
        assert status == 503 and error["code"] == "too_many_connections", error
        assert b"\r\nretry-after: 1\r\n" in answer.lower()
    finally:
        for sock in idle:
            sock.close()
    for _ in range(100):  # the server notices the closed connections
        if httpx.get(f"{strict}/v1/models", headers=AUTH, timeout=WAIT_S).status_code == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server kept refusing after the idle connections closed")


def test_a_client_that_never_reads_its_stream_is_cut_and_its_request_aborted(strict):
    # Enough output to fill the loopback socket buffers (about 3 MB here) and uvicorn's write buffer:
    # 8 choices of a few hundred tokens with 20 top logprobs each, about 1 KB per chunk.
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 600,
            "ignore_eos": True,
            "n": 8,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port_of(strict)))
    try:
        sock.sendall(post_head("/v1/chat/completions", len(body)) + body)
        deadline = time.monotonic() + 10 * WAIT_S
        while time.monotonic() < deadline:
            ok = httpx.post(
                f"{strict}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=WAIT_S
            )
            if ok.status_code == 200:
                break
            assert ok.status_code == 429, ok.text  # the stalled stream holds the one slot
            time.sleep(0.2)
        else:
            pytest.fail("the stalled stream kept its in-flight slot")
        metrics = httpx.get(f"{strict}/metrics", timeout=WAIT_S).text
        assert metric(metrics, "vllm:num_requests_running") == 0
        assert metric(metrics, "vllm:request_success_total", finished_reason="abort") >= 1
    finally:
        sock.close()


def test_slow_bodies_do_not_take_the_in_flight_slots(ckpt):
    with running_server(ckpt, max_in_flight=2, client_body_timeout_s=WAIT_S) as base:
        port = port_of(base)
        silent = socket.create_connection(("127.0.0.1", port))
        trickle = socket.create_connection(("127.0.0.1", port))
        try:
            silent.sendall(post_head("/v1/completions", 64))
            trickle.sendall(post_head("/v1/completions", 64))
            for byte in b'{"prompt": "hi", ':  # a byte at a time, never the whole body
                trickle.sendall(bytes([byte]))
            for _ in range(2):  # each would have been a 429 with the slots taken before the body
                ok = httpx.post(
                    f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=WAIT_S
                )
                assert ok.status_code == 200, ok.text
        finally:
            silent.close()
            trickle.close()
