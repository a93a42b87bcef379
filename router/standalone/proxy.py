"""The standalone router's HTTP side: an OpenAI-compatible endpoint in front of OpenAI-compatible replicas.

Job: for each request, ask the decision (routing.py) for a ranking, forward the request
to the first replica, and relay its answer byte for byte as it arrives; in the
background, probe every replica's ``/health`` (replica_set.py ejects and admits) and
read its ``/metrics`` (load_report.py). Any OpenAI-compatible server can be a replica:
prefixserve's, vLLM's, SGLang's.

Invariants:

* Every answer carries ``X-Prefixserve-Replica``: the ring name (``host:port``) of the
  replica that answered, or ``router`` when the router answered itself (a refusal, the
  merged model list, its own health and metrics).
* Retries happen only before the first byte reaches the client: a refused connection,
  a connection broken before the answer's head, 429 or 503 move the request to the
  next replica of the ranking (``max_attempts`` in all); the last replica's 429/503
  is passed through. A refused connection ejects the replica at once.
* After the first byte nothing is resent whole: a replica that breaks off an answer is
  ejected (it takes no new request until ``healthy_after`` good probes), and a
  streamed (SSE) answer ends with an in-band OpenAI error event and ``data: [DONE]``;
  any other answer is cut, as the replica cut it.
* Except that a stream of one sequence to a prefixserve replica (one whose ``/v1/models`` entries
  are owned by prefixserve) moves (``migrate_streams``): the router asks it for progress comments
  (replica/contract/continuation.py), relays its answer whole event by whole event with the
  comments taken out (stream_relay.py), and when the replica breaks off or ends the stream while
  stopping, sends the request again to the next prefixserve replica of the ranking as a
  continuation of what the client has; the client's stream goes on with no gap, up to
  ``max_stream_migrations`` moves. A refused continuation ends the stream in-band, as before.
* A client that goes away closes the upstream connection (the replica aborts the
  request); the request's in-flight count and ``placed``'s key count end exactly once.
* The request line and headers, and the body, are bounded as a replica bounds them
  (431 by the router's HTTP server, with :func:`refusal_answer`; 413 here), so a request the
  router forwards is one a replica would read.
* ``model``: a request naming a model no replica serves is answered 404 by the router;
  one naming a model some replicas serve goes to those alone.
* With ``--tenants``, flow control (router/flow_control/) admits each generation request before
  it is routed (403 unknown tenant, 400 priority outside its tenant's range, 429 over quota, 503
  past the queue budget or size, each naming its reason in ``X-Prefixserve-Reject-Reason``);
  its slot is held until the relayed answer ends, and the answer's usage settles its tokens (an
  answer without a readable usage settles at the estimate).

Imports no part of the replica's HTTP front end: the router speaks to replicas over HTTP only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from prefixserve.replica.contract.continuation import (
    CONTINUATION_FIELD,
    MIGRATION_LIMIT,
    MIGRATION_MIGRATED,
    MIGRATION_NO_REPLICA,
    MIGRATION_REFUSED,
    MIGRATION_REPLICA_DIED,
    MIGRATION_REPLICA_STOPPING,
    SHUTTING_DOWN_CODE,
    STREAM_PROGRESS_HEADER,
)
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.router.flow_control.controller import FlowController, Lease
from prefixserve.router.flow_control.errors import FlowRefusal
from prefixserve.router.flow_control.estimate import estimated_body_tokens
from prefixserve.router.flow_control.metrics import FlowMetrics
from prefixserve.router.flow_control.tenants import bearer_token
from prefixserve.router.kv_index import ZmqKVEventSubscriber
from prefixserve.router.migration import StreamProgress
from prefixserve.router.policies import Policy, make_policy
from prefixserve.router.routing_key import LowerCaseHeaders
from prefixserve.router.standalone.config import StandaloneRouterConfig
from prefixserve.router.standalone.kv_events import KVEventHints, build_hints, event_sources
from prefixserve.router.standalone.load_report import parse_load
from prefixserve.router.standalone.metrics import StandaloneMetrics
from prefixserve.router.standalone.replica_set import ADMITTED, EJECTED, ReplicaSet
from prefixserve.router.standalone.routing import Plan, StandaloneRouting
from prefixserve.router.standalone.served_models import ServedModels
from prefixserve.router.standalone.stream_relay import ProgressRelay
from prefixserve.router.standalone.upstream import (
    BrokenAnswer,
    BrokenBeforeHead,
    ConnectFailed,
    TimedOut,
    Timeouts,
    Upstream,
    UpstreamAnswer,
    UpstreamError,
)
from prefixserve.router.standalone.usage import AnswerTail, Usage

log = logging.getLogger(__name__)

# The X-Prefixserve-Replica value of an answer the router gave itself.
ROUTER_SELF = "router"
# OpenAI's Responses API: its answers are stored on the replica that gave them (response_homes.py).
RESPONSES_PATH = "/v1/responses"
RETRY_STATUSES = frozenset({429, 503})
# The answers a prefixserve replica reports progress in, and continues (replica/contract/continuation.py).
MOVABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
RETRY_AFTER_S = 1
# Headers that describe one connection, not the message (RFC 9110 7.6.1), those the client sets itself,
# and ``expect`` (the router has the whole body before it forwards it: a replica need not ask for it).
_HOP_BY_HOP = frozenset(
    {
        "expect",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def openai_error(status: int, message: str, code: str, error_type: str = "invalid_request_error") -> dict[str, Any]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def own_answer(status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An answer the router gives itself (named ``router`` in the replica header)."""
    return JSONResponse(dict(body), status_code=status, headers={**(headers or {}), REPLICA_HEADER: ROUTER_SELF})


