"""A prefixserve cluster under load: bring-up, its metrics, per-replica bookkeeping.

Job: the pieces a cluster benchmark or demo needs, each usable alone.

* :class:`LocalServeCluster`: a local Ray instance with Serve's HTTP proxy on one
  port; ``deploy(app_args, name)`` runs router/serve/app.py's application (replacing
  nothing: delete the previous app first) and waits until every engine replica
  runs and the endpoint answers; ``apply(app_args, name, num_replicas=)`` does the
  same the way ``serve deploy`` does, and called again with another replica count
  scales the running app (the other replicas keep running, their caches warm);
  ``delete(name)`` removes it (its replicas, and so their KV caches, go away with it).
* :func:`in_flight_by_replica`: from the streaming client's records
  (loadtest/harness/client.py), how many requests each replica had in flight
  over time (exact sweep of the [sent, ended] intervals, attributed to the
  replica the response named): peak and time-weighted mean.
* :func:`replica_counters` / :func:`scrape_metrics`: counters per replica out of
  a Prometheus exposition (the ingress's /metrics labels each engine replica's
  samples with ``replica``; a single replica's /metrics has no such label).
* :func:`wait_for_router`: wait until the ingress routes over every replica.

Imports httpx, prometheus_client and (in LocalServeCluster only) Ray Serve and
router/serve/app.py; never torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.loadtest.harness.client import RequestRecord, auth_headers

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
# Samples without a ``replica`` label (a lone replica's own /metrics) are filed under this name.
UNLABELLED = "(endpoint)"
# router/serve/app.py's builder, as ``serve deploy`` imports it, and its engine deployment's name.
APP_IMPORT_PATH = "prefixserve.router.serve.app:build_app"
ENGINE_DEPLOYMENT = "Engine"
# Requests and streams are small: the object store only needs Ray's minimum and some slack.
OBJECT_STORE_BYTES = 256 * 1024**2


# --------------------------------------------------------------------------- metrics


def replica_counters(
    text: str, names: Sequence[str] = (QUERIES, HITS, PREEMPTIONS), label: str = "replica"
) -> dict[str, dict[str, float]]:
    """``{replica: {sample name: value summed over its other labels}}`` for the samples in ``names``.

    A replica that exposes none of ``names`` is absent; one that exposes some
    has 0.0 for the others.
    """
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in names:
                continue
            counters = out.setdefault(sample.labels.get(label, UNLABELLED), dict.fromkeys(names, 0.0))
            counters[sample.name] += sample.value
    return out


def counter_deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Per replica, ``after - before`` (a replica absent before started from zero)."""
    out = {}
    for replica, values in after.items():
        prior = before.get(replica, {})
        out[replica] = {name: value - prior.get(name, 0.0) for name, value in values.items()}
    return out


def scrape_metrics(base_url: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> str:
    """The text of ``{base_url}/metrics``."""
    response = httpx.get(f"{base_url}/metrics", headers=auth_headers(api_key), timeout=timeout_s)
    response.raise_for_status()
    return response.text


def served_model(base_url: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> str:
    """The model id the endpoint serves (the first entry of /v1/models)."""
    response = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=timeout_s)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def wait_for_router(base_url: str, num_replicas: int, *, timeout_s: float = 120.0, api_key: str | None = None) -> None:
    """Wait until the ingress's engine handle routes over ``num_replicas`` replicas.

    Serve reports replicas running a moment before the ingress's handle hears
    of them, and a load started in between would be routed over the few it
    knows. The ingress's /metrics broadcasts to exactly the replicas its
    handle's request router holds, whatever the router class, so the number
    of replicas in it is the router's view.
    """
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        try:
            seen = len(replica_counters(scrape_metrics(base_url, api_key=api_key)))
        except httpx.HTTPError:
            seen = 0
        if seen == num_replicas:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the ingress's router knew {seen} engine replicas, not {num_replicas}, after {timeout_s}s"
            )
        time.sleep(0.25)


# --------------------------------------------------------------------------- load per replica


@dataclass(frozen=True)
class InFlight:
    """Requests one replica had in flight: the most at any instant, and the time-weighted mean."""

    peak: int
    mean: float
    requests: int


