"""Helpers for tests on a real multi-node Ray cluster on this machine.

* :class:`LocalRayCluster`: ``ray.cluster_utils.Cluster`` with a CPU-less head
  and worker nodes (each >= 75 MiB object store, as Ray requires), connected
  with ``ray.init``; ``shutdown`` always stops Serve, Ray and every node.
* :func:`cluster_fixture`: a module's ``cluster`` fixture of a given size.
* :func:`deploy`: runs the prefixserve app (router/serve/app.py) with given args on
  the cluster's HTTP port and waits until it answers.
* :func:`chat`: one chat request over real HTTP, returning status, body and
  the replica that served it.
* :func:`engine_replicas`: the live engine replicas' ring names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from prefixserve.router.routing_key import PREFIX_HASH_HEADER

OBJECT_STORE_BYTES = 80 * 1024**2
REPLICA_HEADER = "X-Prefixserve-Replica"
INGRESS_HEADER = "X-Prefixserve-Ingress"
APP_NAME = "prefixserve"


class LocalRayCluster:
    """A head node with no CPUs (nothing is scheduled there) plus ``num_workers`` worker nodes."""

    def __init__(self, num_workers: int = 2, cpus_per_worker: int = 2) -> None:
        import ray
        from ray.cluster_utils import Cluster

        # Replicas of a test must not inherit a GPU or the TRITON interpreter flag's absence.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False},
        )
        try:
            for _ in range(num_workers):
                self.cluster.add_node(num_cpus=cpus_per_worker, object_store_memory=OBJECT_STORE_BYTES)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, log_to_driver=False)
        except BaseException:
            self.cluster.shutdown()
            raise

    def raylet_pids(self) -> set[int]:
        """The process ids of this cluster's raylets (a node's workers are their children)."""
        from ray._private import ray_constants

        return {
            info.process.pid
            for node in self.cluster.list_all_nodes()
            for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, ())
        }

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            try:
                ray.shutdown()
            finally:
                self.cluster.shutdown()


def cluster_fixture(num_workers: int, cpus_per_worker: int = 2) -> Any:
    """A module-scoped ``cluster`` fixture: a LocalRayCluster of this size, shut down after the module."""
    import pytest

    @pytest.fixture(scope="module")
    def cluster() -> Iterator[LocalRayCluster]:
        c = LocalRayCluster(num_workers=num_workers, cpus_per_worker=cpus_per_worker)
        try:
            yield c
        finally:
            c.shutdown()

    return cluster


def deploy_config(
    args: dict[str, Any], port: int, name: str = APP_NAME, deployments: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A ``serve deploy`` config (cluster.yaml's shape) running the app with ``args``.

    ``deployments`` are Serve's per-deployment overrides (e.g. ``[{"name": "Engine",
    "num_replicas": 4}]``).
    """
    app: dict[str, Any] = {
        "name": name,
        "route_prefix": "/",
        "import_path": "prefixserve.router.serve.app:build_app",
        "args": args,
    }
    if deployments:
        app["deployments"] = deployments
    return {
        # One proxy: every node of this cluster shares the machine's ports.
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [app],
    }


def deploy(
    args: dict[str, Any],
    port: int,
    *,
    name: str = APP_NAME,
    deployments: list[dict[str, Any]] | None = None,
    timeout_s: float = 180.0,
    api_key: str | None = None,
) -> str:
    """Deploy the app with ``args`` the way ``serve deploy`` does; returns its base URL.

    Declarative, like ``serve deploy cluster.yaml``: the controller imports
    prefixserve.router.serve.app:build_app. Changing ``args`` rebuilds the app and replaces every
    replica; changing only a ``deployments`` override such as ``num_replicas``
    adds or removes replicas and leaves the others running. ``api_key``: the key the app's
    ``/v1/models`` needs (when the app checks keys).
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(deploy_config(args, port, name, deployments)))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
            response = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
            if response.status_code == 200:
                return base
            last = f"{response.status_code} {response.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefixserve app did not answer on {base} within {timeout_s}s: {last}")
        time.sleep(0.5)


@dataclass
class ChatResult:
    status: int
    body: dict[str, Any]
    replica: str | None
    ingress: str | None

    @property
    def cached_tokens(self) -> int:
        return self.body["usage"]["prompt_tokens_details"]["cached_tokens"]


def chat(
    base: str,
    user: str,
    *,
    system: str | None = None,
    prefix_hash: str | None = None,
    max_tokens: int = 4,
    client: httpx.Client | None = None,
) -> ChatResult:
    """One non-streaming greedy chat completion."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}
    ]
    headers = {PREFIX_HASH_HEADER: prefix_hash} if prefix_hash is not None else {}
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    http = client or httpx.Client(timeout=120)
    try:
        response = http.post(f"{base}/v1/chat/completions", json=body, headers=headers)
    finally:
        if client is None:
            http.close()
    return ChatResult(
        response.status_code,
        response.json(),
        response.headers.get(REPLICA_HEADER),
        response.headers.get(INGRESS_HEADER),
    )