def upstream_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's request headers to send a replica: end-to-end ones only, and no compression asked for
    that the client did not ask for (the body is relayed as the replica encodes it)."""
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "accept-encoding"}
    out["accept-encoding"] = headers.get("accept-encoding", "identity")
    return out


# An answer's headers the router does not relay; its own server writes Date and Server, as any reverse proxy does.
_ANSWER_DROP = frozenset(
    n.encode("latin-1") for n in (_HOP_BY_HOP - {"content-length"}) | {REPLICA_HEADER.lower(), "date", "server"}
)
_REPLICA_HEADER_NAME = REPLICA_HEADER.lower().encode("latin-1")


def answer_headers(headers: Sequence[tuple[bytes, bytes]], replica: str) -> list[tuple[bytes, bytes]]:
    """A replica's answer headers to relay: end-to-end ones (its length kept), named by the router's replica header."""
    out = [(k, v) for k, v in headers if k.lower() not in _ANSWER_DROP]
    out.append((_REPLICA_HEADER_NAME, replica.encode("latin-1")))
    return out


def broken_stream_event(replica: str) -> bytes:
    """The in-band end of an SSE answer its replica broke off: an OpenAI error event, then ``[DONE]``."""
    body = openai_error(
        502, f"replica {replica} failed while answering; the answer is incomplete", "upstream_failed", "server_error"
    )
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def error_event(body: Mapping[str, Any]) -> bytes:
    """An in-band end of an SSE answer: the OpenAI error ``body``, then ``[DONE]``."""
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def stream_of_one(parsed: Any) -> bool:
    """Whether a parsed request body asks for a stream of one sequence (the streams that may move)."""
    if not isinstance(parsed, dict) or parsed.get("stream") is not True:
        return False
    n = parsed.get("n", 1)
    return (n is None or n == 1) and CONTINUATION_FIELD not in parsed


@dataclass
class Resend:
    """What moving a stream needs: the request (path, headers, parsed body), its plan, the replicas
    that failed it, and how many times it moved."""

    path: str
    headers: dict[str, str]
    parsed: dict[str, Any]
    plan: Plan
    failed: set[str] = field(default_factory=set)
    migrations: int = 0


class _Open:
    """One forwarded request's bookkeeping, ended exactly once whatever ends it."""

    def __init__(
        self,
        router: StandaloneRouter,
        plan: Plan,
        replica: str,
        kind: str,
        lease: Lease | None = None,
        responses: bool = False,
    ) -> None:
        self.router = router
        self.plan = plan
        self.replica = replica
        # Where the request landed and the decision kind that sent it there: counted once its first
        # bytes went out, not before them (a Prometheus label lookup costs tens of microseconds cold).
        self.landed: tuple[str, str] | None = (replica, kind)
        self.lease = lease
        # A /v1/responses request: the Response its answer names is stored on ``replica``.
        self.responses = responses
        self.done = False

    def count(self) -> None:
        """Count the request where it landed (once)."""
        if self.landed is not None:
            metrics = self.router.metrics
            metrics.requests.labels(metrics.policy, *self.landed).inc()
            self.landed = None

    def end(self, usage: Usage | None = None, answered: bool = False) -> None:
        """End the counts; settle the flow-control lease with ``usage``, or, for an ``answered`` request
        whose usage the router could not read, with its estimate (so no answer runs off the quota)."""
        if self.done:
            return
        self.done = True
        self.count()
        self.router.request_ended(self.plan, self.replica)
        if self.lease is not None:
            if usage is not None:
                self.lease.release(usage.prompt_tokens, usage.completion_tokens)
            elif answered:
                self.lease.release_as_estimated()
            else:
                self.lease.release()


