"""The Ray Serve deployment that hosts one engine replica.

Job: run one ``AsyncEngine`` (replica/engine/async_engine.py) inside a Serve replica, stream
its deltas back to the caller (the ingress, through a DeploymentHandle whose
request router is router/serve/request_router.py), and report what routers and
dashboards need: routing stats (KV usage, running, waiting), health, the
engine's Prometheus text and the replica's ring name.

The stream protocol of :meth:`EngineDeployment.generate` (its items are
replica/contract/stream.py's): one
:class:`StreamStart` naming the replica that took the request, then the
engine's ``StreamDelta`` objects until every sequence has a finish reason
(with logprobs asked, a :class:`TokenTexts` before each delta that brings
token ids not decoded yet). The StreamStart comes before the engine has done
any work, so the caller knows where the request landed even if it fails
later. A client error (a 4xx: prompt too long, overload, bad prompt) ends the
stream with one :class:`StreamError` item, never an exception: an exception
raised out of a Serve replica is logged with its traceback, and the traceback's
frames hold the request (its whole message list) for as long as anything keeps
the exception. Server errors are raised.

Invariants:

* :class:`EngineRequest` is the handle call's first positional argument and
  carries ``routing_key`` (read by router/serve/request_router.py) and ``prompt`` or
  ``messages`` (read by Ray Serve LLM's PrefixCacheAffinityRouter), so either
  router can sit on this deployment.
* A request whose caller goes away (stream cancelled) is aborted in the engine,
  freeing its KV blocks.
* The replica's name is its ring name: ``ring_name`` of its Serve rank
  (replica/contract/routing.py), which a replacement inherits, or its full Serve
  replica id while it has no rank. It reports the rank in its routing stats and
  the request router places it on the ring by it.
* Stopping ends every open stream in-band: :meth:`EngineDeployment.end_requests`
  (called by the cluster's drain once its timeout has passed) and the
  destructor fail each request still in the engine with a 503
  ``server_shutting_down``, which the ingress sends as an error event and
  ``[DONE]``; its KV blocks are freed. Either then writes the replica's hot cached
  blocks to the shared disk tier, within ``kv_drain_save_timeout_s``, before the
  engine stops (replica/engine/tiers.py ``save_hot_blocks``).

Imports Ray Serve and the engine; torch and the model load only inside the
replica (``EngineDeployment.__init__``), so the ingress can import
:class:`EngineRequest` without them. Must not import router/.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from prometheus_client import generate_latest
from ray import serve
from ray.serve.context import _get_internal_replica_context

from prefixserve.replica.contract.continuation import SHUTTING_DOWN_CODE
from prefixserve.replica.contract.history_events import HistoryTracker
from prefixserve.replica.contract.kv_events import KVEventPublisher
from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.contract.routing import ring_name
from prefixserve.replica.contract.stream import StreamError, StreamItem, StreamStart, TokenTexts
from prefixserve.replica.engine.request_runner import RequestRunner
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from prefixserve.replica.config import EngineConfig

__all__ = ["EngineDeployment"]

log = logging.getLogger(__name__)


def kv_events_for_rank(config: EngineConfig, rank: int | None) -> EngineConfig:
    """``config`` with its vLLM-format KV event endpoints moved for this replica's rank (every
    replica of a deployment gets the same config; vLLM moves its data-parallel ranks' ports the same
    way), so replicas sharing a host do not bind one port. Unchanged without events or a rank."""
    events = config.kv_events
    if events is None or not events.enabled or not rank:
        return config
    return dataclasses.replace(config, kv_events_config=events.for_rank(rank).to_json())


def replica_rank() -> int | None:
    """This Serve replica's rank in its deployment (None outside a replica or before Serve assigns one).

    Read at every use: Serve may reassign ranks (to keep them contiguous) and
    updates the replica context when it does.
    """
    context = _get_internal_replica_context()
    rank = getattr(context, "rank", None)
    rank = getattr(rank, "rank", rank)  # a ReplicaRank (Serve 2.60) or a plain int
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None


def _shutting_down() -> ServiceUnavailableError:
    return ServiceUnavailableError(
        "this replica is shutting down and the request did not finish within the drain timeout; retry it",
        code=SHUTTING_DOWN_CODE,
        retry_after_s=1.0,
    )


@serve.deployment(name="Engine")
class EngineDeployment:
    """A Serve replica hosting one AsyncEngine built from an ``EngineConfig`` dict."""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        # Imported here so that importing this module (the ingress does, for
        # EngineRequest) does not load torch.
        from prefixserve.common.gc_heap import freeze_gc_heap
        from prefixserve.replica.config import EngineConfig
        from prefixserve.replica.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(kv_events_for_rank(EngineConfig.from_dict(dict(engine_config)), replica_rank()))
        self.kv_events = KVEventPublisher(history=HistoryTracker())
        self.engine.metrics.track_cache_bytes("kv_events", lambda: self.kv_events.nbytes)
        self.runner = RequestRunner(self.engine, self.kv_events)
        context = serve.get_replica_context()
        self._replica_id = context.replica_id
        self._stats_seq = 0
        freeze_gc_heap()  # this process hosts this engine for its whole life (common/gc_heap.py)

    @property
    def name(self) -> str:
        """The ring name (the module docstring): by rank, or the full replica id without one."""
        rank = replica_rank()
        rid = self._replica_id
        if rank is None:
            return rid.to_full_id_str()
        return ring_name(rid.deployment_id.app_name, rid.deployment_id.name, rank)

    async def __del__(self) -> None:
        # Serve 2.60 awaits an async __del__, once, when it tears the replica down
        # (ray/serve/_private/replica.py, call_destructor). The constructor may have
        # failed before the engine existed.
        engine = getattr(self, "engine", None)
        if engine is not None and engine.is_running:
            await engine.shutdown(_shutting_down(), save_hot_blocks=True)

    async def end_requests(self) -> int:
        """End every request this replica still serves (a 503 ``server_shutting_down`` each, sent
        in-band on a stream) and stop its engine; how many there were. The last step of a drain."""
        stats = self.engine.stats()
        if self.engine.is_running:
            await self.engine.shutdown(_shutting_down(), save_hot_blocks=True)
        return int(stats.num_running + stats.num_waiting)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        """Stream one request: a StreamStart, then the engine's deltas (and TokenTexts for logprobs).

        A client error (prompt too long, overload, bad prompt) ends the stream with a
        StreamError, logged as one line; a server error is raised. A stream left early
        (the caller cancelled it) is aborted in the engine.
        """
        yield StreamStart(request_id=request.request_id, replica=self.name)
        stream = self.runner.generate(request)
        known: set[int] = set()
        refused: StreamError | None = None
        try:
            try:
                async for delta in stream:
                    if request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None:
                        ids = set(delta.token_ids).union(
                            *(entry.keys() for entry in delta.logprobs or ()),
                            *(entry.keys() for entry in delta.prompt_logprobs or () if entry),
                            delta.prompt_token_ids or (),
                        )
                        new = ids - known
                        if new:
                            known |= new
                            yield TokenTexts({i: self.engine.tokenizer.decode([i]) for i in sorted(new)})
                    yield delta
            except Exception as exc:
                err = api.error_from_exception(exc)
                if err.status_code >= 500:
                    raise
                refused = StreamError.of(err)
        finally:
            # Closing an unfinished engine stream aborts the request and frees its blocks.
            # Shielded: this runs while Serve cancels a stream whose caller went away.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        if refused is not None:
            # Yielded outside the except block: the exception and its frames are gone by now.
            log.info(
                "request %s refused: %d %s: %s", request.request_id, refused.status_code, refused.code, refused.message
            )
            yield refused

    async def record_routing_stats(self) -> dict[str, Any]:
        """What routers see as ``RunningReplica.routing_stats`` (about one period late).

        ``seq`` counts reports (a router tells a new report from one it has seen);
        the load fields are router/policies/'s ReplicaLoad (``lora_adapters`` and ``lora_capacity``:
        its ``adapters`` and ``adapter_capacity``, absent with LoRA off); ``kv_events`` is the
        KV event publisher's payload (replica/contract/kv_events.py); ``rank`` is the
        replica's Serve rank (the router's ring name for it), absent without one.
        """
        stats = self.engine.stats()
        self._stats_seq += 1
        view = self.engine.kv_block_view()
        events = self.kv_events.publish(view.contains, view.medium_of, view.shared_of, view.disk_group)
        report: dict[str, Any] = {
            "seq": self._stats_seq,
            "kv_usage": min(1.0, max(0.0, float(stats.kv_usage))),
            "num_running": int(stats.num_running),
            "num_waiting": int(stats.num_waiting),
            "queued_prefill_tokens": self.engine.queued_prefill_tokens(),
            "kv_capacity_tokens": int(stats.num_kv_blocks) * self.engine.config.block_size,
            "kv_events": events,
        }
        if stats.lora_capacity:
            report["lora_adapters"] = list(stats.lora_loaded)
            report["lora_capacity"] = stats.lora_capacity
        rank = replica_rank()
        if rank is not None:
            report["rank"] = rank
        return report

    async def check_health(self) -> None:
        """Serve's health check (and the ingress's /health): raise EngineDeadError when the engine is dead for good.

        While the engine restarts after a failure it still counts as healthy
        (it serves again right after); Serve replaces this replica only once the
        engine has given up.
        """
        self.engine.check_health()

    def metrics_text(self) -> str:
        """The engine's Prometheus exposition (vLLM metric names)."""
        return generate_latest(self.engine.metrics.registry).decode("utf-8")

    def named_metrics_text(self) -> tuple[str, str]:
        """(this replica's name, its Prometheus text): one broadcast call gathers the cluster's."""
        return self.name, self.metrics_text()

    def engine_stats(self) -> dict[str, Any]:
        """The engine's EngineStats as a dict, with this replica's name under ``replica``."""
        return {**dataclasses.asdict(self.engine.stats()), "replica": self.name}

    def replica_name(self) -> str:
        """This replica's ring name (by its rank; its full Serve replica id without one)."""
        return self.name

    def replica_names(self) -> tuple[str, str]:
        """(this replica's ring name, its full Serve replica id: its actor's name, random per replica)."""
        return self.name, self._replica_id.to_full_id_str()

    def model_info(self) -> ModelInfo:
        """Served names and context length (the ingress's /v1/models and request checks)."""
        return self.runner.model_info()
