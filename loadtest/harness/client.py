"""The closed-loop streaming client: every benchmark's load against an OpenAI chat endpoint.

:func:`run_load` sends the bodies with ``concurrency`` workers, each sending its
next body when its previous one ends, and records per request when it was
sent, its first token (content or a finish: TTFT), its end, the replica that
served it (``X-Prefixserve-Replica``) and its token usage.

bench_serve.py keeps a sender of its own on purpose: it reproduces ``vllm bench serve``
(Poisson arrivals under a concurrency cap, TTFT at the first non-empty text, inter-token
latencies) so that its figures compare with vLLM's client; it shares the SSE reader.

Invariants: a record exists for every body sent, in body order, failed or not
(``ok`` False with the reason in ``error``); times are seconds on one monotonic
clock, relative to the start of the run; nothing here retries.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from prefixserve.loadtest.harness.sse import aiter_events, starts_output
from prefixserve.replica.contract.routing import REPLICA_HEADER


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer-token header for ``api_key``; none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from the start of the run)."""

    index: int
    ok: bool
    status: int | None
    replica: str | None
    sent_s: float
    first_token_s: float | None
    ended_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.ended_s - self.sent_s


async def stream_one(
    client: httpx.AsyncClient, url: str, index: int, body: dict[str, Any], headers: dict[str, str], t0: float
) -> RequestRecord:
    """Post ``body`` streamed (usage included) and record it as request ``index``, times relative to ``t0``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter() - t0
    first: float | None = None
    usage: dict[str, Any] | None = None
    status: int | None = None
    replica: str | None = None
    error: str | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            status = response.status_code
            replica = response.headers.get(REPLICA_HEADER)
            if status != 200:
                error = f"HTTP {status}: {(await response.aread()).decode('utf-8', 'replace')[:300]}"
            else:
                async for event in aiter_events(response.aiter_lines()):
                    if "error" in event:
                        error = f"error event in the stream: {event['error']}"
                        break
                    if event.get("usage"):
                        usage = event["usage"]
                    if first is None and starts_output(event):
                        first = time.perf_counter() - t0
                if error is None and first is None:
                    error = "the stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    ended = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return RequestRecord(
        index=index,
        ok=error is None,
        status=status,
        replica=replica,
        sent_s=sent,
        first_token_s=first,
        ended_s=ended,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        completion_tokens=(usage or {}).get("completion_tokens"),
        error=error,
    )


async def run_load_async(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    headers: Sequence[Mapping[str, str]] | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    on_done: Callable[[RequestRecord], None] | None = None,
    t0: float | None = None,
    first_index: int = 0,
) -> list[RequestRecord]:
    """Send ``bodies`` (OpenAI chat bodies) with ``concurrency`` workers; one record per body, in order.

    Closed loop: each worker sends its next body when its previous one ends, so
    at most ``concurrency`` requests are in flight and they leave in body order.
    ``headers[i]`` are extra headers of body i (e.g. ``X-Prefix-Hash``).
    ``t0``: the ``time.perf_counter()`` origin of the records' times (default: now),
    and ``first_index`` the index of ``bodies[0]``, so that the records of a load
    sent in parts read as one run.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if headers is not None and len(headers) != len(bodies):
        raise ValueError("headers, when given, needs one mapping per body")
    url = f"{base_url}/v1/chat/completions"
    records: list[RequestRecord | None] = [None] * len(bodies)
    cursor = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    origin = time.perf_counter() if t0 is None else t0
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:

        async def worker() -> None:
            for i in cursor:  # one shared iterator: each body is taken by exactly one worker
                extra = dict(headers[i]) if headers is not None else {}
                record = await stream_one(
                    client, url, first_index + i, bodies[i], {**auth_headers(api_key), **extra}, origin
                )
                records[i] = record
                if on_done is not None:
                    on_done(record)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return [r for r in records if r is not None]


def run_load(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int, **kwargs: Any) -> list[RequestRecord]:
    """:func:`run_load_async` from synchronous code."""
    return asyncio.run(run_load_async(base_url, bodies, concurrency, **kwargs))