def _broadcast(method: str, app_name: str) -> list[Any]:
    """Each engine replica's answer to ``method`` (an exception for one that failed); none while the
    driver's handle knows no replica yet (just after a deploy: Serve says the deployment is unavailable)."""
    from ray import serve
    from ray.serve.exceptions import DeploymentUnavailableError

    handle = serve.get_deployment_handle("Engine", app_name=app_name)
    try:
        return list(handle.broadcast(method).results(timeout_s=60, return_exceptions=True))
    except DeploymentUnavailableError:
        return []


def engine_replicas(app_name: str = APP_NAME) -> list[str]:
    """Ring names of the engine replicas that answer now."""
    return sorted(n for n in _broadcast("replica_name", app_name) if isinstance(n, str))


def engine_actors(app_name: str = APP_NAME) -> dict[str, str]:
    """Each answering engine replica's ring name -> its actor's name (its full Serve replica id)."""
    return dict(p for p in _broadcast("replica_names", app_name) if isinstance(p, tuple))


def wait_for_replicas(count: int, app_name: str = APP_NAME, timeout_s: float = 180.0) -> list[str]:
    """Wait until exactly ``count`` engine replicas are running; returns their names."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app_name)
        if status is not None:
            engine = status.deployments.get("Engine")
            running = engine.replica_states.get("RUNNING", 0) if engine is not None else 0
            if running == count and engine.status == "HEALTHY":
                names = engine_replicas(app_name)
                if len(names) == count:
                    return names
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} engine replicas were not running within {timeout_s}s")
        time.sleep(0.5)


def ring_members(metrics_text: str) -> dict[str, set[str]]:
    """The replicas each ingress replica's router has on its ring (by ``ingress`` label), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    members: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "prefixserve_router_ring_member" and sample.value == 1:
                members.setdefault(sample.labels["ingress"], set()).add(sample.labels["replica"])
    return members


def wait_for_ring(base: str, members: list[str], num_ingress: int, timeout_s: float = 120.0) -> None:
    """Wait until every ingress replica's router has exactly ``members`` on its ring.

    The controller reports a replica running (or gone) a moment before the
    ingress routers hear of it; tests that check where keys land wait for both.
    """
    deadline = time.monotonic() + timeout_s
    seen: dict[str, set[str]] = {}
    with httpx.Client(timeout=30) as http:
        while True:
            response = http.get(f"{base}/metrics")
            if response.status_code == 200:
                # One scrape names every ingress replica's ring; a sibling that did not answer
                # this time is kept from an earlier scrape.
                seen.update(ring_members(response.text))
            if len(seen) == num_ingress and all(v == set(members) for v in seen.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"ingress routers did not all see {sorted(members)}: {seen}")
            time.sleep(0.2)


def submit_config(config: dict[str, Any]) -> None:
    """Send a whole ``serve deploy`` config (cluster.yaml's shape) to the controller and return at once.

    What ``serve deploy FILE`` asks the controller to do, without waiting for the
    app to build or answer (see :func:`wait_for_app_status`). Apps the config
    does not name are removed.
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    http = config.get("http_options", {})
    serve.start(
        proxy_location=config.get("proxy_location", "HeadOnly"),
        http_options={"host": http.get("host", "127.0.0.1"), "port": http.get("port", 8000)},
    )
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def wait_for_app_status(name: str, statuses: set[str], timeout_s: float = 180.0) -> Any:
    """Wait until application ``name`` is in one of ``statuses``; returns its ``serve.status()`` entry.

    The entry's ``message`` is what ``serve status`` prints for the app (e.g. why it is DEPLOY_FAILED).
    """
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        if app is not None and app.status in statuses:
            return app
        if time.monotonic() > deadline:
            seen = (app.status, app.message) if app is not None else None
            raise TimeoutError(f"app {name!r} was not in {sorted(statuses)} within {timeout_s}s: {seen}")
        time.sleep(0.5)


def replica_processes(cluster: LocalRayCluster, app_name: str = APP_NAME, deployment: str = "Engine") -> list[Any]:
    """This cluster's processes of the app's replicas of ``deployment`` (psutil.Process), by process title.

    Ray titles an actor's worker process ``ray::<actor class>`` (``.<method>`` appended
    while it runs one), and a Serve replica's class is ``ServeReplica:<app>:<deployment>``.
    Only the descendants of ``cluster``'s raylets count: another test process on the
    machine may run its own cluster with an app of the same name.
    """
    import psutil

    title = f"ray::ServeReplica:{app_name}:{deployment}"
    raylets = cluster.raylet_pids()
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if not (cmdline.startswith(title) and cmdline[len(title) : len(title) + 1] in ("", " ", ".")):
            continue
        try:
            if any(parent.pid in raylets for parent in process.parents()):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found
