"""The standalone router's HTTP client to its replicas: send a request, stream its answer back.

Job: one narrow interface over kept-alive HTTP/1.1 connections (upstream_connection.py), so that
the proxy (proxy.py) names what went wrong in its own terms: :class:`ConnectFailed` (no
connection: the replica is down), :class:`TimedOut` (no answer head in time),
:class:`BrokenBeforeHead` (the connection broke before the answer's head: often a kept-alive
connection the replica had just closed), and, while an answer streams, :class:`BrokenAnswer` (its
``timed_out`` telling a read timeout from a connection that broke).

Why a client of our own at the protocol level and not aiohttp's or httpx's: the router's job per
request is to write one head and body and pass the answer's bytes on, and a general client's
machinery around that (connection-pool bookkeeping, per-request timer, trace and reader objects,
anyio cancel scopes in httpx) is work it does not need: with this client the router spends
10-15% less CPU per request than with aiohttp's, and aiohttp's spent 0.8 ms less than httpx's
(docs/benchmarks/router_overhead.md). Parsing is httptools' (llhttp, as uvicorn's); the
connection does the rest. Bodies are relayed as the replica encodes them (no decompression), and
a request carries only the headers the proxy gives it, plus ``host`` and ``content-length``.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefixserve.router.standalone.upstream_connection import UpstreamConnection


class UpstreamError(Exception):
    """A request to a replica failed before its answer's head (subclasses say how)."""


class ConnectFailed(UpstreamError):
    """No connection to the replica (refused, unreachable, or not within the connect timeout)."""


class TimedOut(UpstreamError):
    """Connected, but the answer's head did not come within the read timeout."""


class BrokenBeforeHead(UpstreamError):
    """The connection broke before the answer's head."""


class BrokenAnswer(Exception):
    """The answer broke off while streaming; ``timed_out``: no byte came within the read timeout."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Timeouts:
    """Seconds: to connect, and between two reads of an answer (its head included)."""

    connect_s: float
    read_s: float


@dataclass(frozen=True)
class Origin:
    """Where a replica listens: its scheme, host and port, and the ``host`` header naming it."""

    scheme: str
    host: str
    port: int
    netloc: str


def split_url(url: str) -> tuple[Origin, str]:
    """A replica URL's origin and its target (path and query); ValueError for a URL not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port, parts.netloc), target


def request_bytes(method: str, target: str, origin: Origin, headers: Mapping[str, str], body: bytes) -> bytes:
    """The request's head and body as written on the connection."""
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(f"content-length: {len(body)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + body


class UpstreamAnswer:
    """A replica's answer whose head arrived: its status and headers; its body read or streamed once.

    ``header(name)``: one of the answer's headers by lower-case name (the last of a repeated one);
    ``raw_headers``: all of them as sent.
    """

    def __init__(
        self, connection: UpstreamConnection, read_s: float, release: Callable[[UpstreamConnection], None]
    ) -> None:
        self._connection = connection
        self._read_s = read_s
        self._release = release
        self.status = connection.status
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = tuple(connection.raw_headers)
        self._closed = False

    def header(self, name: str, default: str = "") -> str:
        """The answer's header ``name`` (lower-case; the last of a repeated one), else ``default``."""
        wanted = name.encode("latin-1")
        for key, value in reversed(self.raw_headers):
            if key.lower() == wanted:
                return value.decode("latin-1")
        return default

    async def chunks(self, before_wait: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; BrokenAnswer when the replica breaks off or stalls.
        ``before_wait``: called each time before the iterator waits for the replica (never while
        bytes are already there)."""
        connection = self._connection
        while True:
            data = connection.take()
            if data:
                yield data
            elif connection.complete:
                return
            elif connection.error is not None:
                error = connection.error
                raise BrokenAnswer(f"{type(error).__name__}: {error}")
            else:
                if before_wait is not None:
                    before_wait()
                if not await connection.wait(self._read_s):
                    raise BrokenAnswer(f"no byte within the read timeout ({self._read_s:g} s)", timed_out=True)

    async def read(self) -> bytes:
        """The whole body (what could be read: b"" when it broke off)."""
        try:
            return b"".join([chunk async for chunk in self.chunks()])
        except BrokenAnswer:
            return b""

    def close(self) -> None:
        """Done with the answer: its connection is reused when the body was read whole, else closed."""
        if not self._closed:
            self._closed = True
            self._release(self._connection)


class Upstream:
    """A pool of kept-alive connections to the replicas: send requests, fetch small answers."""

    def __init__(self, timeouts: Timeouts, keepalive_s: float = 2.0) -> None:
        # No connection limit: the router holds one upstream connection per open request, as any
        # reverse proxy; idle ones are dropped before the replicas' own keep-alive ends.
        self._timeouts = timeouts
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._origins: dict[str, tuple[Origin, str]] = {}
        self._open: set[UpstreamConnection] = set()
        self._ssl: ssl.SSLContext | None = None

    def _split(self, url: str) -> tuple[Origin, str]:
        split = self._origins.get(url)
        if split is None:
            split = split_url(url)
            if len(self._origins) < 4096:  # the replicas' URLs and paths: few, unless clients make up paths
                self._origins[url] = split
        return split

    def _idle_connection(self, idle: list[UpstreamConnection]) -> UpstreamConnection | None:
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.lost and now - connection.idle_since < self._keepalive_s:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._timeouts.connect_s):
                _, connection = await loop.create_connection(
                    lambda: UpstreamConnection(loop), origin.host, origin.port, ssl=context
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {origin.netloc} within {self._timeouts.connect_s:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return connection

    async def send(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> UpstreamAnswer:
        """Send one request; its answer once the head arrived (the body then streams from it)."""
        origin, target = self._split(url)
        data = request_bytes(method, target, origin, headers, body)
        idle = self._idle.setdefault(origin, [])
        connection = self._idle_connection(idle) or await self._connect(origin)
        self._open.add(connection)
        try:
            connection.write(data)
            while not connection.head_done:
                if connection.error is not None:
                    error = connection.error
                    raise BrokenBeforeHead(f"{type(error).__name__}: {error}")
                if not await connection.wait(self._timeouts.read_s):
                    raise TimedOut(f"no answer head within {self._timeouts.read_s:g} s")
        except BaseException:
            connection.close()
            self._open.discard(connection)
            raise
        return UpstreamAnswer(connection, self._timeouts.read_s, functools.partial(self._release, idle))

    def _release(self, idle: list[UpstreamConnection], connection: UpstreamConnection) -> None:
        self._open.discard(connection)
        if connection.reusable:
            connection.reset()
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            connection.close()

    async def fetch(
        self, method: str, url: str, headers: Mapping[str, str] | None = None, timeout_s: float | None = None
    ) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
        """One small request read whole: (status, raw headers, body); UpstreamError when it failed."""
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self.send(method, url, headers or {}, b"")
                try:
                    body = b"".join([chunk async for chunk in answer.chunks()])
                finally:
                    answer.close()
        except TimeoutError as exc:
            raise TimedOut(f"no whole answer within {timeout_s:g} s") from exc
        except BrokenAnswer as exc:
            raise BrokenBeforeHead(str(exc)) from exc
        return answer.status, answer.raw_headers, body

    async def close(self) -> None:
        """Close every connection, idle or carrying an answer."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        for connection in self._open:
            connection.close()
        self._open.clear()
        # Transports close on the loop's next iterations; let them go before the loop ends.
        await asyncio.sleep(0)
