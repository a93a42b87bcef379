"""Draining the running prefixserve app before Serve stops it (``prefixserve up`` on SIGTERM or Ctrl-C).

Job: :func:`drain_app`: tell every ingress replica to refuse new requests
(``/health`` and generation requests answer 503 with Retry-After, so a load
balancer moves on), wait until the engine replicas hold no request or the
drain timeout passes, then end what is left in-band (each engine replica's
``end_requests``: an error event and ``[DONE]`` on every open stream). Serve's
own stop then drains the ingress replicas (graceful_shutdown_timeout_s, set
from the same timeout by router/serve/app.py), so the last events reach the clients.

Serve offers no hook at the start of a replica's stop; a stop Serve makes on
its own (a redeploy, a downscale) waits up to graceful_shutdown_timeout_s for
the replica's requests and then kills it, and the ingress ends such a stream
with an in-band error event and ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefixserve.router.cluster_config import ENGINE_DEPLOYMENT

log = logging.getLogger(__name__)

INGRESS_DEPLOYMENT = "Ingress"
# Bounds on each broadcast, and the poll period of the wait.
CALL_TIMEOUT_S = 10.0
POLL_S = 0.25


def open_requests(stats: list[Any]) -> int | None:
    """Running plus waiting requests over the engine replicas' ``engine_stats`` answers; None when a
    replica did not answer (it may hold requests: the drain waits on)."""
    if not all(isinstance(s, dict) for s in stats):
        return None
    return sum(int(s["num_running"]) + int(s["num_waiting"]) for s in stats)


def _broadcast(handle: Any, method: str) -> list[Any]:
    """Every replica's answer to ``method`` (an exception for one that failed or did not answer in time)."""
    try:
        return list(handle.broadcast(method).results(timeout_s=CALL_TIMEOUT_S, return_exceptions=True))
    except TimeoutError as exc:
        return [exc]


def is_engine_deployment(name: str) -> bool:
    """Whether deployment ``name`` of a prefixserve app is an engine deployment (one per base model)."""
    return name == ENGINE_DEPLOYMENT or name.startswith(ENGINE_DEPLOYMENT + "-")


def drain_app(app_name: str, timeout_s: float) -> int:
    """Drain ``app_name`` (see the module docstring); how many requests were ended at the timeout."""
    from ray import serve

    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name)
    status = serve.status().applications.get(app_name)
    names = [n for n in status.deployments if is_engine_deployment(n)] if status is not None else []
    engines = [serve.get_deployment_handle(n, app_name) for n in names or [ENGINE_DEPLOYMENT]]
    _broadcast(ingress, "begin_drain")
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [open_requests(_broadcast(engine, "engine_stats")) for engine in engines]
        if all(c == 0 for c in counts):
            log.info("drained: no request open")
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    ended = [n for engine in engines for n in _broadcast(engine, "end_requests")]
    count = sum(n for n in ended if isinstance(n, int))
    log.warning("drain timeout (%g s): ended %d open requests with an error", timeout_s, count)
    return count
