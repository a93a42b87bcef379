"""The standalone router's HTTP/1.1 server: an asyncio protocol that runs the router's ASGI application.

Job: accept connections, parse each request with httptools (llhttp, the parser uvicorn serves
with), run the application once per request with the ASGI ``http`` scope, write its answer,
and keep the connection for the next request; run the application's lifespan around serving;
stop gracefully on SIGTERM or SIGINT (no new connection; the answers in flight get up to
``drain_s``; then whatever is left is cancelled and closed).

Why our own and not uvicorn: the router's whole job per request is a few writes, and on a local
socket every write wakes the process that reads it. Uvicorn writes each ASGI message when it is
sent: an answer's head, each relayed chunk and the chunked end are one system call each. This
server holds an answer's head until its first chunk (or the loop's next turn, when the chunk is
not there yet) and writes the two at once, writes a last chunk and the chunked end at once, and
dispatches a request through fewer objects. (Holding every write to the loop's next turn would
save more calls on a quiet loop and delay every answer on a busy one.) Measured in docs/benchmarks/router_overhead.md.

Contract kept from uvicorn's: a request whose line and headers exceed ``max_head_bytes`` or
carry more than ``max_header_count`` fields is answered 431 and its connection closed before the
application sees it; an unparsable request 400 (connection closed); HTTP/1.0 and
``Connection: close`` close after the answer; ``Expect: 100-continue`` is answered when the
application first asks for the body; pipelined requests are answered in order; a connection
idle for ``keepalive_s`` is closed, and a request head not whole within ``head_timeout_s`` of its
first byte is answered 408 (a client sending a header a byte at a time holds no connection for
long); a client that takes nothing for ``send_timeout_s`` while its answer waits is cut; the
client going away is ``http.disconnect`` to the
application; an application that fails before its answer's head gets a 500, after it the
connection is cut. Every answer carries ``date``.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import httptools

log = logging.getLogger(__name__)

# ASGI's shapes (as starlette.types spells them).
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
# What a refusal the application never sees says: (status, reason) -> (its headers, its body).
Refusal = Callable[[int, str], tuple[list[tuple[bytes, bytes]], bytes]]

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_REASONS = {
    100: "Continue",
    200: "OK",
    201: "Created",
    204: "No Content",
    304: "Not Modified",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HEAD_TOO_LARGE = "the request line and headers are larger than the router accepts"
# Statuses whose answers never have a body (RFC 9110 6.4.1).
_BODILESS = frozenset({204, 304})


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n".encode("latin-1")
    return line


def plain_refusal(status: int, text: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A refusal as plain text (the server's default)."""
    return [(b"content-type", b"text/plain; charset=utf-8")], text.encode()


