"""The Ray Serve ingress: the cluster's OpenAI endpoint in front of the engine replicas.

Job: host the OpenAI front end (``replica/http_frontend.py``, the same code the
standalone replica server hosts: same endpoints, protocol models, answers,
error bodies and status codes) over an :class:`EngineClient` that reaches the
engine deployment through its Serve handle, whose request router
(router/serve_router.py) picks the replica; compute the routing key
(router/prefix.py) from the body the front end parsed. Every answer that
reached a replica names it in ``X-Prefixserve-Replica``.

Invariants:

* A request that fails because its replica died (Ray reports the actor dead
  or unavailable) before any token reached this ingress is sent again; the
  router has dropped the dead replica, so it lands on the key's next ring
  replica. Once the first token is here it is never resent (the client may
  already have it).
* The ingress keeps no routing state of its own: several ingress replicas
  (each with its own handle and router) route the same key to the same replica.
* Answers name the ingress replica too (``X-Prefixserve-Ingress``), so that
  several ingress replicas can be told apart, and how many sends the request
  took (``X-Prefixserve-Attempts``).
* ``/health`` answers 200 only while at least one engine replica passes its
  health check (asked at most once per ``HEALTH_CACHE_S``), else 503.
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
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixserve.replica import api, http_frontend
from prefixserve.replica.config_util import from_dict
from prefixserve.replica.deployment import EngineRequest, StreamStart, TokenTexts
from prefixserve.replica.engine_client import ModelInfo
from prefixserve.replica.http_frontend import DEFAULT_MAX_BODY_BYTES, REPLICA_HEADER, FrontendOptions
from prefixserve.replica.outputs import StreamDelta
from prefixserve.router.metrics import merge_expositions, router_metrics
from prefixserve.router.prefix import PrefixKeyConfig, routing_key

log = logging.getLogger(__name__)

# Tries per request before a dead-replica failure is reported (one per replica
# that can die under it; Serve's controller replaces dead replicas meanwhile).
DEFAULT_MAX_ATTEMPTS = 4
# /health asks the engine replicas at most this often (a probe storm costs one broadcast)...
HEALTH_CACHE_S = 1.0
# ... and counts replicas that have not answered within this as unhealthy.
HEALTH_TIMEOUT_S = 2.0
# /metrics waits this long for the other ingress replicas' router metrics.
METRICS_TIMEOUT_S = 2.0
INGRESS_HEADER = "X-Prefixserve-Ingress"
# How many times the request was sent to a replica (above 1: earlier replicas died under it).
ATTEMPTS_HEADER = "X-Prefixserve-Attempts"


@dataclass
class IngressConfig:
    """Knobs of the ingress deployment (the ``ingress`` section of the app args)."""

    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    completion_prefix_chars: int = PrefixKeyConfig().completion_prefix_chars
    honor_prefix_header: bool = True

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "IngressConfig":
        return from_dict(cls, data, "ingress config")


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (for the status mapping)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def _replica_gone(exc: BaseException) -> bool:
    """True when the request failed because its replica actor died or cannot be reached."""
    return isinstance(exc, RayActorError) or isinstance(_cause(exc), RayActorError)


class RemoteStream:
    """The deltas of one request from an engine replica, resent while no token has arrived.

    An async iterator of StreamDelta. ``replica`` names the replica serving it
    (set once a replica took it); ``token_text`` decodes token ids the replica
    sent texts for (logprobs).
    """

    def __init__(self, handle: DeploymentHandle, request: EngineRequest, max_attempts: int) -> None:
        self._handle = handle
        self.request = request
        self._max_attempts = max_attempts
        self._response: DeploymentResponseGenerator | None = None
        self._started = False
        self._texts: dict[int, str] = {}
        self.replica: str | None = None
        self.attempts = 0

    def token_text(self, token_id: int) -> str:
        return self._texts[token_id]

    def response_headers(self) -> dict[str, str]:
        """The replica that took the request (once one did) and how many sends it took."""
        headers = {ATTEMPTS_HEADER: str(self.attempts)}
        if self.replica is not None:
            headers[REPLICA_HEADER] = self.replica
        return headers

    async def _next_delta(self) -> StreamDelta:
        assert self._response is not None
        while True:
            item = await self._response.__anext__()
            if isinstance(item, StreamStart):
                self.replica = item.replica
            elif isinstance(item, TokenTexts):
                self._texts.update(item.texts)
            else:
                return item

    async def _first_delta(self) -> StreamDelta:
        last: BaseException | None = None
        for _ in range(self._max_attempts):
            self.attempts += 1
            self._response = self._handle.options(stream=True, method_name="generate").remote(self.request)
            try:
                return await self._next_delta()
            except StopAsyncIteration:
                raise RuntimeError(f"replica {self.replica} ended the stream without output") from None
            except Exception as exc:
                if not _replica_gone(exc):
                    raise _cause(exc) from None
                log.warning("replica %s failed before the first token of %s; resending",
                            self.replica, self.request.request_id)
                self._response.cancel()
                self.replica = None
                last = exc
        raise api.ServiceUnavailableError(
            f"every replica tried for this request failed ({self._max_attempts} attempts): {last}",
            code="replica_failed",
            retry_after_s=1.0,
        )

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._started:
            self._started = True
            return await self._first_delta()
        try:
            return await self._next_delta()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            raise _cause(exc) from None

    async def aclose(self) -> None:
        """Cancel the replica-side stream; its generator aborts the engine request."""
        if self._response is not None:
            self._response.cancel()


class ServeEngineClient:
    """An EngineClient over the engine deployment's Serve handle."""

    def __init__(self, handle: DeploymentHandle, max_attempts: int) -> None:
        self._handle = handle
        self._max_attempts = max_attempts
        self._model_info: ModelInfo | None = None
        self._model_info_lock = asyncio.Lock()
        self._health_lock = asyncio.Lock()
        self._healthy = False
        self._health_checked_at = float("-inf")

    async def model_info(self) -> ModelInfo:
        """Served model names and max_model_len, asked of an engine replica once."""
        async with self._model_info_lock:
            if self._model_info is None:
                # A broadcast, not a routed call: Serve's router counts a routed unary
                # call in flight on its replica long after it returned, which would
                # make bounded_load spill that replica's keys.
                answers = await self._handle.broadcast("model_info").results_async(return_exceptions=True)
                infos = [a for a in answers if isinstance(a, ModelInfo)]
                if not infos:
                    raise api.ServiceUnavailableError(
                        f"no engine replica answered: {answers[0] if answers else 'none running'}",
                        code="no_replica", retry_after_s=1.0,
                    )
                self._model_info = infos[0]
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
                timeout_s=HEALTH_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            return False
        return any(not isinstance(a, BaseException) for a in answers)

    def open_stream(self, request: EngineRequest) -> RemoteStream:
        return RemoteStream(self._handle, request, self._max_attempts)


