"""The router's HTTP server (router/standalone/http_server.py) at the protocol level: raw sockets
against a small ASGI app, and the server's writes recorded on a transport of the test's own."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httptools
import pytest
from standalone_router_helpers import RouterServerThread, wait_until

from prefixserve.router.standalone.http_server import HttpConnection, HttpServer, ServerLimits

LIMITS = ServerLimits(max_head_bytes=1024, max_header_count=10)


class App:
    """A small ASGI app: what each path does is the test's subject; it records what it saw."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()
        self.release = threading.Event()
        self.flooded = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        path = scope["path"]
        if path == "/echo":
            body = b""
            more = True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            length = str(len(body)).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]})
            await send({"type": "http.response.body", "body": body})
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/scope":
            info = {k: scope[k] for k in ("method", "path", "http_version")}
            info["raw_path"] = scope["raw_path"].decode()
            info["query_string"] = scope["query_string"].decode()
            info["headers"] = [[k.decode(), v.decode()] for k, v in scope["headers"]]
            body = json.dumps(info).encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
            )
            await send({"type": "http.response.body", "body": body})
        elif path == "/wait-disconnect":
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
        elif path == "/slow":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
            await send({"type": "http.response.body", "body": b"done"})
        elif path == "/flood":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(10_000):  # far more than socket buffers hold: the send waits for the client
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
                if self.disconnected.is_set():
                    break
            self.flooded.set()
        elif path == "/close":
            head = [(b"connection", b"close"), (b"content-length", b"2")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": b"ok"})
        elif path == "/overlong":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b"more than declared"})
        elif path == "/fail-before":
            raise RuntimeError("failed before the head")
        elif path == "/fail-after":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("failed mid-answer")


