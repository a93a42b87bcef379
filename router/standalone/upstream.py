"""The standalone router's HTTP client to its replicas: send a request, stream its answer back.

Job: one narrow interface over aiohttp's client, so that the proxy (proxy.py) names what went
wrong in its own terms rather than the library's: :class:`ConnectFailed` (no connection: the
replica is down), :class:`TimedOut` (no answer head in time), :class:`BrokenBeforeHead` (the
connection broke before the answer's head: often a kept-alive connection the replica had just
closed), and, while an answer streams, :class:`BrokenAnswer` (its ``timed_out`` telling a read
timeout from a connection that broke).

Why aiohttp and not httpx: a streamed request through httpx costs the router about 0.8 ms more
CPU than through aiohttp's client (docs/benchmarks/router_overhead.md measures both on the same
minimal relay), most of it httpcore's connection-pool bookkeeping and anyio's cancel scopes
around every socket operation; the router's own work is a fraction of either. Bodies are relayed
as the replica encodes them (no decompression) and carry only the headers the proxy gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDictProxy

# What aiohttp would add on its own: the proxy sends the client's content type, or none, as it came.
_NO_AUTO_HEADERS = ("Content-Type",)


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


class UpstreamAnswer:
    """A replica's answer whose head arrived: its status and headers; its body read or streamed once."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: CIMultiDictProxy[str] = response.headers
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = response.raw_headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; BrokenAnswer when the replica breaks off or stalls."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise BrokenAnswer(f"no byte within the read timeout: {exc!r}", timed_out=True) from exc
        except aiohttp.ClientError as exc:
            raise BrokenAnswer(f"{type(exc).__name__}: {exc}") from exc

    async def read(self) -> bytes:
        """The whole body (what could be read: b"" when it broke off)."""
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError):
            return b""

    def close(self) -> None:
        """Done with the answer: its connection is reused when the body was read whole, else closed."""
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


class Upstream:
    """A pool of connections to the replicas (aiohttp's session): send requests, fetch small answers."""

    def __init__(self, timeouts: Timeouts, keepalive_s: float = 2.0) -> None:
        # No connection limit: the router holds one upstream connection per open request, as any
        # reverse proxy; kept-alive ones are dropped before the replicas' own keep-alive ends.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.read_s),
            auto_decompress=False,
        )

    async def send(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> UpstreamAnswer:
        """Send one request; its answer once the head arrived (the body then streams from it)."""
        try:
            response = await self._session.request(
                method,
                url,
                headers=dict(headers),
                data=body or None,
                allow_redirects=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise ConnectFailed(f"no connection within the connect timeout: {exc!r}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise TimedOut(f"no answer within the read timeout: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise BrokenBeforeHead(f"{type(exc).__name__}: {exc}") from exc
        return UpstreamAnswer(response)

    async def fetch(
        self, method: str, url: str, headers: Mapping[str, str] | None = None, timeout_s: float | None = None
    ) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
        """One small request read whole: (status, raw headers, body); UpstreamError when it failed."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        try:
            async with self._session.request(
                method, url, headers=dict(headers or {}), allow_redirects=False, timeout=timeout
            ) as response:
                return response.status, response.raw_headers, await response.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise TimedOut(f"no answer in time: {exc!r}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise BrokenBeforeHead(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._session.close()
        # aiohttp closes its transports on the next loop iterations; let them go before the loop ends.
        await asyncio.sleep(0)
