"""Helpers for the standalone router's tests: real HTTP servers on 127.0.0.1 in this process.

* :class:`ServerThread`: any ASGI app served by uvicorn on a thread, on a port the OS
  picked (the socket is bound before the server starts, so no port race).
* :class:`RouterServerThread`: the router's app served by the router's own HTTP server
  (router/standalone/http_server.py), as ``prefixserve router`` serves it.
* :class:`FakeReplica`: a small OpenAI-compatible upstream whose behaviour a test sets
  (healthy or not; answering, refusing with 429/503, or dying after its first event;
  a gate that holds a stream after its first event). A test upstream, not the product:
  it answers at once, so the tests exercise the router alone.
* :func:`wait_until`: poll a condition that another thread makes true.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from prefixserve.router.standalone.http_server import HttpServer, Refusal, ServerLimits, plain_refusal
from prefixserve.router.standalone.proxy import StandaloneRouter, build_app, refusal_answer

# What every answer of a FakeReplica reports: 100 prompt tokens, 40 of them cached (60 prefilled).
USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 2,
    "total_tokens": 102,
    "prompt_tokens_details": {"cached_tokens": 40},
}


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Return once ``condition()`` holds; AssertionError naming ``what`` if it never does (a hang, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def loopback_socket() -> tuple[socket.socket, int]:
    """A socket bound to a port the OS picked on 127.0.0.1 (bound before its server starts: no port race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


class ServerThread:
    """Serve ``app`` with uvicorn on 127.0.0.1 on a thread; a context manager that always stops it."""

    def __init__(self, app: Any) -> None:
        self.sock, self.port = loopback_socket()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started, f"server on port {self.port} started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class RouterServerThread:
    """Serve ``app`` with the router's HTTP server on 127.0.0.1 on a thread of its own (its own
    event loop); a context manager that always stops it (draining for up to ``drain_s``).
    :meth:`for_router` serves a router as ``prefixserve router`` does."""

    @classmethod
    def for_router(cls, router: StandaloneRouter) -> RouterServerThread:
        return cls(build_app(router), router.config.server_limits(), refusal=refusal_answer)

    def __init__(self, app: Any, limits: ServerLimits, drain_s: float = 1.0, refusal: Refusal = plain_refusal) -> None:
        self.sock, self.port = loopback_socket()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        self.server = HttpServer(app, "127.0.0.1", self.port, limits, drain_s, sock=self.sock, refusal=refusal)
        self.started = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(ready=lambda port: self.started.set())

        asyncio.run(main())

    def __enter__(self) -> RouterServerThread:
        self.thread.start()
        wait_until(self.started.is_set, f"router server on port {self.port} started")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is not None and self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server stopped
                self.loop.call_soon_threadsafe(self.server.stop)
        self.thread.join(30)
        self.sock.close()


def sse(payload: Any) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def chunk(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


class FakeReplica:
    """An OpenAI-compatible upstream for router tests (the module docstring).

    mode: "ok" answers; "429" / "503" refuse every generation request; "die" sends a
    stream's first event and then drops the connection; "die_json" drops it in the middle
    of a JSON answer. ``gate``: when set to an
    Event, a stream waits for it after its first event (``gate_timed_out`` records a
    wait that ran out: the client never got that first event through the router).
    """

    def __init__(
        self, models: tuple[str, ...] = ("m",), running: int = 0, waiting: int = 0, adapters: tuple[str, ...] = ()
    ) -> None:
        self.models = models
        self.adapters = adapters  # LoRA adapters of the first model, listed with their parent as vLLM lists them
        self.healthy = True
        self.mode = "ok"
        self.gate: threading.Event | None = None
        self.hold_first: threading.Event | None = None  # when set to an Event: a stream's first event waits for it
        self.gate_timed_out = False
        self.running = running
        self.waiting = waiting
        self.received: list[Any] = []  # generation request bodies (parsed JSON, or the raw bytes)
        self.headers: list[dict[str, str]] = []
        self.targets: list[bytes] = []  # generation requests' paths and queries, as sent
        self.disconnected = threading.Event()
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.list_models),
                Route("/metrics", self.metrics),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/v1/completions", self.generate, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def list_models(self, request: Request) -> Response:
        cards = [{"id": m, "object": "model"} for m in self.models]
        cards += [{"id": a, "object": "model", "parent": self.models[0]} for a in self.adapters]
        return JSONResponse({"object": "list", "data": cards})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
        )

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        self.received.append(body)
        self.headers.append(dict(request.headers))
        query = request.scope["query_string"]
        self.targets.append(request.scope["raw_path"] + (b"?" + query if query else b""))
        if self.mode in ("429", "503"):
            error = {"error": {"message": "busy", "type": "server_error", "param": None, "code": "replica_busy"}}
            return JSONResponse(error, status_code=int(self.mode), headers={"Retry-After": "1"})
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "not JSON", "type": "invalid_request_error"}}, status_code=400)
        if self.mode == "die_json":
            return StreamingResponse(self._cut_json(), media_type="application/json")
        if not body.get("stream"):
            return JSONResponse(
                {
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
                    "usage": USAGE,
                }
            )
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._events(usage), media_type="text/event-stream")

    async def _cut_json(self) -> AsyncIterator[bytes]:
        yield b'{"object": "chat.completion", "choices": ['
        raise RuntimeError("the fake replica dies mid-answer")

    async def _events(self, usage: bool) -> AsyncIterator[bytes]:
        try:
            if self.hold_first is not None:
                await anyio.to_thread.run_sync(self.hold_first.wait, 120.0)
            yield sse(chunk("one"))
            if self.mode == "die":
                raise RuntimeError("the fake replica dies mid-stream")
            if self.gate is not None:
                gate = self.gate
                if not await anyio.to_thread.run_sync(gate.wait, 30.0):
                    self.gate_timed_out = True
            yield sse(chunk("two"))
            if usage:
                yield sse({"object": "chat.completion.chunk", "choices": [], "usage": USAGE})
            yield sse("[DONE]")
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