class Answers:
    """httptools' callbacks: the answers read off a socket, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}

    def on_message_begin(self) -> None:
        self.current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current["body"] += body

    def on_message_complete(self) -> None:
        if self.current["status"] >= 200:
            self.done.append(self.current)


def read_answers(sock: socket.socket, n: int) -> tuple[list[dict[str, Any]], bool]:
    """The first ``n`` answers on ``sock`` and whether the server then closed it (read to the end
    when fewer than ``n`` came)."""
    answers = Answers()
    sock.settimeout(30)
    closed = False
    while len(answers.done) < n:
        data = sock.recv(65536)
        if not data:
            closed = True
            break
        answers.parser.feed_data(data)
    return answers.done, closed


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server writes on ``sock`` until it closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def closed_after(sock: socket.socket) -> bool:
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@contextmanager
def served(app: App | None = None, limits: ServerLimits = LIMITS) -> Iterator[tuple[RouterServerThread, App]]:
    app = app or App()
    with RouterServerThread(app, limits) as server:
        yield server, app


def connect(server: RouterServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def request(path: str, body: bytes = b"", method: str = "POST", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_a_kept_alive_connection_carries_request_after_request() -> None:
    with served() as (server, _), connect(server) as sock:
        for text in (b"first", b"second", b""):
            sock.sendall(request("/echo", text))
            answers, closed = read_answers(sock, 1)
            assert not closed and answers[0]["status"] == 200 and answers[0]["body"] == text
            assert "date" in answers[0]["headers"]


def test_pipelined_requests_are_answered_in_order() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(request("/echo", b"a") + request("/stream") + request("/echo", b"c"))
        answers, _ = read_answers(sock, 3)
        assert [a["body"] for a in answers] == [b"a", b"one two three", b"c"]
        assert answers[1]["headers"]["transfer-encoding"] == "chunked"


def test_the_scope_holds_the_path_decoded_the_raw_path_and_query_as_sent_and_lower_case_headers() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(request("/sc%6Fpe?x=%2F&y=1", extra="X-Custom: Value\r\n"))
        (answer,), _ = read_answers(sock, 1)
        info = json.loads(answer["body"])
        assert info["path"] == "/scope" and info["raw_path"] == "/sc%6Fpe" and info["query_string"] == "x=%2F&y=1"
        assert ["x-custom", "Value"] in info["headers"] and info["method"] == "POST" and info["http_version"] == "1.1"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (f"GET /echo HTTP/1.1\r\nhost: t\r\nx-big: {'v' * 2000}\r\n\r\n", 431),  # a header past the byte limit
        ("GET /echo HTTP/1.1\r\n" + "".join(f"x-{i}: v\r\n" for i in range(11)) + "\r\n", 431),  # past the count
        (f"GET /echo HTTP/1.1\r\nhost: t\r\nx-big: {'v' * 3000}", 431),  # never ends, past the limit
        ("NOT HTTP AT ALL\r\n\r\n", 400),
    ],
)
def test_a_head_past_the_limits_or_unparsable_is_refused_and_the_connection_closed(head: str, status: int) -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(head.encode())
        answers, _ = read_answers(sock, 1)
        assert answers[0]["status"] == status and answers[0]["headers"]["connection"] == "close"
        assert closed_after(sock)


def test_a_head_that_does_not_arrive_in_time_is_refused_408_however_it_trickles() -> None:
    limits = ServerLimits(max_head_bytes=1024, max_header_count=10, keepalive_s=1.0, head_timeout_s=3.0)
    with served(limits=limits) as (server, _), connect(server) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nx-slow: ")
        for _ in range(4):  # a byte at a time, more often than the keep-alive timeout
            time.sleep(0.1)
            sock.sendall(b"x")
        answers, _ = read_answers(sock, 1)
        assert answers[0]["status"] == 408
        assert closed_after(sock)


def test_a_refusal_after_a_good_request_comes_after_its_answer() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(request("/echo", b"ok") + b"\x00\x01garbage\r\n\r\n")
        answers, closed = read_answers(sock, 2)
        assert [a["status"] for a in answers] == [200, 400] and answers[0]["body"] == b"ok"


def test_an_upgrade_the_router_does_not_speak_is_answered_as_http_1_1_with_its_body() -> None:
    head = b"POST /echo HTTP/1.1\r\nhost: t\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
    with served() as (server, _), connect(server) as sock:  # curl --http2 on an http:// URL
        sock.sendall(head + b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\ncontent-length: 11\r\n\r\nhello")
        time.sleep(0.2)  # the body's rest in a later segment
        sock.sendall(b" world")
        answers, _ = read_answers(sock, 1)
        assert answers[0]["status"] == 200 and answers[0]["body"] == b"hello world"
        assert answers[0]["headers"]["connection"] == "close" and closed_after(sock)


def test_expect_100_continue_is_answered_when_the_app_asks_for_the_body() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
        sock.settimeout(30)
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        answers, _ = read_answers(sock, 1)
        assert answers[0]["body"] == b"hello"


def test_an_http_1_0_answer_is_not_chunked_and_ends_with_the_connection() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        data = read_to_close(sock)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower() and b"connection: close" in head
        assert body == b"one two three"


def test_an_app_that_closes_the_connection_names_it_once() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(request("/close"))
        data = read_to_close(sock)
        assert data.lower().count(b"connection: close") == 1 and data.endswith(b"\r\n\r\nok")


def test_an_answer_longer_than_its_content_length_is_cut() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(request("/overlong"))
        data = read_to_close(sock)
        assert b"more than declared" not in data  # the extra bytes never reach the client


def test_a_head_request_gets_no_body() -> None:
    with served() as (server, _), connect(server) as sock:
        sock.sendall(b"HEAD /stream HTTP/1.1\r\nhost: t\r\n\r\n" + request("/echo", b"after"))
        data = b""
        while data.count(b"HTTP/1.1") < 2 or not data.endswith(b"after"):
            data += sock.recv(65536)
        first, _, rest = data.partition(b"\r\n\r\n")
        assert rest.startswith(b"HTTP/1.1 200")  # nothing between the HEAD answer's head and the next answer


def test_a_client_that_leaves_is_an_http_disconnect_to_the_app() -> None:
    with served() as (server, app):
        sock = connect(server)
        sock.sendall(request("/wait-disconnect", b"x"))
        data = b""
        while b"first" not in data:
            data += sock.recv(65536)
        sock.close()
        wait_until(app.disconnected.is_set, "the app saw the client leave")


def test_a_client_that_takes_nothing_is_cut_after_the_send_timeout() -> None:
    limits = ServerLimits(max_head_bytes=1024, max_header_count=10, send_timeout_s=0.5)
    with served(limits=limits) as (server, app), connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request("/flood"))
        wait_until(app.flooded.is_set, "the app's sends ended once the client was cut")


def test_an_app_that_fails_before_its_head_answers_500_and_after_it_cuts_the_connection() -> None:
    with served() as (server, _):
        with connect(server) as sock:
            sock.sendall(request("/fail-before"))
            answers, _ = read_answers(sock, 1)
            assert answers[0]["status"] == 500
        with connect(server) as sock:
            sock.sendall(request("/fail-after"))
            answers, closed = read_answers(sock, 1)
            assert answers == [] and closed  # the answer never completes: the client sees it cut


def test_stop_refuses_new_connections_and_lets_the_answer_in_flight_finish() -> None:
    app = App()
    server = RouterServerThread(app, LIMITS, drain_s=30)
    with server:
        sock = connect(server)
        sock.sendall(request("/slow"))
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
        assert server.loop is not None
        server.loop.call_soon_threadsafe(server.server.stop)
        wait_until(lambda: not can_connect(server.port), "the server stopped accepting")
        app.release.set()
        rest = read_to_close(sock)
        assert b"done" in rest and rest.endswith(b"0\r\n\r\n")
        sock.close()
    assert not server.thread.is_alive()


def can_connect(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


class RecordingTransport(asyncio.Transport):
    """Records every write the server makes (each would be one system call on a socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else default

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _answer_on_recording_transport(path: str) -> list[bytes]:
    server = HttpServer(App(), "127.0.0.1", 0, LIMITS, drain_s=1)
    connection = HttpConnection(server)
    transport = RecordingTransport()
    connection.connection_made(transport)
    connection.data_received(b"GET " + path.encode() + b" HTTP/1.1\r\nhost: t\r\n\r\n")
    for _ in range(50):
        await asyncio.sleep(0)
        if connection.idle and not connection._flush_scheduled:
            break
    connection.connection_lost(None)
    return transport.writes


def test_an_answers_head_goes_out_with_its_first_chunk() -> None:
    writes = asyncio.run(_answer_on_recording_transport("/stream"))
    # uvicorn: five writes (the head, three chunks, the chunked end)
    assert writes[1:] == [b"4\r\ntwo \r\n", b"5\r\nthree\r\n", b"0\r\n\r\n"]
    head, _, first = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and first == b"4\r\none \r\n"
    (answer,) = asyncio.run(_answer_on_recording_transport("/echo"))
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"content-length: 0\r\n\r\n")
