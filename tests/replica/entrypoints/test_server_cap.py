"""replica/entrypoints/openai/server.py's in-flight cap: above it a generation request gets 429 with Retry-After
(nginx walks on)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest


async def test_a_replica_over_its_in_flight_cap_answers_429_and_serves_again(ckpt):
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.entrypoints.openai.server import build_app

    engine = AsyncEngine(EngineConfig(model=str(ckpt), max_model_len=512))
    # The first request's answer held after its first token until released: it keeps the one
    # slot, however fast the machine would finish it.
    holding, release = asyncio.Event(), asyncio.Event()
    stream = engine.stream

    async def held_stream(request):
        held = not holding.is_set()
        async with contextlib.aclosing(stream(request)) as deltas:
            async for delta in deltas:
                yield delta
                if held:
                    held = False
                    holding.set()
                    await release.wait()

    engine.stream = held_stream
    app = build_app(engine, replica_name="capped", max_in_flight=1)
    long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 30, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=120) as http:
            first = asyncio.create_task(http.post("/v1/chat/completions", json=long))
            await asyncio.wait_for(holding.wait(), timeout=120)  # a hang guard
            busy = await http.post("/v1/chat/completions", json={**long, "max_tokens": 2})
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "replica_busy" and int(busy.headers["retry-after"]) >= 1
            assert busy.headers["x-prefixserve-replica"] == "capped"
            assert (await http.get("/health")).status_code == 200  # only generation is capped
            release.set()
            assert (await first).status_code == 200
            again = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert again.status_code == 200
    finally:
        await engine.shutdown()


def test_the_cap_must_be_positive():
    from prefixserve.replica.entrypoints.openai.http_frontend import InFlightCounter
    from prefixserve.replica.entrypoints.openai.server import ServerConfig

    with pytest.raises(ValueError, match="max_in_flight"):
        InFlightCounter(0)
    with pytest.raises(ValueError, match="max_in_flight"):
        ServerConfig(max_in_flight=0)


def test_every_server_knob_is_a_flag_of_prefixserve_replica():
    import argparse
    import dataclasses

    from prefixserve.common.config_util import from_cli_args
    from prefixserve.replica.entrypoints.openai.server import ServerConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = from_cli_args(ServerConfig, parser.parse_args([]))
    assert defaults == ServerConfig()
    given = from_cli_args(
        ServerConfig,
        parser.parse_args(
            ["--max-in-flight", "2", "--h11-max-header-count", "7", "--send-timeout-s", "0.5", "--drain-timeout-s", "0"]
        ),
    )
    assert (given.max_in_flight, given.h11_max_header_count) == (2, 7)
    assert (given.send_timeout_s, given.drain_timeout_s) == (0.5, 0)
    flags = {action.dest for action in parser._actions}
    assert {f.name for f in dataclasses.fields(ServerConfig)} <= flags
    for bad in ({"h11_max_header_count": 0}, {"send_timeout_s": 0}, {"limit_concurrency": -1}, {"drain_timeout_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)