class RelayResponse(Response):
    """A replica's answer relayed chunk by chunk as it arrives (never buffered), then closed.

    The upstream answer is closed, and the bookkeeping ended, when the answer ends,
    when the replica breaks off (the module docstring) or when the client goes away.
    """

    def __init__(self, upstream: UpstreamAnswer, opened: _Open, resend: Resend | None = None) -> None:
        self.upstream = upstream
        self.opened = opened
        self.status_code = upstream.status
        self.raw_headers = answer_headers(upstream.raw_headers, opened.replica)
        self.background = None
        self.sse = upstream.header("content-type").startswith("text/event-stream")
        # Only a whole, successful answer's usage counts (its tokens were prefilled where it landed).
        encoded = upstream.header("content-encoding", "identity") != "identity"
        self.tail = AnswerTail(self.sse) if upstream.status == 200 and not encoded else None
        self.usage: Usage | None = None  # read once the whole answer was relayed
        # A stream that may move (the module docstring): relayed event by event, its progress counted.
        movable = resend is not None and self.sse and upstream.status == 200 and not encoded
        self.resend = resend if movable else None
        self.relay = ProgressRelay(StreamProgress()) if movable else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        client_gone = False
        watcher: asyncio.Future[None] | None = None

        async def watch_disconnect() -> None:
            nonlocal client_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone = True
            task.cancel()

        def watch() -> None:
            # The relay runs in the request's own task; a client that goes away cancels it there.
            # Watched from the relay's first wait for a replica on: before it, the relay waits at
            # most for the client to drain, which ends when the client goes, and a task started
            # per answer would delay a first chunk that is already there (tens of microseconds).
            nonlocal watcher
            if watcher is None:
                watcher = asyncio.ensure_future(watch_disconnect())

        try:
            await self._relay(send, watch)
        except asyncio.CancelledError:
            if not client_gone or task.uncancel() > 0:  # cancelled from elsewhere as well (a shutdown)
                raise
        finally:
            if watcher is not None:
                watcher.cancel()
            self.upstream.close()
            self.opened.end(self.usage, answered=self.status_code == 200)

    async def _relay(self, send: Send, watch: Callable[[], None]) -> None:
        """Relay the answer; ``watch`` starts watching for the client leaving (before any wait for a replica)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        tail = b"\n\n"
        while True:
            broken: BrokenAnswer | None = None
            try:
                async for chunk in self.upstream.chunks(watch):
                    out = self.relay.feed(chunk) if self.relay is not None else chunk
                    if out:
                        tail = out[-2:]
                        if self.tail is not None:
                            self.tail.add(out)
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        self.opened.count()
                    if self.relay is not None and self.relay.stopping:
                        break
            except BrokenAnswer as exc:
                broken = exc
                router = self.opened.router
                name = self.opened.replica
                log.warning("replica %s broke off an answer: %s", name, exc)
                router.metrics.stream_errors.labels(name).inc()
                if not exc.timed_out:
                    router.replica_failed(name, "broken")
            stopping = self.relay is not None and self.relay.stopping
            died = broken is not None and not broken.timed_out
            if self.relay is not None and (died or stopping):
                watch()
                ended = await self._move(MIGRATION_REPLICA_DIED if died else MIGRATION_REPLICA_STOPPING)
                if ended is None:
                    continue  # the stream goes on from the next replica
                await send({"type": "http.response.body", "body": ended, "more_body": True})
                break
            if broken is not None:
                if not self.sse:
                    raise broken  # nothing in-band to say in a JSON body: cut it as the replica did
                # An event the replica left half-written is ended first, so the error is an event of its own.
                lead = b"" if tail == b"\n\n" else b"\n\n"
                body = lead + broken_stream_event(self.opened.replica)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                break
            if self.relay is not None and self.relay.pending:  # a last event without its blank line
                await send({"type": "http.response.body", "body": self.relay.pending, "more_body": True})
            usage = self.usage = self.tail.usage() if self.tail is not None else None
            routing = self.opened.router.routing
            if usage is not None:
                routing.observe(self.opened.plan, usage.prompt_tokens, usage.cached_tokens)
            if self.opened.responses and self.tail is not None:
                response_id = self.tail.response_id()
                if response_id is not None:
                    routing.response_homes.remember(response_id, self.opened.replica)
            break
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _move(self, reason: str) -> bytes | None:
        """Continue the stream on the next prefixserve replica (the module docstring) after its replica
        died or stopped (``reason``): None once the next replica streams; else the in-band end the
        client gets (the stopping replica's error, a refusal, or the broken-stream event)."""
        assert self.relay is not None and self.resend is not None
        router, resend, progress = self.opened.router, self.resend, self.relay.progress
        count = router.metrics.stream_migrations
        old = self.opened.replica
        resend.failed.add(old)
        if not self.relay.valid or progress.answer_id is None or progress.num_prompt_tokens is None:
            count.labels(reason, MIGRATION_REFUSED).inc()
            return self._end_for(reason, old)
        if resend.migrations >= router.config.max_stream_migrations:
            count.labels(reason, MIGRATION_LIMIT).inc()
            return self._end_for(reason, old)
        body = {**resend.parsed, CONTINUATION_FIELD: progress.continuation_field(resend.migrations + 1)}
        content = json.dumps(body).encode()
        for name in router.continuation_targets(resend.plan, resend.failed):
            router.started(name)
            try:
                answer = await router.client.send(
                    "POST", router.replicas[name].url + resend.path, resend.headers, content
                )
            except UpstreamError as exc:
                router.ended(name)
                resend.failed.add(name)
                if isinstance(exc, ConnectFailed):
                    router.replica_failed(name, "connect")
                continue
            if answer.status != 200 or not answer.header("content-type").startswith("text/event-stream"):
                refusal = await _read_closed(answer)
                router.ended(name)
                resend.failed.add(name)
                if answer.status in RETRY_STATUSES:
                    continue
                count.labels(reason, MIGRATION_REFUSED).inc()
                log.warning("replica %s refused to continue a stream: %d %s", name, answer.status, refusal[:300])
                try:
                    error = json.loads(refusal)
                except ValueError:
                    error = openai_error(502, f"replica {name} could not continue the stream", "upstream_failed")
                return error_event(error)
            self.upstream.close()
            router.ended(old)
            self.opened.replica, self.upstream = name, answer
            self.relay = ProgressRelay(progress)
            resend.migrations += 1
            count.labels(reason, MIGRATION_MIGRATED).inc()
            log.warning(
                "replica %s stopped serving a stream after %d tokens (%s); continuing it on %s",
                old,
                len(progress.token_ids),
                reason,
                name,
            )
            return None
        count.labels(reason, MIGRATION_NO_REPLICA).inc()
        return self._end_for(reason, old)

    @staticmethod
    def _end_for(reason: str, replica: str) -> bytes:
        """The in-band end of a stream that did not move: the stopping replica's own error, or the
        broken-stream event."""
        if reason == MIGRATION_REPLICA_STOPPING:
            message = "the replica is shutting down and the stream could not continue elsewhere; retry it"
            return error_event(openai_error(503, message, SHUTTING_DOWN_CODE, "server_error"))
        return broken_stream_event(replica)


async def _read_closed(answer: UpstreamAnswer) -> bytes:
    """A refused answer's body (what could be read), the answer closed."""
    try:
        return await answer.read()
    finally:
        answer.close()


class StandaloneRouter:
    """One router: its replicas, decision, metrics, HTTP client and background probes."""

    def __init__(
        self, config: StandaloneRouterConfig, policy: Policy | None = None, hints: KVEventHints | None = None
    ) -> None:
        self.config = config
        self.replicas = ReplicaSet(
            config.replica_urls, config.unhealthy_after, config.healthy_after, config.load_max_age_s
        )
        self.routing = StandaloneRouting(
            policy or make_policy(config.policy, **config.policy_options),
            self.replicas,
            config.key_config,
            hints=hints if hints is not None else build_hints(config),
        )
        self.subscriber: ZmqKVEventSubscriber | None = None
        tenants = config.tenant_table()
        self.metrics = StandaloneMetrics(self.routing.policy.name, self.replicas.names, flow=tenants is not None)
        for name in self.replicas.names:  # read when scraped: nothing to count per request
            self.metrics.in_flight.labels(name).set_function(functools.partial(self._in_flight, name))
        self.flow = (
            FlowController(tenants, config.flow_config(), FlowMetrics(self.metrics.flow))
            if tenants is not None and self.metrics.flow is not None
            else None
        )
        self.models = ServedModels(self.replicas.names)  # each replica's /v1/models entries, indexed
        self._models_at = -float("inf")
        self._client: Upstream | None = None  # forwarded requests, probes, metrics and model lists
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------
    @property
    def client(self) -> Upstream:
        if self._client is None:
            raise RuntimeError("the router is not started")
        return self._client

    async def start(self) -> None:
        c = self.config
        timeouts = Timeouts(connect_s=c.connect_timeout_s, read_s=c.read_timeout_s)
        self._client = Upstream(timeouts)
        hints = self.routing.hints
        if hints is not None and c.kv_events:
            self.subscriber = ZmqKVEventSubscriber(event_sources(c), hints.index).start()
            for source in self.subscriber.sources:
                self.metrics.kv_event_blocks.labels(source.replica).set_function(
                    functools.partial(hints.index.num_blocks, source.replica)
                )
        self._tasks = [
            asyncio.create_task(self._every(c.health_interval_s, self.probe_all)),
            asyncio.create_task(self._every(c.metrics_interval_s, self.read_loads)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.stop)
            self.subscriber = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _every(self, period_s: float, job: Any) -> None:
        while True:
            try:
                await job()
            except Exception:  # a bad round must not end the probes for good
                log.exception("router background job failed")
            await asyncio.sleep(period_s)

    # -- health and load --------------------------------------------------------------
    async def probe(self, name: str) -> None:
        """One ``GET /health`` of ``name``: 200 is good, anything else (or no answer in time) a failure."""
        try:
            status, _, _ = await self.client.fetch(
                "GET", self.replicas[name].url + "/health", timeout_s=self.config.health_timeout_s
            )
            ok = status == 200
        except UpstreamError:
            ok = False
        self.record_probe(name, ok)
        if ok and name not in self.models:  # its models known before a request asks for one
            await self.fetch_models(name, {})

    def record_probe(self, name: str, ok: bool) -> None:
        """One probe's outcome (or a failure that counts as one), with its ejection or re-admission."""
        change = self.replicas.probe(name, ok)
        if change == EJECTED:
            log.warning("replica %s ejected: %d failures in a row", name, self.replicas.unhealthy_after)
            self.metrics.ejections.labels(name, "health").inc()
            self.metrics.admitted.labels(name).set(0)
            self.routing.forget(name)
        elif change == ADMITTED:
            log.info("replica %s admitted again", name)
            self.metrics.readmissions.labels(name).inc()
            self.metrics.admitted.labels(name).set(1)
            self.models.drop(name)  # a replica back from the dead may serve other models: read again

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(n) for n in self.replicas.names))

    async def read_load(self, name: str) -> None:
        try:
            status, _, text = await self.client.fetch(
                "GET", self.replicas[name].url + "/metrics", timeout_s=self.config.health_timeout_s
            )
        except UpstreamError:
            return  # the probes judge health; a missing report only ages out
        if status == 200:
            self.replicas.report_load(name, parse_load(text.decode("utf-8", "replace")))

    async def read_loads(self) -> None:
        await asyncio.gather(*(self.read_load(n) for n in self.replicas.admitted()))

    def replica_failed(self, name: str, reason: str) -> None:
        """``name`` refused a connection or broke off an answer: ejected until its probes recover."""
        if self.replicas.died(name) == EJECTED:
            log.warning("replica %s ejected: %s", name, reason)
            self.metrics.ejections.labels(name, reason).inc()
            self.metrics.admitted.labels(name).set(0)
        self.routing.forget(name)

    # -- models -----------------------------------------------------------------------
    async def fetch_models(self, name: str, headers: Mapping[str, str]) -> None:
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            status, _, body = await self.client.fetch(
                "GET", self.replicas[name].url + "/v1/models", auth, timeout_s=self.config.health_timeout_s
            )
            data = json.loads(body).get("data") if status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            return
        if isinstance(data, list):
            self.models.set(name, [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)])

    async def refresh_models(self, headers: Mapping[str, str], force: bool = False) -> None:
        """Ask every admitted replica for its models (at most once per health interval unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._models_at < self.config.health_interval_s:
            return
        self._models_at = now
        await asyncio.gather(*(self.fetch_models(n, headers) for n in self.replicas.admitted()))

    def continuation_targets(self, plan: Plan, failed: set[str]) -> list[str]:
        """Where a moving stream may go, best first: the plan's ranking, then the other admitted
        replicas, each an admitted prefixserve replica that has not failed the stream."""
        admitted = self.replicas.admitted()
        order = [*plan.ranking, *(n for n in admitted if n not in plan.ranking)]
        return [n for n in order if n in admitted and n not in failed and self.models.speaks_prefixserve(n)]

    # -- requests ---------------------------------------------------------------------
    def started(self, replica: str) -> None:
        """A request (or a stream's continuation) is open on ``replica``."""
        self.replicas.started(replica)

    def ended(self, replica: str) -> None:
        """A request (or the part of a stream) open on ``replica`` ended."""
        self.replicas.ended(replica)

    def _in_flight(self, replica: str) -> int:
        return self.replicas[replica].in_flight

    def request_ended(self, plan: Plan, replica: str) -> None:
        """A relayed answer ended (whole, broken or abandoned): its key's count, then its replica's."""
        self.routing.finished(plan)
        self.ended(replica)

    async def admit(self, request: Request, parsed: Any) -> Lease:
        """Flow control's slot for a request (FlowRefusal: 403, 400, 429 or 503): its tenant by key or
        header, its band by its ``priority`` when it asks one, its cost by its estimated tokens."""
        assert self.flow is not None
        tenant = self.flow.tenant_of(bearer_token(request.headers.get("authorization")), request.headers)
        priority = parsed.get("priority") if isinstance(parsed, dict) else None
        asked = priority if isinstance(priority, int) and not isinstance(priority, bool) and priority else None
        band = self.flow.band_of(tenant, asked)
        return await self.flow.admit(tenant, band, estimated_body_tokens(parsed))

    async def forward(
        self,
        request: Request,
        headers: Mapping[str, str],
        body: bytes,
        plan: Plan,
        lease: Lease | None = None,
        parsed: Any = None,
    ) -> Response:
        """Send the request to the plan's replicas in turn (the module docstring's retries); relay the answer.

        ``headers``: the request's (LowerCaseHeaders), forwarded less the hop-by-hop ones.
        ``lease``: the request's flow-control slot, handed to the relayed answer (which releases it).
        ``parsed``: the body as JSON, when it parsed: a stream of one sequence may move (the module
        docstring).
        """
        attempts = plan.attempts(self.config.max_attempts)
        headers = upstream_headers(headers)
        scope = request.scope
        query = scope.get("query_string", b"")
        # As the client sent it (percent-encoding kept), with its query.
        path = scope.get("raw_path", scope["path"].encode()).decode("latin-1") + (
            "?" + query.decode("latin-1") if query else ""
        )
        movable = self.config.migrate_streams and stream_of_one(parsed) and scope["path"] in MOVABLE_PATHS
        progress_headers = {**headers, STREAM_PROGRESS_HEADER: "1"} if movable else headers
        last: tuple[int, bytes, tuple[tuple[bytes, bytes], ...], str] | None = None
        for i, name in enumerate(attempts):
            final = i == len(attempts) - 1
            asks_progress = movable and self.models.speaks_prefixserve(name)
            self.started(name)
            try:
                answer = await self.client.send(
                    request.method, self.replicas[name].url + path, progress_headers if asks_progress else headers, body
                )
            except ConnectFailed:
                self.ended(name)
                self.replica_failed(name, "connect")
                self.metrics.retries.labels(name, "connect").inc()
                continue
            except TimedOut:
                self.ended(name)
                self.routing.finished(plan)
                return own_answer(
                    504, openai_error(504, f"replica {name} did not answer in time", "upstream_timeout", "server_error")
                )
            except BrokenBeforeHead:
                # Broken before the head: maybe a kept-alive connection the replica had just closed,
                # so it counts as one failed probe, not as a death.
                self.ended(name)
                self.record_probe(name, False)
                self.metrics.retries.labels(name, "broken").inc()
                continue
            except BaseException:  # anything else (cancelled included) ends the request's counts, then goes on
                self.ended(name)
                self.routing.finished(plan)
                raise
            if answer.status in RETRY_STATUSES and not final:
                try:
                    content = await answer.read()
                finally:
                    answer.close()
                    self.ended(name)
                self.metrics.retries.labels(name, str(answer.status)).inc()
                last = (answer.status, content, answer.raw_headers, name)
                continue
            kind = self.routing.landed(plan, name)
            if 400 <= answer.status < 500 and answer.status != 429:
                self.routing.refused(plan)
            resend = Resend(path, progress_headers, parsed, plan) if asks_progress else None
            return RelayResponse(answer, _Open(self, plan, name, kind, lease, scope["path"] == RESPONSES_PATH), resend)
        self.routing.finished(plan)
        self.metrics.no_replica.inc()
        if last is not None:  # the last replica tried refused, and no later one answered at all
            status, content, hdrs, name = last
            return Response(content, status_code=status, headers=dict(answer_headers_map(hdrs, name)))
        return own_answer(
            503,
            openai_error(503, "no replica could take the request; retry it", "no_replica_available", "server_error"),
            {"Retry-After": str(RETRY_AFTER_S)},
        )

    async def read_body(self, request: Request, headers: Mapping[str, str]) -> bytes | Response:
        """The request body; the 413 answer for one larger than a replica accepts, 408 for one not whole in time."""
        try:
            async with asyncio.timeout(self.config.client_body_timeout_s):
                return await self._read_body(request, headers)
        except TimeoutError:
            return own_answer(
                408,
                openai_error(
                    408, f"the request body did not arrive within {self.config.client_body_timeout_s:g} s", "timeout"
                ),
            )

    async def _read_body(self, request: Request, headers: Mapping[str, str]) -> bytes | Response:
        limit = self.config.max_body_bytes

        def too_large() -> Response:  # built only when needed: a JSON answer costs as much as routing one
            return own_answer(
                413,
                openai_error(
                    413, f"request body exceeds {limit} bytes, the most a replica accepts", "request_too_large"
                ),
            )

        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large()
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    async def handle_generate(self, request: Request) -> Response:
        # Read once, by lower-case name: the routing key and the upstream request use them.
        headers = LowerCaseHeaders.from_raw(request.scope["headers"])
        body = await self.read_body(request, headers)
        if isinstance(body, Response):
            return body
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica answers it; the router routes it by load
        among = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        if isinstance(model, str):
            among = self.models.among(model)
            if among is None:
                await self.refresh_models(headers)
                among = self.models.among(model)
            if among is None and self.models:
                return own_answer(
                    404,
                    openai_error(404, f"The model `{model}` does not exist on any replica.", "model_not_found"),
                )
        lease = None
        if self.flow is not None:
            try:
                lease = await self.admit(request, parsed)
            except FlowRefusal as exc:
                return own_answer(exc.status_code, exc.body(), exc.headers())
        try:
            plan = await self._plan(headers, parsed, among)
            response = await self.forward(request, headers, body, plan, lease, parsed)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None and not isinstance(response, RelayResponse):
            lease.release()  # the router answered itself: no replica ran it
        return response

    async def _plan(self, headers: Mapping[str, str], parsed: Any, among: list[str] | None) -> Plan:
        blocks = None
        hints = self.routing.hints
        if hints is not None and isinstance(parsed, dict):
            # Tokenizing and hashing a long prompt takes milliseconds: not on the event loop.
            blocks = await anyio.to_thread.run_sync(hints.blocks, parsed)
        model = parsed.get("model") if isinstance(parsed, dict) else None
        adapter = model if isinstance(model, str) and self.models.is_adapter(model) else None
        plan = self.routing.plan(parsed, headers, among, token_blocks=blocks, adapter=adapter)
        if plan.event_matched:
            self.metrics.kv_event_matches.inc()
        return plan

    async def handle_stored_response(self, request: Request) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: to the replica whose answer carried the id; one the
        router has not relayed (it restarted, or another router did) is asked of each admitted
        replica in turn until one has it (a 404 from every one is the last one's)."""
        response_id = request.path_params["response_id"]
        homes = self.routing.response_homes
        home = homes.home(response_id)
        admitted = self.replicas.admitted()
        names = [home] if home in admitted else admitted
        if not names:
            return own_answer(503, openai_error(503, "no replica is admitted", "no_replica_available", "server_error"))
        # Identity: the answer is read whole and relayed as read.
        headers = {**upstream_headers(request.headers), "accept-encoding": "identity"}
        answer: tuple[int, tuple[tuple[bytes, bytes], ...], bytes] | None = None
        for name in names:
            try:
                answer = await self.client.fetch(request.method, self.replicas[name].url + request.url.path, headers)
            except UpstreamError as exc:
                log.warning("replica %s did not answer %s %s: %s", name, request.method, request.url.path, exc)
                continue
            status, raw, content = answer
            if status != 404:
                if request.method == "DELETE" and status == 200:
                    homes.forget(response_id)
                elif status == 200:
                    homes.remember(response_id, name)
                return Response(content, status_code=status, headers=dict(answer_headers_map(raw, name)))
        if answer is None:
            return own_answer(502, openai_error(502, "no replica answered", "upstream_failed", "server_error"))
        status, raw, content = answer
        return Response(content, status_code=status, headers=dict(answer_headers_map(raw, names[-1])))

    async def handle_models(self, request: Request) -> Response:
        await self.refresh_models(request.headers, force=True)
        if not self.models:
            return own_answer(
                503, openai_error(503, "no replica listed its models", "no_replica_available", "server_error")
            )
        return own_answer(200, {"object": "list", "data": self.models.merged()})

    async def handle_health(self, request: Request) -> Response:
        admitted = self.replicas.admitted()
        status = 200 if admitted else 503
        return own_answer(status, {"status": "ok" if admitted else "no replica admitted", "admitted": admitted})

    async def handle_metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(
            generate_latest(self.metrics.registry),
            media_type=CONTENT_TYPE_LATEST,
            headers={REPLICA_HEADER: ROUTER_SELF},
        )


def answer_headers_map(headers: Sequence[tuple[bytes, bytes]], replica: str) -> list[tuple[str, str]]:
    """``answer_headers`` as text, its length left to the answer that carries it."""
    return [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in answer_headers(headers, replica)
        if k.lower() != b"content-length"
    ]


def refusal_answer(status: int, text: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """What the router's HTTP server answers a request it refuses before the application sees it
    (431 past the head limits, 408, 400): the OpenAI error body, named ``router``."""
    code = {431: "headers_too_large", 408: "timeout"}.get(status, "invalid_request")
    body = json.dumps(openai_error(status, text, code)).encode()
    return [
        (b"content-type", b"application/json"),
        (REPLICA_HEADER.lower().encode("latin-1"), ROUTER_SELF.encode("latin-1")),
    ], body


class RouterHeadMiddleware:
    """Outermost: names the router on any answer that names no replica (Starlette's own 404 and 405
    included)."""

    def __init__(self, app: Any, router: StandaloneRouter) -> None:
        self.app = app
        self.router = router
        self.header = (REPLICA_HEADER.lower().encode("latin-1"), ROUTER_SELF.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == self.header[0] for k, _ in headers):
                    message["headers"] = [*headers, self.header]
            await send(message)

        await self.app(scope, receive, named)


class RouterApp:
    """The router's ASGI application: a generation request (``POST /v1/...``) goes straight to
    ``handle_generate``; everything else (its own endpoints, the lifespan, 404 and 405) through
    Starlette with :class:`RouterHeadMiddleware`.

    Why the bypass: a generation request is the router's hot path, and Starlette's layers around a
    handler (its error and exception middlewares, the route table, the request-response wrappers,
    each wrapping every ``send``) were a large part of what the router added to a request's latency
    (docs/benchmarks/router_overhead.md). Every answer on that path names its replica already.
    """

    def __init__(self, router: StandaloneRouter, rest: Any) -> None:
        self.router = router
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            response = await self.router.handle_generate(Request(scope, receive))
            await response(scope, receive, send)
        else:
            await self.rest(scope, receive, send)


def build_app(router: StandaloneRouter) -> RouterApp:
    """The router's ASGI application; its lifespan starts and stops the router's client and probes."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    rest = Starlette(
        routes=[
            Route("/health", router.handle_health, methods=["GET"]),
            Route("/metrics", router.handle_metrics, methods=["GET"]),
            Route("/v1/models", router.handle_models, methods=["GET"]),
            Route(RESPONSES_PATH + "/{response_id}", router.handle_stored_response, methods=["GET", "DELETE"]),
            # RouterApp takes the POSTs: this route gives other methods on a generation path their 405.
            Route("/v1/{path:path}", router.handle_generate, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    rest.add_middleware(RouterHeadMiddleware, router=router)
    return RouterApp(router, rest)