class _Clock:
    """The ``date`` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._header = b""

    def date_header(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._header = b"date: " + email.utils.formatdate(now, usegmt=True).encode("latin-1") + b"\r\n"
        return self._header


@dataclass(frozen=True)
class ServerLimits:
    """What one request may be (431 past either head limit) and how connections are kept."""

    max_head_bytes: int
    max_header_count: int
    keepalive_s: float = 5.0  # an idle kept-alive connection is closed after this (uvicorn's default)
    head_timeout_s: float = 60.0  # a request head not whole this long after it began: 408 (nginx's default)
    send_timeout_s: float = 60.0  # a client that takes nothing this long while output waits is cut (nginx's)
    high_water: int = 64 * 1024  # request body bytes queued and not yet taken before reading pauses


class _Exchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` of the application run for it."""

    __slots__ = (
        "body",
        "body_size",
        "bodiless",
        "chunked",
        "complete",
        "connection",
        "end_taken",
        "expect_continue",
        "keep_alive",
        "more_body",
        "remaining",
        "scope",
        "started",
        "waiter",
    )

    def __init__(self, connection: HttpConnection, scope: dict[str, Any], keep_alive: bool, expect: bool) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect
        self.body: deque[bytes] = deque()
        self.body_size = 0
        self.more_body = True
        self.end_taken = False  # the application was given the body's last message
        self.started = False
        self.complete = False
        self.chunked = False
        self.bodiless = False  # a HEAD request's answer, or a 204 or 304: no body is written
        self.remaining: int | None = None  # bytes still owed by a declared content-length
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> Message:
        connection = self.connection
        while True:
            if self.body or (not self.more_body and not self.end_taken):
                body = self.body
                data = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                self.body_size = 0
                self.end_taken = not self.more_body
                connection.resume_reading()
                return {"type": "http.request", "body": data, "more_body": self.more_body}
            if connection.lost or self.complete:
                return {"type": "http.disconnect"}
            if self.expect_continue and not self.started:
                self.expect_continue = False
                connection.write_now(_CONTINUE)
            await self._wait()

    async def _wait(self) -> None:
        self.waiter = self.connection.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def send(self, message: Message) -> None:
        connection = self.connection
        if connection.write_paused and not connection.lost:
            await connection.drain()
        if connection.lost:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind}")
            self.started = True
            self.expect_continue = False
            status = int(message["status"])
            head = [status_line(status), connection.server.clock.date_header()]
            declared = closing = False
            for name, value in message.get("headers", ()):
                if b"\n" in name or b"\r" in name or b"\n" in value or b"\r" in value:
                    raise RuntimeError("a response header holds a line break")
                lower = name.lower()
                if lower == b"content-length":
                    declared = True
                    self.remaining = int(value)
                elif lower == b"transfer-encoding":
                    continue  # the framing is this server's
                elif lower == b"connection" and b"close" in value.lower():
                    self.keep_alive = False
                    closing = True
                head += (name, b": ", value, b"\r\n")
            bodiless = self.scope["method"] == "HEAD" or status in _BODILESS
            if not declared and not bodiless:
                if self.scope["http_version"] == "1.1":
                    self.chunked = True
                    head.append(b"transfer-encoding: chunked\r\n")
                else:
                    self.keep_alive = False  # HTTP/1.0: the body ends with the connection
            if not self.keep_alive and not closing:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            connection.write(b"".join(head))
            if bodiless:
                self.bodiless = True
                self.remaining = 0
            return
        if self.complete:
            raise RuntimeError(f"{kind} after the answer was complete")
        if kind != "http.response.body":
            raise RuntimeError(f"expected http.response.body, got {kind}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        out = b""
        if body and not self.bodiless:
            if self.chunked:
                out = b"%x\r\n%b\r\n" % (len(body), body)
            else:
                if self.remaining is not None:
                    if len(body) > self.remaining:
                        raise RuntimeError("the answer is longer than its content-length")
                    self.remaining -= len(body)
                out = body
        if not more and self.chunked:
            out += b"0\r\n\r\n"
        if out:
            connection.write_now(out)
        if not more:
            if self.remaining:
                raise RuntimeError("the answer is shorter than its content-length")
            self.complete = True
            self.wake()
            connection.answered(self)


class HttpConnection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._close_after_flush = False
        self._parser = httptools.HttpRequestParser(self)
        self._client: tuple[str, int] | None = None
        self._local: tuple[str, int] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # the request line and headers parsed so far
        self._head_fed = 0  # bytes received while the head was not whole
        self._in_head = False
        self._reading_paused = False
        self._current: _Exchange | None = None  # the exchange whose body is being read
        self._queue: deque[_Exchange] = deque()  # parsed requests not yet answered, oldest first
        self._task: asyncio.Task[None] | None = None  # the oldest exchange's application run
        self._idle_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: bytes | None = None  # the answer to a request refused while parsing it
        self._upgrade_body: tuple[_Exchange, int] | None = None  # an upgrade's body: bytes still to read

    # -- writes ---------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Hold ``data`` to go out with the next :meth:`write_now`, or at the loop's next turn at
        the latest: an answer's head rides with its first chunk when the application has it."""
        if self.lost:
            return
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def write_now(self, data: bytes) -> None:
        """Write ``data`` now, after what is held: one system call."""
        transport = self.transport
        if transport is None or self.lost:
            return
        if self._out:
            self._out.append(data)
            data = b"".join(self._out)
            self._out = []
        transport.write(data)

    def _flush(self) -> None:
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or self.lost:
            return
        if self._out:
            out = self._out
            self._out = []
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self._close_after_flush:
            transport.close()

    def close_soon(self) -> None:
        """Close once what is queued is written."""
        self._close_after_flush = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    async def drain(self) -> None:
        """Until the client takes what is queued; a client that takes nothing for ``send_timeout_s``
        is cut (the application sees it leave), so it cannot hold a replica's stream open."""
        if self.write_paused and not self.lost:
            self._drained = self._drained or self.loop.create_future()
            timer = self.loop.call_later(self.limits.send_timeout_s, self._send_expired)
            try:
                await self._drained
            finally:
                timer.cancel()

    def _send_expired(self) -> None:
        if self.write_paused and self.transport is not None and not self.lost:
            log.warning("a client took nothing for %g s: connection cut", self.limits.send_timeout_s)
            self.transport.abort()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self._client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self._local = (str(sock[0]), int(sock[1])) if isinstance(sock, tuple) else None
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        self._disarm_idle()
        self._cancel_head_timer()
        for exchange in self._queue:
            exchange.wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._disarm_idle()
        if self._upgrade_body is not None:
            self._take_upgrade_body(data)
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade_refused(data[int(exc.args[0]) :] if exc.args else b"")
            return
        except httptools.HttpParserError as exc:
            too_large = isinstance(exc.__context__, _TooLarge)
            self._refuse(431 if too_large else 400, HEAD_TOO_LARGE if too_large else "invalid HTTP request")
            return
        if self._in_head:
            # A head not whole yet: what llhttp buffers of it is bounded too, not only what it completed.
            self._head_fed += len(data)
            if self._head_fed > self.limits.max_head_bytes:
                self._refuse(431, HEAD_TOO_LARGE)
                return
        if self.idle and not self._in_head:  # between requests: the keep-alive clock runs
            self._arm_idle()

    def _upgrade_refused(self, rest: bytes) -> None:
        """An upgrade the router does not speak (``Upgrade: h2c`` from ``curl --http2``, a
        websocket): the request is answered as HTTP/1.1, as nginx does, and the connection closes
        after it. llhttp ends the message at its head; a declared body is read here instead."""
        exchange = self._queue[-1] if self._queue else None
        self._pause_reading()
        if exchange is None or exchange.started:
            return
        exchange.keep_alive = False
        declared = next((v for n, v in exchange.scope["headers"] if n == b"content-length"), None)
        chunked = any(n == b"transfer-encoding" for n, _ in exchange.scope["headers"])
        if chunked or (declared is not None and not declared.strip().isdigit()):
            # A chunked body after an upgrade is not read: cut, as a body that breaks off is.
            if self.transport is not None:
                self.transport.close()
            return
        length = int(declared) if declared is not None else 0
        if length:
            exchange.more_body = True
            self._upgrade_body = (exchange, length)
            self._take_upgrade_body(rest)

    def _take_upgrade_body(self, data: bytes) -> None:
        assert self._upgrade_body is not None
        exchange, left = self._upgrade_body
        part = data[:left]
        left -= len(part)
        if part:
            exchange.body.append(part)
            exchange.body_size += len(part)
        if left == 0:
            exchange.more_body = False
            self._upgrade_body = None
            self._pause_reading()  # nothing after it on this connection is read
        else:
            self._upgrade_body = (exchange, left)
            self.resume_reading()
        exchange.wake()

    def _refuse(self, status: int, text: str) -> None:
        """A request the application never sees: the server's refusal answer after the answers owed to the
        requests before it, then the connection closes. A body that breaks off mid-way cuts the
        connection instead (its request is already running: the application sees the client leave)."""
        self._pause_reading()
        if self._current is not None:
            if self.transport is not None:
                self.transport.close()
            return
        headers, body = self.server.refusal(status, text)
        head = [status_line(status), self.server.clock.date_header()]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self._refusal = b"".join(head) + body
        if self.idle:
            self._write_refusal()

    def _write_refusal(self) -> None:
        assert self._refusal is not None
        self.write(self._refusal)
        self.close_soon()

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._head_fed = 0
        self._in_head = True
        self._disarm_idle()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_expired)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_head_bytes:
            raise _TooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.limits.max_head_bytes or len(self._headers) > self.limits.max_header_count:
            raise _TooLarge

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        parser = self._parser
        parsed = httptools.parse_url(self._url)
        raw_path = parsed.path
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        version = parser.get_http_version()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": self._local,
            "client": self._client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self._headers,
            "state": dict(self.server.state),
        }
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in self._headers)
        exchange = _Exchange(self, scope, version != "1.0" and parser.should_keep_alive(), expect)
        self._current = exchange
        self._queue.append(exchange)
        if self._task is None:
            self._start(exchange)
        else:
            self._pause_reading()  # pipelined: read on once the answers before it are written

    def on_body(self, body: bytes) -> None:
        exchange = self._current
        if exchange is None:
            return
        exchange.body.append(body)
        exchange.body_size += len(body)
        if exchange.body_size > self.limits.high_water:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self._current
        if exchange is None:
            return
        exchange.more_body = False
        exchange.wake()
        self._current = None

    # -- running the application ----------------------------------------------------------
    def _start(self, exchange: _Exchange) -> None:
        task = self._task = self.loop.create_task(self._run(exchange))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _run(self, exchange: _Exchange) -> None:
        try:
            await self.server.app(exchange.scope, exchange.receive, exchange.send)
        except asyncio.CancelledError:
            if not exchange.complete:
                self.close_soon()
            raise
        except Exception:
            log.exception("the application failed on %s %s", exchange.scope["method"], exchange.scope["path"])
            if exchange.started:
                self.close_soon()  # the answer is cut: the client sees it end early
                return
            exchange.keep_alive = False
            head = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")]
            await exchange.send({"type": "http.response.start", "status": 500, "headers": head})
            await exchange.send({"type": "http.response.body", "body": b"Internal Server Error"})
            return
        if not exchange.complete:
            log.error("the application returned without a whole answer to %s", exchange.scope["path"])
            self.close_soon()

    def answered(self, exchange: _Exchange) -> None:
        """``exchange``'s answer was written whole: the next pipelined request runs, or the connection idles."""
        if self._queue and self._queue[0] is exchange:
            self._queue.popleft()
        self._task = None
        if not exchange.keep_alive or self.server.stopping:
            self.close_soon()
            return
        if exchange.more_body:  # the application answered before reading the whole body: not reusable
            self.close_soon()
            return
        if self._queue:
            self._start(self._queue[0])
        elif self._refusal is not None:
            self._write_refusal()
            return
        else:
            self._arm_idle()
        self.resume_reading()

    @property
    def idle(self) -> bool:
        return self._task is None and not self._queue

    def _arm_idle(self) -> None:
        self._disarm_idle()
        self._idle_timer = self.loop.call_later(self.limits.keepalive_s, self._idle_expired)

    def _disarm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_head and not self.lost:
            self._in_head = False
            self._refuse(408, "the request head did not arrive in time")

    def _idle_expired(self) -> None:
        if self.idle and self.transport is not None:
            self.transport.close()


