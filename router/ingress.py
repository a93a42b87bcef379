"""The Ray Serve ingress: the cluster's OpenAI endpoint in front of the engine replicas.

Job: parse, validate and authenticate OpenAI requests exactly as the
standalone replica server does (replica/server.py, replica/api.py,
replica/openai_serving.py: same endpoints, same protocol models, same answers,
error bodies and status codes), compute the routing key (router/prefix.py),
and stream the request through the engine deployment's handle, whose request
router (router/serve_router.py) picks the replica. Every answer that reached a
replica names it in ``X-Prefixserve-Replica``.

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
* /metrics merges this process's router metrics with every engine replica's
  metrics (each sample labelled ``replica``).

No ``from __future__ import annotations`` here: Serve's class-based FastAPI
ingress resolves the endpoints' parameter annotations (``request: Request``) at
runtime, and string annotations turn them into query parameters.

Imports Ray Serve, FastAPI, the protocol models and the deployment's request
types; never torch (the model lives in the engine replicas).
"""

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixserve.replica import api, openai_serving
from prefixserve.replica.deployment import EngineRequest, StreamStart, TokenTexts
from prefixserve.replica.openai_serving import Generation, OpenAIRequest
from prefixserve.replica.outputs import StreamDelta
from prefixserve.replica.server import (
    DEFAULT_MAX_BODY_BYTES,
    REPLICA_HEADER,
    ClientDisconnected,
    add_error_handlers,
    error_response,
    read_body,
    respond,
    start_generation,
)
from prefixserve.router.metrics import merge_expositions, router_metrics
from prefixserve.router.prefix import PrefixKeyConfig, routing_key

log = logging.getLogger(__name__)

# Tries per request before a dead-replica failure is reported (one per replica
# that can die under it; Serve's controller replaces dead replicas meanwhile).
DEFAULT_MAX_ATTEMPTS = 4


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
    def from_dict(cls, data: dict[str, Any]) -> "IngressConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ingress config keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)


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


app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)
add_error_handlers(app)


INGRESS_HEADER = "X-Prefixserve-Ingress"
# How many times the request was sent to a replica (above 1: earlier replicas died under it).
ATTEMPTS_HEADER = "X-Prefixserve-Attempts"


@serve.deployment(name="Ingress")
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI API over the engine deployment (one or several replicas of this class)."""

    def __init__(self, engine: DeploymentHandle, config: dict[str, Any] | None = None) -> None:
        self.config = IngressConfig.from_dict(dict(config or {}))
        self.engine = engine
        self.key_config = PrefixKeyConfig(
            completion_prefix_chars=self.config.completion_prefix_chars,
            honor_header=self.config.honor_prefix_header,
        )
        self._keys = [k.encode() for k in self.config.api_keys]
        self._model_info: dict[str, Any] | None = None
        self._model_info_lock = asyncio.Lock()
        self.name = serve.get_replica_context().replica_id.to_full_id_str()

    def _with_replica(self, response: Response, stream: RemoteStream | None) -> Response:
        """Name the engine replica that served (when one took the request), the attempts and this ingress."""
        if stream is not None:
            if stream.replica is not None:
                response.headers[REPLICA_HEADER] = stream.replica
            response.headers[ATTEMPTS_HEADER] = str(stream.attempts)
        response.headers[INGRESS_HEADER] = self.name
        return response

    # -- helpers ---------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        openai_serving.check_api_key(request.headers.get("authorization", ""), self._keys)

    async def model_info(self) -> dict[str, Any]:
        """Served model names and max_model_len, asked of an engine replica once."""
        async with self._model_info_lock:
            if self._model_info is None:
                # A broadcast, not a routed call: Serve's router counts a routed unary
                # call in flight on its replica long after it returned, which would
                # make bounded_load spill that replica's keys.
                answers = await self.engine.broadcast("model_info").results_async(return_exceptions=True)
                infos = [a for a in answers if not isinstance(a, BaseException)]
                if not infos:
                    raise api.ServiceUnavailableError(
                        f"no engine replica answered: {answers[0] if answers else 'none running'}",
                        code="no_replica", retry_after_s=1.0,
                    )
                self._model_info = infos[0]
        return self._model_info

    async def _check_model(self, name: str | None) -> str:
        info = await self.model_info()
        if name is not None and name not in (info["model_name"], info["model"]):
            raise api.ModelNotFoundError(
                f"the model {name!r} does not exist on this server; it serves {info['model_name']!r}",
                param="model",
                code="model_not_found",
            )
        return info["model_name"]

    async def _prepare(self, request: Request, model_cls: type[OpenAIRequest]) -> tuple[Any, str, str | None]:
        self._check_auth(request)
        raw = await read_body(request, self.config.max_body_bytes)
        body = api.parse_request(model_cls, raw)
        model = await self._check_model(body.model)
        try:
            key = routing_key(json.loads(raw), request.headers, self.key_config)
        except ValueError as exc:
            raise api.BadRequestError(str(exc), code="invalid_value") from None
        return body, model, key

    async def _generate(self, request: Request, model_cls: type[OpenAIRequest]) -> Response:
        """Send the request and wait for its first delta (resending while replicas die), then answer."""
        stream: RemoteStream | None = None
        try:
            body, model, key = await self._prepare(request, model_cls)
            max_model_len = (await self.model_info())["max_model_len"]
            # The replica lowers the default to what fits once it has tokenized the prompt.
            default_max = body.default_max_tokens(max_model_len)
            engine_request = EngineRequest(
                request_id=api.new_id(body.id_prefix),
                **body.prompt_fields(),
                sampling=body.to_sampling_params(default_max_tokens=default_max, max_model_len=max_model_len),
                max_tokens_default=None if body.requested_max_tokens() is not None else default_max,
                cache_salt=body.cache_salt,
                routing_key=key,
            )
            stream = RemoteStream(self.engine, engine_request, self.config.max_attempts)
            gen = Generation(engine_request.request_id, stream)
            await start_generation(request, gen)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            return self._with_replica(error_response(exc), stream)
        return self._with_replica(await respond(request, gen, body, model, stream.token_text), stream)

    # -- endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.engine_metrics()
        body = router_metrics().exposition() + merge_expositions(texts)
        return self._with_replica(Response(body, media_type=CONTENT_TYPE_LATEST), None)

    async def engine_metrics(self) -> dict[str, str]:
        """Each live engine replica's Prometheus text, by replica name (a dead one is left out)."""
        pairs = await self.engine.broadcast("named_metrics_text").results_async(return_exceptions=True)
        return {name: text for item in pairs if not isinstance(item, BaseException) for name, text in [item]}

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        info = await self.model_info()
        card = api.ModelCard(id=info["model_name"], root=info["model"], max_model_len=info["max_model_len"])
        return JSONResponse(api.ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, api.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, api.CompletionRequest)