def in_flight_by_replica(records: Sequence[RequestRecord]) -> dict[str, InFlight]:
    """In-flight load per replica from the records' [sent, ended] intervals and replica names.

    The mean is over the whole run's window (first send to last end), so a
    replica that idles half the run shows half its busy load. Records without a
    replica (refused before any replica took them) count for no replica.
    """
    if not records:
        return {}
    start = min(r.sent_s for r in records)
    window = max(r.ended_s for r in records) - start
    events: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        if r.replica is None:
            continue
        # An end sorts before a start at the same instant: back-to-back requests never overlap.
        events.setdefault(r.replica, []).extend([(r.sent_s, 1), (r.ended_s, -1)])
    out = {}
    for replica, evs in events.items():
        evs.sort(key=lambda e: (e[0], e[1]))
        level = peak = 0
        area = 0.0
        last = start
        for t, step in evs:
            area += level * (t - last)
            last = t
            level += step
            peak = max(peak, level)
        out[replica] = InFlight(peak=peak, mean=area / window if window > 0 else float(peak), requests=len(evs) // 2)
    return out


# --------------------------------------------------------------------------- a local cluster


class LocalServeCluster:
    """A local Ray instance with Serve's HTTP proxy on ``port``, hosting prefixserve apps one at a time.

    ``num_cpus`` is Ray's logical CPU count: give each engine replica its
    ``ray_actor_options.num_cpus`` and keep one spare for helper actors (Ray
    Serve LLM's prefix-tree actor asks for one CPU to be placed).
    """

    def __init__(self, num_cpus: int, port: int = 8000, host: str = "127.0.0.1") -> None:
        import ray
        from ray import serve

        # Replicas inherit this process's environment: no model hub at run time.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # address="local": always a new instance, never another Ray found running on this machine.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
        # Serve's driver-side INFO lines (deploying, deleting) would break the progress bars.
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        try:
            serve.start(http_options={"host": host, "port": port})
        except BaseException:
            ray.shutdown()
            raise
        self.host, self.port = host, port
        self.base_url = f"http://{host}:{port}"

    def deploy(
        self,
        app_args: dict[str, Any],
        name: str,
        *,
        num_replicas: int,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> str:
        """Run router/serve/app.py's app built from ``app_args`` as ``name`` at route "/"; returns the base URL.

        Returns once ``num_replicas`` engine replicas run, /v1/models answers
        and the ingress's router routes over all of them. ``api_key``: one of the
        app's ``ingress.api_keys``, for those readiness probes, when it has any.
        """
        from ray import serve

        from prefixserve.router.serve.app import build_app

        serve.run(build_app(app_args), name=name, route_prefix="/", blocking=False)
        return self._wait_serving(name, num_replicas, timeout_s, api_key)

    def apply(
        self,
        app_args: dict[str, Any],
        name: str,
        *,
        num_replicas: int,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> str:
        """Deploy router/serve/app.py's app as ``serve deploy`` does, ``num_replicas`` engine replicas.

        Declarative: the controller imports the app's builder with ``app_args``, and the
        replica count is Serve's per-deployment override, outside the args. Called again
        with the same ``app_args`` and another count, it scales the running app: Serve
        adds or stops engine replicas and leaves the others running, caches warm.
        Returns, as :meth:`deploy` does, once exactly ``num_replicas`` engine replicas
        run (none starting or stopping) and the ingress's router routes over them.
        An app deployed this way cannot be updated by :meth:`deploy`: delete it first.
        """
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        config = {
            "http_options": {"host": self.host, "port": self.port},
            "applications": [
                {
                    "name": name,
                    "route_prefix": "/",
                    "import_path": APP_IMPORT_PATH,
                    "args": app_args,
                    "deployments": [{"name": ENGINE_DEPLOYMENT, "num_replicas": num_replicas}],
                }
            ],
        }
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        return self._wait_serving(name, num_replicas, timeout_s, api_key)

    def _wait_serving(self, name: str, num_replicas: int, timeout_s: float, api_key: str | None) -> str:
        """Wait until ``name`` runs exactly ``num_replicas`` healthy engine replicas and routes over them."""
        from ray import serve

        deadline = time.monotonic() + timeout_s
        last = "no status yet"
        while True:
            app = serve.status().applications.get(name)
            engine = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
            states = {s: n for s, n in engine.replica_states.items() if n} if engine is not None else {}
            if engine is not None and states == {"RUNNING": num_replicas} and engine.status == "HEALTHY":
                try:
                    served_model(self.base_url, api_key=api_key, timeout_s=30)
                    wait_for_router(
                        self.base_url, num_replicas, timeout_s=max(1.0, deadline - time.monotonic()), api_key=api_key
                    )
                    return self.base_url
                except httpx.HTTPError as exc:
                    last = repr(exc)
            elif app is not None:
                last = f"app {app.status}: {app.message or ''} engine {engine.status if engine else None} {states}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the app {name!r} was not serving {num_replicas} engine replicas within {timeout_s}s: {last}"
                )
            time.sleep(1.0)

    def delete(self, name: str) -> None:
        """Remove the app ``name`` and wait until its replicas are gone."""
        from ray import serve

        serve.delete(name, _blocking=True)

    def shutdown(self) -> None:
        import ray

        from prefixserve.common.serve_shutdown import shutdown_serve

        try:
            shutdown_serve()  # not serve.shutdown(): see common/serve_shutdown.py
        finally:
            ray.shutdown()

    def __enter__(self) -> LocalServeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
