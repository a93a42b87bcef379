"""A client that drops a stream (replica/entrypoints/openai/serving.py): one log line, no traceback, the engine
stream closed.

Both hosts serve streams through the same SSE generators (the standalone server and the Ray
ingress), and a disconnect reaches them in one of two ways: cancelled while waiting for the
engine's next delta (Starlette's disconnect listener, Serve's proxy), or closed while suspended
at a yield (the response's iterator dropped).
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from prefixserve.replica.contract.stream import StreamDelta
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.serving import Generation, sse_stream


class StalledStream:
    """An engine stream that sends one delta, then waits forever; it records its close."""

    def __init__(self) -> None:
        self.sent = False
        self.closed = False

    def __aiter__(self) -> StalledStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self.sent:
            self.sent = True
            return StreamDelta("r", 0, "hi", [5], None, 3, 0, 1)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


def _body(chat: bool) -> api.OpenAIRequest:
    if chat:
        return api.parse_request(
            api.ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True})
        )
    return api.parse_request(api.CompletionRequest, json.dumps({"prompt": "x", "stream": True}))


async def _drop(chat: bool, how: str) -> StalledStream:
    stream = StalledStream()
    gen = Generation("req-dropped", stream)
    await gen.start()
    chunks = sse_stream(gen, _body(chat), "m", str)
    first = await chunks.__anext__()
    assert first.startswith("data: {")
    if how == "cancelled":  # waiting for the engine's next delta when the client goes
        while True:  # read what the first delta gave, up to the wait for the next one
            task = asyncio.ensure_future(chunks.__anext__())
            for _ in range(5):
                await asyncio.sleep(0)
            if not task.done():
                break
            assert task.result().startswith("data: {")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:  # suspended at a yield when the client goes
        await chunks.aclose()
    return stream


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("how", ["cancelled", "closed"])
def test_a_dropped_stream_logs_one_line_and_closes_the_engine_stream(caplog, chat, how):
    caplog.set_level(logging.DEBUG)
    stream = asyncio.run(_drop(chat, how))
    assert stream.closed
    records = [r for r in caplog.records if "req-dropped" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.INFO and "disconnected" in records[0].getMessage()
    assert records[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
