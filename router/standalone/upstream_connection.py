"""One kept-alive HTTP/1.1 connection from the router to a replica, read at the protocol level.

Job: :class:`UpstreamConnection` is an asyncio protocol that parses the answers to the requests
written on it with httptools (llhttp, the parser uvicorn serves with): it keeps the answer's
status and raw headers, queues its body as it arrives (chunked framing taken off), and says when
the answer is whole, when the connection broke, and whether the connection may carry another
request. It holds one request at a time; the pool that lends it out is upstream.py's.

Flow control: past ``high_water`` bytes queued and not yet taken, the connection stops reading
(the replica's writes back up in TCP), and reads again once the queue is taken.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

import httptools

# Bytes of an answer queued and not yet taken before the connection stops reading.
HIGH_WATER = 256 * 1024
# Statuses whose answers never have a body (RFC 9110 6.4.1).
_BODILESS = frozenset({204, 304})


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class UpstreamConnection(asyncio.Protocol):
    """A connection to one replica and the answer being read on it (see the module docstring).

    Read by its owner between awaits of :meth:`wait`: ``head_done`` (``status`` and ``raw_headers``
    are set), ``body`` (queued chunks, taken with :meth:`take`), ``complete`` (the answer is whole),
    ``error`` (the connection broke or the answer did not parse before it was whole).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, high_water: int = HIGH_WATER) -> None:
        self._loop = loop
        self._high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self.reset()

    def reset(self) -> None:
        """Ready to read the answer to the next request written on it."""
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self._until_close = False
        self.body: deque[bytes] = deque()
        self._queued = 0
        self._paused = False
        self.error: BaseException | None = None

    @property
    def reusable(self) -> bool:
        """Whether another request may be written on it: its answer was whole and the replica keeps it open."""
        return self.complete and self.keep_alive and self.error is None and not self.lost and not self._paused

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout_s: float) -> bool:
        """Until something changed (a head, body bytes, the end, a break): False when ``timeout_s`` passed first."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout_s, _expire, waiter)
        try:
            return bool(await waiter)
        finally:
            timer.cancel()
            self._waiter = None

    def take(self) -> bytes:
        """The body bytes queued so far, as one chunk (b"" when none)."""
        body = self.body
        if not body:
            return b""
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._queued = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports: the same methods

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete:
                self.error = exc
            self.close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.complete:
            if self.head_done and self._until_close and exc is None:
                self.complete = True  # a body the replica ended by closing the connection
            else:
                self.error = exc or ConnectionResetError("the replica closed the connection")
        self._wake()

    # -- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue): the final one follows on the same bytes
            return
        self.keep_alive = self._parser.should_keep_alive()
        if self.status >= 200 and self.status not in _BODILESS:
            names = {name.lower() for name, _ in self.raw_headers}
            self._until_close = b"content-length" not in names and b"transfer-encoding" not in names
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self._queued += len(body)
        if self._queued > self._high_water and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.raw_headers = []
            return
        self.complete = True
        self._wake()
