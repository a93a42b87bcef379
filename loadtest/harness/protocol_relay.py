"""The floor of a relay written in Python: HTTP/1.1 bytes passed through at the protocol level.

A benchmark fixture for ``bench_router_overhead --router protocol-relay``, not a router: it
routes nothing, checks nothing and sends every request to one upstream. On uvloop's event
loop, httptools parses each client request (to rebuild its head for the upstream) and each
upstream answer (only to find where it ends); the answer's bytes go to the client as they
arrive, chunked framing included. Connections are kept alive on both sides, upstream ones
in a pool. What it measures: how much of the standalone router's added latency is the HTTP
stack it is built on (uvicorn, Starlette, aiohttp's client) rather than Python itself.

``python -m prefixserve.loadtest.harness.protocol_relay PORT UPSTREAM_PORT`` (both on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import cast

import httptools
import uvloop

HOST = "127.0.0.1"


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive connection to the upstream, relaying one answer at a time to its client."""

    def __init__(self, pool: list[UpstreamConnection]) -> None:
        self.pool = pool
        self.client: ClientConnection | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass, the same methods

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            return
        client.write(data)
        self.parser.feed_data(data)
        if self.ended:  # the whole answer went through: back to the pool, the client's next request
            self.ended = False
            self.client = None
            self.parser = httptools.HttpResponseParser(self)
            self.pool.append(self)
            client.answered()

    def on_message_complete(self) -> None:
        self.ended = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.close()


class ClientConnection(asyncio.Protocol):
    """One client connection: its requests parsed and sent upstream in order, one in flight."""

    def __init__(self, upstream_port: int, pool: list[UpstreamConnection]) -> None:
        self.upstream_port = upstream_port
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.waiting: deque[bytes] = deque()
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass, the same methods

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        head = [b"%s %s HTTP/1.1\r\nhost: %s:%d\r\n" % (method, self.url, HOST.encode(), self.upstream_port)]
        head += [name + b": " + value + b"\r\n" for name, value in self.headers if name.lower() != b"host"]
        self.waiting.append(b"".join(head) + b"\r\n" + b"".join(self.body))
        self.headers, self.body = [], []
        if not self.busy:
            self.answered()

    def answered(self) -> None:
        """The answer in flight ended: send the next waiting request, if any."""
        self.busy = bool(self.waiting)
        if self.waiting:
            asyncio.ensure_future(self._send(self.waiting.popleft()))

    async def _send(self, request: bytes) -> None:
        upstream = self.pool.pop() if self.pool else None
        if upstream is None:
            loop = asyncio.get_running_loop()
            try:
                _, upstream = await loop.create_connection(
                    lambda: UpstreamConnection(self.pool), HOST, self.upstream_port
                )
            except OSError:
                self.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.close()
                return
        upstream.client = self
        assert upstream.transport is not None
        upstream.transport.write(request)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(port: int, upstream_port: int) -> None:
    pool: list[UpstreamConnection] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientConnection(upstream_port, pool), HOST, port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("usage: python -m prefixserve.loadtest.harness.protocol_relay PORT UPSTREAM_PORT", file=sys.stderr)
        return 2
    uvloop.run(serve(int(args[0]), int(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
