"""The router's HTTP/1.1 client to its replicas, against scripted servers on 127.0.0.1 (real sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from prefixserve.router.standalone.upstream import (
    BrokenAnswer,
    BrokenBeforeHead,
    ConnectFailed,
    TimedOut,
    Timeouts,
    Upstream,
    request_bytes,
    split_url,
)
from prefixserve.router.standalone.upstream_connection import UpstreamConnection

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Scripted:
    """A server whose connections run ``handler``; it counts the connections it accepted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request's head (and its body when it gives a length), recorded."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
        )
        request = head + (await reader.readexactly(length) if length else b"")
        self.requests.append(request)
        return request


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Scripted, str]]:
    scripted = Scripted(handler)
    server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield scripted, f"http://127.0.0.1:{port}"
    finally:
        server.close()


def client(read_s: float = 30.0) -> Upstream:
    return Upstream(Timeouts(connect_s=5.0, read_s=read_s))


async def test_a_kept_alive_connection_carries_the_next_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                await scripted.read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(OK)

    async with serving(handler) as (scripted, url):
        upstream = client()
        for _ in range(3):
            status, raw, body = await upstream.fetch("GET", url + "/health")
            assert (status, body) == (200, b"{}")
            assert (b"content-type", b"application/json") in raw
        await upstream.close()
    assert scripted.connections == 1
    assert scripted.requests[0].startswith(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1:")


async def test_a_chunked_stream_is_given_chunk_by_chunk_as_it_arrives() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await release.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")

    async with serving(handler) as (scripted, url):
        upstream = client()
        answer = await upstream.send("POST", url + "/v1/chat/completions", {"content-type": "x"}, b"{}")
        assert answer.status == 200 and answer.header("content-type") == "text/event-stream"
        chunks = answer.chunks()
        assert await chunks.__anext__() == b"data: 1"  # before the server wrote the rest
        release.set()
        assert [c async for c in chunks] == [b"data: 2"]
        answer.close()
        await upstream.close()
    assert scripted.requests[0].endswith(b"content-type: x\r\ncontent-length: 2\r\n\r\n{}")


async def test_a_body_ended_by_closing_the_connection_is_whole_and_the_connection_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")

    async with serving(handler) as (scripted, url):
        upstream = client()
        assert (await upstream.fetch("GET", url + "/a"))[2] == b"all of it"
        assert (await upstream.fetch("GET", url + "/b"))[2] == b"all of it"
        await upstream.close()
    assert scripted.connections == 2


async def test_an_interim_answer_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)

    async with serving(handler) as (scripted, url):
        upstream = client()
        status, _, body = await upstream.fetch("POST", url + "/x")
        assert (status, body) == (200, b"{}")
        await upstream.close()


async def test_a_refused_connection_is_connect_failed() -> None:
    async with serving(lambda r, w: asyncio.sleep(0)) as (_, url):
        pass  # the port is closed again
    upstream = client()
    with pytest.raises(ConnectFailed):
        await upstream.send("POST", url + "/v1/completions", {}, b"{}")
    await upstream.close()


@pytest.mark.parametrize("reply", [b"", b"HTTP/1.1 20", b"not http at all\r\n\r\n"])
async def test_a_connection_that_ends_or_garbles_before_the_head_is_broken_before_head(reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(reply)

    async with serving(handler) as (scripted, url):
        upstream = client()
        with pytest.raises(BrokenBeforeHead):
            await upstream.send("POST", url + "/v1/completions", {}, b"{}")
        await upstream.close()


async def test_no_head_within_the_read_timeout_is_timed_out_and_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        await reader.read()  # until the client closes
        closed.set()

    async with serving(handler) as (scripted, url):
        upstream = client(read_s=0.2)
        with pytest.raises(TimedOut):
            await upstream.send("POST", url + "/v1/completions", {}, b"{}")
        await asyncio.wait_for(closed.wait(), 30)
        await upstream.close()


@pytest.mark.parametrize("stall", [False, True])
async def test_an_answer_broken_off_or_stalled_midway_is_a_broken_answer(stall: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        if stall:
            await reader.read()

    async with serving(handler) as (scripted, url):
        upstream = client(read_s=0.2 if stall else 30.0)  # a close is never read as a stall
        answer = await upstream.send("POST", url + "/v1/completions", {}, b"{}")
        got = []
        with pytest.raises(BrokenAnswer) as broken:
            async for chunk in answer.chunks():
                got.append(chunk)
        assert b"".join(got) == b"part" and broken.value.timed_out is stall
        answer.close()
        await upstream.close()


async def test_a_connection_the_replica_closed_while_idle_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        writer.write(OK)  # kept alive by its head, then closed

    async with serving(handler) as (scripted, url):
        upstream = client()
        assert (await upstream.fetch("GET", url + "/a"))[0] == 200
        idle = [c for connections in upstream._idle.values() for c in connections]
        while not all(c.lost for c in idle):  # until the close reached the client
            await asyncio.sleep(0.01)
        assert (await upstream.fetch("GET", url + "/b"))[0] == 200
        await upstream.close()
    assert scripted.connections == 2


async def test_a_request_cancelled_before_its_head_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await scripted.read_request(reader)
        await reader.read()
        closed.set()

    async with serving(handler) as (scripted, url):
        upstream = client()
        task = asyncio.create_task(upstream.send("POST", url + "/v1/completions", {}, b"{}"))
        while not scripted.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 30)
        await upstream.close()


def test_a_header_with_a_line_break_is_refused() -> None:
    origin, target = split_url("http://h:1/v1/x?y=1")
    assert target == "/v1/x?y=1" and origin.netloc == "h:1"
    with pytest.raises(ValueError):
        request_bytes("POST", target, origin, {"x-a": "1\r\nx-injected: 2"}, b"")
    with pytest.raises(ValueError):
        split_url("ftp://h/x")


class _Transport:
    """What the connection calls on its transport: pausing and resuming reads, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def close(self) -> None:
        self.calls.append("close")


async def test_reading_pauses_past_the_high_water_mark_and_resumes_once_taken() -> None:
    connection = UpstreamConnection(asyncio.get_running_loop(), high_water=10)
    transport = _Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 24\r\n\r\n0123456789")
    assert transport.calls == []
    connection.data_received(b"abcdef")
    assert transport.calls == ["pause"] and not connection.reusable
    assert connection.take() == b"0123456789abcdef" and transport.calls == ["pause", "resume"]
    connection.data_received(b"ghijklmn")
    assert connection.complete and connection.reusable and connection.take() == b"ghijklmn"
