"""The Ray Serve ingress: the cluster's OpenAI endpoint in front of the engine replicas.

Job: host the OpenAI front end (``replica/entrypoints/openai/http_frontend.py``, the same code the
standalone replica server hosts: same endpoints, protocol models, answers,
error bodies and status codes) over an :class:`EngineClient` that reaches the
engine deployment through its Serve handle, whose request router
(router/serve/request_router.py) picks the replica; compute the routing key
(router/routing_key.py) from the body the front end parsed. Every answer that
reached a replica names it in ``X-Prefixserve-Replica``. With several base models (the app
args' ``models``) there is one engine deployment, handle and router per model, and the
client is router/serve/models.py's: each request goes to the deployment of the model it names.

Invariants:

* A request that fails because its replica died (Ray reports the actor dead
  or unavailable) before any token reached this ingress is sent again, the
  dead replica tried last (``EngineRequest.avoid_replicas``), so it lands on
  the key's next ring replica. Once the first token is here it is never sent
  whole again: a stream whose replica dies (its actor or its engine) or ends
  it while stopping (503 ``server_shutting_down``) continues on another
  replica from what its client has (``ingress.migrate_streams``, at most
  ``max_stream_migrations`` moves; replica/contract/continuation.py), and
  ends with the replica's error when it may not move (``n > 1``, the
  ingress draining, the limit) or the next replica cannot continue it exactly.
* The ingress keeps no routing state of its own: several ingress replicas
  (each with its own handle and router) route the same key to the same replica.
* Answers name the ingress replica too (``X-Prefixserve-Ingress``), so that
  several ingress replicas can be told apart, and how many sends the request
  took (``X-Prefixserve-Attempts``).
* With tenants configured (``ingress.tenants``), flow control (router/serve/flow.py) runs on
  every generation request: its tenant is named right after its API key (403 when none is),
  and its first send to a replica waits for a slot (quota: 429 with Retry-After; the fair
  queue's budget or size: 503 with the reason in ``X-Prefixserve-Reject-Reason``). The slot
  is held until its stream ends and its tokens are settled against the tenant's quota. Slots
  are per ingress replica (AppArgs.flow_max_in_flight shares the engines' caps among them).
* OpenAI's Responses API (``/v1/responses``, replica/entrypoints/openai/responses_endpoint.py) runs
  on the same chat path; each ingress replica keeps the responses it answered in its own bounded
  store (``ingress.responses_max_entries`` / ``responses_max_bytes``) and, when a continuation,
  GET or DELETE names one it does not hold, asks its sibling replicas. Each stored record names
  the engine replica that answered it.
* ``/health`` answers 200 only while at least one engine replica (of every model) passes its
  health check (asked at most once per ``HEALTH_CACHE_S``), else 503.
* Once :meth:`OpenAIIngress.begin_drain` was called (the cluster is stopping),
  ``/health`` and new generation requests answer 503 ``server_shutting_down``
  with ``Retry-After``; requests already here run on.
* ``placed`` placements agree across ingress replicas through one publisher:
  every ``placement_sync_s`` each ingress replica broadcasts
  ``placement_exchange`` to its siblings (itself included), handing over the
  requests and prefill work its router counted since the last exchange. The
  leader is the replica whose name sorts first among those whose router
  exists; it merges the others' counts, rebalances, and answers with its
  ``placement_snapshot``, which every other router applies (as a follower
  that does not rebalance). A replica that joins, leaves or dies changes the
  leader at the next exchange; between exchanges a follower places only keys
  the leader has not seen yet, with the leader's table as of the last
  snapshot. ``GET /placement`` answers this replica's current snapshot (the
  input of ``prefixserve nginx-config --placement``).
* The prefill work of each request (prompt tokens minus cached ones, known
  with its first token) goes to the router's policy (``observe``).
* /metrics merges every ingress replica's router metrics (each sample
  labelled ``ingress``, this process's own included) with every engine
  replica's metrics (labelled ``replica``): whichever ingress replica the
  Serve proxy hands a scrape to, it answers for the whole cluster, so each
  counter series stays monotonic. An ingress replica that does not answer
  within ``METRICS_TIMEOUT_S`` is left out (this one's own series never are).

No ``from __future__ import annotations`` here: Serve's class-based FastAPI
ingress resolves the endpoints' parameter annotations (``request: Request``) at
runtime, and string annotations turn them into query parameters.

Imports Ray Serve, FastAPI, the front end and the deployment's request types;
never torch (the model lives in the engine replicas).
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixserve.replica.contract.continuation import (
    MIGRATION_DISABLED,
    MIGRATION_MIGRATED,
    MIGRATION_REFUSED,
    MIGRATION_REPLICA_DIED,
    MIGRATION_REPLICA_STOPPING,
    SHUTTING_DOWN_CODE,
)
from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.contract.retention import CACHE_RETENTION_HEADER
from prefixserve.replica.contract.routing import REPLICA_HEADER
from prefixserve.replica.contract.stream import StreamDelta, StreamError, StreamStart, TokenTexts
from prefixserve.replica.entrypoints.openai import http_frontend
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions, IgnoredFields
from prefixserve.replica.entrypoints.openai.response_store import ResponseStore, StoredResponse
from prefixserve.replica.entrypoints.openai.responses_endpoint import ResponsesEndpoints
from prefixserve.replica.errors import APIError, EngineDeadError, ModelNotFoundError, ServiceUnavailableError
from prefixserve.router.cluster_config import IngressConfig
from prefixserve.router.flow_control.controller import FlowConfig, Lease
from prefixserve.router.migration import StreamProgress, migration_refusal
from prefixserve.router.routing_key import PrefixKeyConfig, routing_key
from prefixserve.router.serve.flow import IngressFlow
from prefixserve.router.serve.metrics import merge_expositions, router_metrics
from prefixserve.router.serve.models import ModelsClient
from prefixserve.router.serve.request_router import PrefixRouter, router_for

log = logging.getLogger(__name__)

# /health asks the engine replicas at most this often (a probe storm costs one broadcast)...
HEALTH_CACHE_S = 1.0
# ... and counts replicas that have not answered within this as unhealthy.
HEALTH_TIMEOUT_S = 2.0
# The engine replicas' model info (names, adapters) is asked again after this long.
MODEL_INFO_TTL_S = 5.0
# /metrics waits this long for the other ingress replicas' router metrics.
METRICS_TIMEOUT_S = 2.0
INGRESS_HEADER = "X-Prefixserve-Ingress"
# How many times the request was sent to a replica (above 1: earlier replicas died under it).
ATTEMPTS_HEADER = "X-Prefixserve-Attempts"
# An exchange waits this long for the other ingress replicas.
PLACEMENT_TIMEOUT_S = 5.0
# A stored response this replica lacks: how long its siblings are asked for it.
SIBLING_STORE_TIMEOUT_S = 5.0


class NoPlacementError(APIError):
    """``GET /placement`` where the router has no placement (404)."""

    status_code = 404
    default_code = "no_placement"


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (for the status mapping)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def _replica_gone(exc: BaseException) -> bool:
    """True when the request failed because its replica actor died or cannot be reached."""
    return isinstance(exc, RayActorError) or isinstance(_cause(exc), RayActorError)


def _lost_replica(exc: BaseException) -> str | None:
    """Why a stream's replica stopped serving it when it did (MIGRATION_REPLICA_DIED: the actor or its
    engine died; MIGRATION_REPLICA_STOPPING: it ended its streams while stopping); None for any
    other failure (the request's own, which another replica would meet too)."""
    cause = _cause(exc)
    if _replica_gone(exc) or isinstance(cause, EngineDeadError):
        return MIGRATION_REPLICA_DIED
    if isinstance(cause, APIError) and cause.code == SHUTTING_DOWN_CODE:
        return MIGRATION_REPLICA_STOPPING
    return None


@dataclass
class Migration:
    """How an ingress moves streams whose replica stopped serving them (IngressConfig's
    ``migrate_streams`` and ``max_stream_migrations``); ``draining``: whether the ingress is
    stopping (nowhere to move to); ``count(reason, result)`` counts each decision."""

    enabled: bool
    max_migrations: int
    draining: Callable[[], bool]
    count: Callable[[str, str], None]


class RemoteStream:
    """The deltas of one request from an engine replica: resent while no token has arrived, continued
    on another replica when its replica stops serving it after (the module docstring).

    An async iterator of StreamDelta. ``replica`` names the replica serving it
    (set once a replica took it); ``token_text`` decodes token ids the replica
    sent texts for (logprobs).
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        request: EngineRequest,
        max_attempts: int,
        on_first: Callable[[EngineRequest, StreamDelta], None] | None = None,
        admit: Callable[[EngineRequest], Awaitable[Lease]] | None = None,
        on_refused: Callable[[EngineRequest], None] | None = None,
        migration: Migration | None = None,
    ) -> None:
        self._handle = handle
        self.request = request
        self._max_attempts = max_attempts
        self._on_first = on_first
        self._admit = admit
        self._on_refused = on_refused
        self._migration = migration
        # A request that continues a stream already (a client's prefixserve_continuation) counts its part.
        self._progress = StreamProgress.of(request.continuation)
        self.migrations = request.continuation.migrations if request.continuation is not None else 0
        self._lease: Lease | None = None
        self._usage = (0, 0)  # prompt and completion tokens so far (the deltas' counts are cumulative)
        self._response: DeploymentResponseGenerator | None = None
        self._started = False
        self._texts: dict[int, str] = {}
        self.replica: str | None = None
        self.attempts = 0
        # Whether the replica pinned the request's prefix, when it asked for retention.
        self.cache_retention: str | None = None

    def token_text(self, token_id: int) -> str:
        return self._texts[token_id]

    def response_headers(self) -> dict[str, str]:
        """The replica that took the request (once one did) and how many sends it took."""
        headers = {ATTEMPTS_HEADER: str(self.attempts)}
        if self.replica is not None:
            headers[REPLICA_HEADER] = self.replica
        if self.cache_retention is not None:
            headers[CACHE_RETENTION_HEADER] = self.cache_retention
        return headers

    async def _next_delta(self) -> StreamDelta:
        assert self._response is not None
        while True:
            item = await self._response.__anext__()
            if isinstance(item, StreamStart):
                self.replica = item.replica
            elif isinstance(item, TokenTexts):
                self._texts.update(item.texts)
            elif isinstance(item, StreamError):
                raise item.to_api_error()
            else:
                self._usage = (item.num_prompt_tokens, item.num_output_tokens)
                if item.cache_retention is not None:
                    self.cache_retention = item.cache_retention
                self._progress.record(item)
                return item

    def _release(self) -> None:
        """Give the request's flow-control slot back, settling the tokens it used (once)."""
        if self._lease is not None:
            self._lease.release(*self._usage)

    def _send(self, request: EngineRequest) -> None:
        self.attempts += 1
        self._response = self._handle.options(stream=True, method_name="generate").remote(request)

    def _avoiding_this_replica(self, request: EngineRequest) -> EngineRequest:
        """``request`` with the replica that failed it among those the router tries last."""
        if self.replica is None or self.replica in request.avoid_replicas:
            return request
        return dataclasses.replace(request, avoid_replicas=(*request.avoid_replicas, self.replica))

    async def _first_delta(self) -> StreamDelta:
        last: BaseException | None = None
        for _ in range(self._max_attempts):
            self._send(self.request)
            try:
                return await self._next_delta()
            except StopAsyncIteration:
                raise RuntimeError(f"replica {self.replica} ended the stream without output") from None
            except Exception as exc:
                if not _replica_gone(exc):
                    raise _cause(exc) from None
                log.warning(
                    "replica %s failed before the first token of %s; resending", self.replica, self.request.request_id
                )
                assert self._response is not None
                self._response.cancel()
                self.request = self._avoiding_this_replica(self.request)
                self.replica = None
                last = exc
        raise ServiceUnavailableError(
            f"every replica tried for this request failed ({self._max_attempts} attempts): {last}",
            code="replica_failed",
            retry_after_s=1.0,
        )

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> StreamDelta:
        try:
            return await self._next()
        except BaseException:
            self._release()  # the end of the stream, or its failure
            raise

    async def _next(self) -> StreamDelta:
        if not self._started:
            self._started = True
            if self._admit is not None:
                self._lease = await self._admit(self.request)
            try:
                delta = await self._first_delta()
            except APIError as exc:
                # A client error of the replica's (the prompt too long, a bad adapter): not traffic of its key.
                if self._on_refused is not None and 400 <= exc.status_code < 500 and exc.status_code != 429:
                    self._on_refused(self.request)
                raise
            if self._on_first is not None:
                try:
                    self._on_first(self.request, delta)
                except Exception:  # bookkeeping must never fail a request
                    log.exception("observing the first delta of %s failed", self.request.request_id)
            return delta
        try:
            return await self._next_delta()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            reason = _lost_replica(exc)
            if reason is None:
                raise _cause(exc) from None
            return await self._migrate(reason, exc)

    async def _migrate(self, reason: str, exc: BaseException) -> StreamDelta:
        """Continue the stream on another replica (router/migration.py) after its replica died or
        ended it while stopping (``reason``); its next delta. When the stream may not move, or no
        replica takes it within the per-request limit, the replica's error ends it as before."""
        while True:
            m = self._migration
            refusal = (
                MIGRATION_DISABLED
                if m is None
                else migration_refusal(
                    self.request,
                    enabled=m.enabled,
                    migrations=self.migrations,
                    max_migrations=m.max_migrations,
                    draining=m.draining(),
                )
            )
            if refusal is not None:
                if m is not None:
                    m.count(reason, refusal)
                raise _cause(exc) from None
            assert m is not None and self._response is not None
            self._response.cancel()
            self.migrations += 1
            moved = self._avoiding_this_replica(
                dataclasses.replace(self.request, continuation=self._progress.continuation(self.migrations))
            )
            log.warning(
                "replica %s stopped serving %s after %d tokens (%s); continuing it on another replica",
                self.replica,
                self.request.request_id,
                len(self._progress.token_ids),
                reason,
            )
            self.request = dataclasses.replace(moved, continuation=None)
            self.replica = None
            self._send(moved)
            try:
                delta = await self._next_delta()
            except StopAsyncIteration:
                raise RuntimeError(f"replica {self.replica} ended the continued stream without output") from None
            except APIError:
                m.count(reason, MIGRATION_REFUSED)
                raise
            except Exception as again:
                lost = _lost_replica(again)
                if lost is None:
                    m.count(reason, MIGRATION_REFUSED)
                    raise _cause(again) from None
                reason, exc = lost, again
                continue
            m.count(reason, MIGRATION_MIGRATED)
            return delta

    async def aclose(self) -> None:
        """Cancel the replica-side stream (its generator aborts the engine request); free its slot."""
        self._release()
        if self._response is not None:
            self._response.cancel()


class ServeEngineClient:
    """An EngineClient over the engine deployment's Serve handle."""

    def __init__(
        self,
        handle: DeploymentHandle,
        max_attempts: int,
        flow: IngressFlow | None = None,
        migration: Migration | None = None,
    ) -> None:
        self._handle = handle
        self._max_attempts = max_attempts
        self._flow = flow
        self._migration = migration
        self._router: PrefixRouter | None = None
        self._model_info: ModelInfo | None = None
        self._model_info_at = float("-inf")
        self._model_info_lock = asyncio.Lock()
        self._health_lock = asyncio.Lock()
        self._healthy = False
        self._health_checked_at = float("-inf")

    async def model_info(self) -> ModelInfo:
        """Served model names, adapters and max_model_len, asked of the engine replicas at most once per
        MODEL_INFO_TTL_S: adapters loaded at run time, and replicas replaced by a new deployment (whose
        old replicas may answer first while they stop), show within that. While one request asks,
        the others take the info at hand rather than wait for the broadcast."""
        info = self._model_info
        if info is not None and (
            time.monotonic() - self._model_info_at < MODEL_INFO_TTL_S or self._model_info_lock.locked()
        ):
            return info
        async with self._model_info_lock:
            if self._model_info is None or time.monotonic() - self._model_info_at >= MODEL_INFO_TTL_S:
                # A broadcast, not a routed call: Serve's router counts a routed unary
                # call in flight on its replica long after it returned, which would
                # make bounded_load spill that replica's keys.
                answers = await self._handle.broadcast("model_info").results_async(return_exceptions=True)
                infos = [a for a in answers if isinstance(a, ModelInfo)]
                if not infos and self._model_info is None:
                    raise ServiceUnavailableError(
                        f"no engine replica answered: {answers[0] if answers else 'none running'}",
                        code="no_replica",
                        retry_after_s=1.0,
                    )
                if infos:
                    self._model_info = infos[0]
                self._model_info_at = time.monotonic()
        assert self._model_info is not None
        return self._model_info

    @property
    def cached_model_info(self) -> ModelInfo | None:
        """The model info once asked (None before)."""
        return self._model_info

    async def is_healthy(self) -> bool:
        """Whether at least one engine replica passes its health check (cached HEALTH_CACHE_S)."""
        async with self._health_lock:
            if time.monotonic() - self._health_checked_at >= HEALTH_CACHE_S:
                self._healthy = await self._any_replica_healthy()
                self._health_checked_at = time.monotonic()
            return self._healthy

    async def _any_replica_healthy(self) -> bool:
        try:
            answers = await self._handle.broadcast("check_health").results_async(
                timeout_s=HEALTH_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            return False
        return any(not isinstance(a, BaseException) for a in answers)

    @property
    def router(self) -> PrefixRouter | None:
        """This process's router of the engine deployment (None until the handle made it, or another class)."""
        if self._router is None:
            self._router = router_for(self._handle.app_name, self._handle.deployment_name)
        return self._router

    def _observe(self, request: EngineRequest, delta: StreamDelta) -> None:
        router = self.router
        if router is not None and request.routing_key:
            router.observe(request.routing_key, delta.num_prompt_tokens, delta.num_cached_tokens)

    def _refused(self, request: EngineRequest) -> None:
        router = self.router
        if router is not None and request.routing_key:
            try:
                router.refused(request.routing_key)
            except Exception:  # bookkeeping must never fail a request
                log.exception("forgetting the refused request %s failed", request.request_id)

    async def _admit(self, request: EngineRequest) -> Lease:
        assert self._flow is not None
        info = await self.model_info()
        return await self._flow.admit(request, info.scheduling_policy == "priority")

    def open_stream(self, request: EngineRequest) -> RemoteStream:
        admit = self._admit if self._flow is not None else None
        return RemoteStream(
            self._handle, request, self._max_attempts, self._observe, admit, self._refused, self._migration
        )


class SiblingStores:
    """The response stores of an ingress replica's siblings (responses_endpoint.OtherStores), asked by broadcast."""

    def __init__(self, ingress: "OpenAIIngress") -> None:
        self._ingress = ingress

    async def _ask(self, method: str, response_id: str, owner: str | None) -> list[Any]:
        ingress = self._ingress
        try:
            answers = (
                await ingress.siblings()
                .broadcast(method, ingress.name, response_id, owner)
                .results_async(timeout_s=SIBLING_STORE_TIMEOUT_S, return_exceptions=True)
            )
        except TimeoutError:
            log.warning("ingress replicas did not all answer %s within %ss", method, SIBLING_STORE_TIMEOUT_S)
            return []
        return [a for a in answers if not isinstance(a, BaseException)]

    async def find(self, response_id: str, owner: str | None) -> StoredResponse | None:
        found = [a for a in await self._ask("stored_response", response_id, owner) if a is not None]
        return found[0] if found else None

    async def delete(self, response_id: str, owner: str | None) -> bool:
        return any(await self._ask("delete_stored_response", response_id, owner))


app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None, openapi_url=None)
http_frontend.add_error_handlers(app)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI API over the engine deployments, one per base model (one or several replicas of this class)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        config: dict[str, Any] | None = None,
        more_engines: list[DeploymentHandle] | None = None,
    ) -> None:
        """``engine``: the default model's engine deployment; ``more_engines``: one per further base model."""
        self.config = IngressConfig.from_dict(config)
        self.engines = [engine, *(more_engines or [])]
        context = serve.get_replica_context()
        tenants = self.config.tenant_table()
        # The app build sets flow_max_in_flight (AppArgs.flow_max_in_flight); FlowConfig's default otherwise.
        self.flow = (
            IngressFlow(tenants, self.config.flow_config(FlowConfig().max_in_flight), context.deployment)
            if tenants is not None
            else None
        )
        migration = Migration(
            enabled=self.config.migrate_streams,
            max_migrations=self.config.max_stream_migrations,
            draining=lambda: self.draining,
            count=self._count_migration,
        )
        self.model_clients = {
            handle.deployment_name: ServeEngineClient(handle, self.config.max_attempts, self.flow, migration)
            for handle in self.engines
        }
        self.client = ModelsClient(list(self.model_clients.values()))
        # Serve's proxy passes the client's X-Request-Id (or one it generates) in and echoes it itself.
        self.options = FrontendOptions.build(
            [*self.config.api_keys, *(tenants.api_keys if tenants is not None else [])],
            self.config.max_body_bytes,
            echo_request_id=False,
            client_body_timeout_s=self.config.client_body_timeout_s,
            max_header_count=self.config.h11_max_header_count,
            max_header_bytes=self.config.h11_max_incomplete_event_size,
            ignored_fields=IgnoredFields(strict=self.config.strict_request_fields, count=self._count_ignored_field),
            tenant_of=self.flow.tenant_of if self.flow is not None else None,
        )
        self.draining = False
        self.key_config = PrefixKeyConfig(
            completion_prefix_chars=self.config.completion_prefix_chars,
            honor_header=self.config.honor_prefix_header,
            session_header=self.config.session_header,
            key_turns=self.config.key_turns,
        )
        self.name = context.replica_id.to_full_id_str()
        self._deployment = (context.deployment, context.app_name)
        self.responses_store = ResponseStore(self.config.responses_max_entries, self.config.responses_max_bytes)
        self.responses = ResponsesEndpoints(
            self.client, self.options, self.responses_store, self._routing_key, SiblingStores(self)
        )
        metrics = router_metrics()
        metrics.response_store_entries.labels(context.deployment).set_function(lambda: self.responses_store.entries)
        metrics.response_store_bytes.labels(context.deployment).set_function(lambda: self.responses_store.bytes)
        self._siblings: DeploymentHandle | None = None  # this deployment's handle, made at first use
        self._sync_task: asyncio.Task[None] | None = None
        self.placement_leader: str | None = None  # the leader at the last exchange

    def _count_migration(self, reason: str, result: str) -> None:
        router_metrics().stream_migrations.labels(self._deployment[0], reason, result).inc()

    def _count_ignored_field(self, name: str) -> None:
        router_metrics().ignored_request_fields.labels(self._deployment[0], name).inc()

    def siblings(self) -> DeploymentHandle:
        """A handle to this deployment (every ingress replica, this one included)."""
        if self._siblings is None:
            self._siblings = serve.get_deployment_handle(*self._deployment)
        return self._siblings

    # -- placement agreement ---------------------------------------------------------
    def _ensure_placement_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._placement_sync_loop())

    async def _placement_sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.placement_sync_s)
            try:
                await self.sync_placement()
            except Exception:
                log.exception("placement exchange failed; retrying in %ss", self.config.placement_sync_s)

    def placed_routers(self) -> dict[str, PrefixRouter]:
        """This process's ``placed`` router of each engine deployment (by deployment name) that has one."""
        return {
            deployment: router
            for deployment, client in self.model_clients.items()
            if (router := client.router) is not None and router.placed is not None
        }

    async def sync_placement(self) -> str | None:
        """One exchange with the sibling ingress replicas (see the module docstring); the leader's name.

        One leader for every model: each model's router counts its own keys, and the leader's
        snapshot of each model's placement is what its followers apply.
        """
        routers = self.placed_routers()
        if not routers:
            return None
        counts = {deployment: router.take_counts() for deployment, router in routers.items()}
        try:
            answers = (
                await self.siblings()
                .broadcast("placement_exchange", self.name, counts)
                .results_async(timeout_s=PLACEMENT_TIMEOUT_S, return_exceptions=True)
            )
        except TimeoutError:
            log.warning("ingress replicas did not all answer the placement exchange within %ss", PLACEMENT_TIMEOUT_S)
            return self.placement_leader
        ready = {
            name: snapshot
            for item in answers
            if not isinstance(item, BaseException)
            for name, is_ready, snapshot in [item]
            if is_ready
        }
        ready.setdefault(self.name, None)
        leader = min(ready)
        snapshots = ready[leader] if leader != self.name else None
        for deployment, router in routers.items():
            router.set_leader(leader == self.name)
            if snapshots is not None and snapshots.get(deployment) is not None:
                router.apply_placement(snapshots[deployment])
        self.placement_leader = leader
        return leader

    def stored_response(self, caller: str, response_id: str, owner: str | None) -> StoredResponse | None:
        """A sibling's lookup: ``owner``'s response in this replica's store (None for the caller itself)."""
        return None if caller == self.name else self.responses_store.get(response_id, owner)

    def delete_stored_response(self, caller: str, response_id: str, owner: str | None) -> bool:
        """A sibling's delete: whether this replica's store held ``owner``'s response (never the caller's)."""
        return caller != self.name and self.responses_store.delete(response_id, owner)

    def placement_exchange(self, caller: str, counts: dict[str, dict[str, list[int]]]) -> tuple[str, bool, Any]:
        """A sibling's exchange: merge its counts (per engine deployment) where this replica's routers
        lead; (name, has a placed router, {deployment: snapshot} when leading, else None)."""
        routers = self.placed_routers()
        if not routers:
            return self.name, False, None
        snapshots = {}
        for deployment, router in routers.items():
            if not router.is_leader:
                continue
            if caller != self.name and counts.get(deployment):
                router.merge_counts(counts[deployment])
            snapshots[deployment] = router.placement_snapshot()
        return self.name, True, snapshots or None

    def _named(self, response: Response) -> Response:
        response.headers[INGRESS_HEADER] = self.name
        return response

    def _routing_key(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
        # The front end asked the model info before it asks the key: it is cached by then.
        model = body.get("model")
        info = self.client.cached_model_info(model if isinstance(model, str) else None)
        adapter = info.adapter(model) if info is not None and isinstance(model, str) else None
        return routing_key(body, headers, self.key_config, adapter=adapter)

    def begin_drain(self) -> None:
        """Stop taking requests (``/health`` and new generation requests: 503); those here run on."""
        if not self.draining:
            log.info("draining: new requests are refused")
        self.draining = True

    def _drain_refusal(self) -> Response:
        err = ServiceUnavailableError(
            "the cluster is shutting down; retry later", code=SHUTTING_DOWN_CODE, retry_after_s=1.0
        )
        # Not http_frontend.error_response: an expected refusal, not a failure to log.
        return self._named(JSONResponse(err.body(), status_code=err.status_code, headers=err.headers()))

    async def _generate(self, request: Request, model_cls: type[api.OpenAIRequest]) -> Response:
        if self.draining:
            return self._drain_refusal()
        self._ensure_placement_sync()
        response = await http_frontend.handle_generate(
            request, model_cls, self.client, self.options, routing_key=self._routing_key
        )
        return self._named(response)

    # -- endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        if self.draining:
            return self._drain_refusal()
        return self._named(await http_frontend.handle_health(self.client))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        routers, engines = await asyncio.gather(self.ingress_router_metrics(), self.engine_metrics())
        body = merge_expositions(routers, label="ingress") + merge_expositions(engines)
        return self._named(Response(body, media_type=CONTENT_TYPE_LATEST))

    def named_router_metrics_text(self) -> tuple[str, str]:
        """This ingress replica's name and its router's Prometheus text (for a sibling's /metrics)."""
        return self.name, router_metrics().exposition().decode("utf-8")

    async def ingress_router_metrics(self) -> dict[str, str]:
        """Every ingress replica's router metrics text, by replica name; this one's always."""
        texts = dict([self.named_router_metrics_text()])
        try:
            pairs = (
                await self.siblings()
                .broadcast("named_router_metrics_text")
                .results_async(timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
            )
        except TimeoutError:
            log.warning("ingress replicas did not all answer for /metrics within %ss", METRICS_TIMEOUT_S)
            return texts
        for item in pairs:
            if not isinstance(item, BaseException):
                name, text = item
                texts.setdefault(name, text)
        return texts

    async def engine_metrics(self) -> dict[str, str]:
        """Each live engine replica's Prometheus text, by replica name (a dead one is left out), every model's."""
        answers = await asyncio.gather(
            *(e.broadcast("named_metrics_text").results_async(return_exceptions=True) for e in self.engines)
        )
        return {
            name: text
            for pairs in answers
            for item in pairs
            if not isinstance(item, BaseException)
            for name, text in [item]
        }

    @app.get("/placement")
    async def placement(self, request: Request) -> Response:
        """This replica's ``placed`` snapshot (router/policies/placed.py) plus ``held`` (per key, the replicas its
        KV events say hold the prefix); 404 when the policy is not ``placed``. ``?model=NAME``: that
        base model's placement (each model's engines have their own ring), else the default model's.

        Behind the API key like ``/v1/*``: the table names every tenant's routing key and where its
        prefix is cached, which an outsider could use to aim load at one tenant's replicas.
        """
        try:
            http_frontend.check_auth(request, self.options)
        except APIError as exc:
            return self._named(http_frontend.error_response(exc))
        name = request.query_params.get("model")
        client = self.client.serving(name) if name is not None else self.client.default
        if client is None:
            return self._named(http_frontend.error_response(ModelNotFoundError(f"no model {name!r} here")))
        router = client.router
        snapshot = router.placement_snapshot() if router is not None else None
        if snapshot is None:
            return self._named(
                http_frontend.error_response(
                    NoPlacementError("no placement here: the router's policy is not 'placed' or has routed nothing yet")
                )
            )
        # Beside the snapshot (apply_snapshot ignores it): which replicas KV events say hold each key.
        response = JSONResponse({**snapshot, "held": router.kv_held()})
        response.headers["X-Prefixserve-Placement-Leader"] = self.placement_leader or ""
        return self._named(response)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        return self._named(await http_frontend.handle_openapi(request, app, self.options))

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        return self._named(await http_frontend.handle_models(request, self.client, self.options))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, api.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, api.CompletionRequest)

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        if self.draining:
            return self._drain_refusal()
        self._ensure_placement_sync()
        return self._named(await self.responses.create(request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, request: Request, response_id: str) -> Response:
        return self._named(await self.responses.retrieve(request, response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, request: Request, response_id: str) -> Response:
        return self._named(await self.responses.delete(request, response_id))