app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)
http_frontend.add_error_handlers(app)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI API over the engine deployment (one or several replicas of this class)."""

    def __init__(self, engine: DeploymentHandle, config: dict[str, Any] | None = None) -> None:
        self.config = IngressConfig.from_dict(config)
        self.engine = engine
        self.client = ServeEngineClient(engine, self.config.max_attempts)
        # Serve's proxy passes the client's X-Request-Id (or one it generates) in and echoes it itself.
        self.options = FrontendOptions.build(self.config.api_keys, self.config.max_body_bytes,
                                             echo_request_id=False)
        self.key_config = PrefixKeyConfig(
            completion_prefix_chars=self.config.completion_prefix_chars,
            honor_header=self.config.honor_prefix_header,
        )
        context = serve.get_replica_context()
        self.name = context.replica_id.to_full_id_str()
        self._deployment = (context.deployment, context.app_name)
        self._siblings: DeploymentHandle | None = None  # this deployment's handle, made at first use

    def _named(self, response: Response) -> Response:
        response.headers[INGRESS_HEADER] = self.name
        return response

    def _routing_key(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
        return routing_key(body, headers, self.key_config)

    async def _generate(self, request: Request, model_cls: type[api.OpenAIRequest]) -> Response:
        response = await http_frontend.handle_generate(request, model_cls, self.client, self.options,
                                                       routing_key=self._routing_key)
        return self._named(response)

    # -- endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
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
        if self._siblings is None:
            self._siblings = serve.get_deployment_handle(*self._deployment)
        try:
            pairs = await self._siblings.broadcast("named_router_metrics_text").results_async(
                timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            log.warning("ingress replicas did not all answer for /metrics within %ss", METRICS_TIMEOUT_S)
            return texts
        for item in pairs:
            if not isinstance(item, BaseException):
                name, text = item
                texts.setdefault(name, text)
        return texts

    async def engine_metrics(self) -> dict[str, str]:
        """Each live engine replica's Prometheus text, by replica name (a dead one is left out)."""
        pairs = await self.engine.broadcast("named_metrics_text").results_async(return_exceptions=True)
        return {name: text for item in pairs if not isinstance(item, BaseException) for name, text in [item]}

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        return self._named(await http_frontend.handle_models(request, self.client, self.options))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, api.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, api.CompletionRequest)