class _TooLarge(Exception):
    """The request's line and headers passed the limits while they were parsed."""


class HttpServer:
    """Serves ``app`` on ``host:port`` until :meth:`stop`; see the module docstring."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        limits: ServerLimits,
        drain_s: float,
        sock: socket.socket | None = None,
        refusal: Refusal = plain_refusal,
    ) -> None:
        """``sock``: a bound socket to listen on instead of ``host:port``. ``refusal``: the headers
        and body of the answers to requests the application never sees (431, 408, 400)."""
        self.app = app
        self.sock = sock
        self.refusal = refusal
        self.host = host
        self.port = port
        self.limits = limits
        self.drain_s = drain_s
        self.clock = _Clock()
        self.state: dict[str, Any] = {}  # the lifespan's state, copied into every request's scope
        self.connections: set[HttpConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop it serves on (the running loop when asked before it serves)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def stop(self) -> None:
        """Stop accepting and drain (safe to call from a signal handler on the loop)."""
        if self._stop is not None:
            self._stop.set()

    async def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Run the lifespan's startup, serve until :meth:`stop`, drain, run its shutdown.
        ``ready``: called with the bound port once the server listens."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        lifespan = _Lifespan(self.app, self.state)
        await lifespan.startup()
        if self.sock is not None:
            server = await self._loop.create_server(lambda: HttpConnection(self), sock=self.sock, backlog=2048)
        else:
            server = await self._loop.create_server(lambda: HttpConnection(self), self.host, self.port, backlog=2048)
        try:
            port = server.sockets[0].getsockname()[1]
            log.info("router listening on http://%s:%d", self.host, port)
            if ready is not None:
                ready(port)
            await self._stop.wait()
        finally:
            self.stopping = True
            server.close()
            await self._drain()
            await lifespan.shutdown()

    async def _drain(self) -> None:
        for connection in list(self.connections):
            if connection.idle and connection.transport is not None:
                connection.transport.close()
        deadline = self.loop.time() + self.drain_s
        while self.tasks and self.loop.time() < deadline:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, deadline - self.loop.time()))
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5.0)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
        await asyncio.sleep(0)


class _Lifespan:
    """The ASGI lifespan protocol: startup before serving, shutdown after."""

    def __init__(self, app: App, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        try:
            await self.app(scope, self._inbox.get, self._outbox.put)
        except Exception as exc:
            await self._outbox.put({"type": "lifespan.failed", "message": repr(exc)})
            raise

    async def _step(self, kind: str) -> None:
        await self._inbox.put({"type": f"lifespan.{kind}"})
        answer = await self._outbox.get()
        if answer["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"the application's {kind} failed: {answer.get('message', answer['type'])}")

    async def startup(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._step("startup")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._step("shutdown")
        with contextlib.suppress(Exception):
            await self._task


def run(app: App, host: str, port: int, limits: ServerLimits, drain_s: float, refusal: Refusal = plain_refusal) -> None:
    """Serve ``app`` until SIGTERM or SIGINT (a second one cuts the drain short), on uvloop."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None

    async def main() -> None:
        server = HttpServer(app, host, port, limits, drain_s, refusal=refusal)
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                server.stop()
            else:
                server.drain_s = 0.0
                for task in list(server.tasks):
                    task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await server.serve()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
