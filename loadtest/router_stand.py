"""The stand a router benchmark runs on: prefixserve replicas and one router in front of them.

Job: bring up, as child processes on 127.0.0.1, a fresh set of ``prefixserve replica``
servers (cold KV caches) and any of the routers under test in front of them, wait
until the router sees every replica healthy, and always stop both.

Routers (:class:`RouterSpec`, written ``KIND[:POLICY]``):

* ``smg:POLICY``, ``vllm-router:POLICY``: the real peer routers from PyPI
  (loadtest/peer_routers.py), unmodified;
* ``nginx``: nginx's ``hash $http_x_prefix_hash consistent`` upstream as
  ``prefixserve nginx-config`` renders it (router/nginx/config.py); its client sends
  ``X-Prefix-Hash`` (router/routing_key.py);
* ``prefixserve:POLICY``: prefixserve's standalone router (``prefixserve router``).

In front of vLLM servers (loadtest/vllm_stand.py) an :class:`EventFeed` hands the servers' KV
event sockets to the routers that read them: vllm-router's ``kv_aware`` and prefixserve's
``placed`` (``--kv-events``, hashing prompts as vLLM does).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from prefixserve.loadtest.harness.server import (
    HOST,
    core_sets,
    free_port,
    running_server,
    server_env,
    start_server,
    stop_server,
    wait_until_answers,
)
from prefixserve.loadtest.peer_routers import (
    PEER_ROUTERS,
    SMG,
    SMG_POLICIES,
    VLLM_ROUTER,
    VLLM_ROUTER_EVENT_POLICIES,
    VLLM_ROUTER_POLICIES,
    PeerRouterVenv,
    smg_command,
    vllm_router_command,
)
from prefixserve.router.nginx.config import write_prefix_config
from prefixserve.router.policies import POLICIES
from prefixserve.router.ring import RingServer

NGINX = "nginx"
PREFIXSERVE = "prefixserve"
# prefixserve's Ray Serve cluster (router/serve/app.py) over its own engine replicas: not a router
# process in front of the stand's replicas (bench_routers deploys it with the same engine settings).
RAY_CLUSTER = "ray"
ROUTER_POLICIES: dict[str, tuple[str, ...]] = {
    SMG: SMG_POLICIES,
    VLLM_ROUTER: VLLM_ROUTER_POLICIES + VLLM_ROUTER_EVENT_POLICIES,
    NGINX: (),
    PREFIXSERVE: tuple(sorted(POLICIES)),
    RAY_CLUSTER: tuple(sorted(POLICIES)),
}
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


@dataclass(frozen=True)
class RouterSpec:
    """One router under test: its kind and, for all but nginx, its policy."""

    kind: str
    policy: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_POLICIES:
            raise ValueError(f"unknown router {self.kind!r}; choose from {sorted(ROUTER_POLICIES)}")
        policies = ROUTER_POLICIES[self.kind]
        if policies and self.policy not in policies:
            raise ValueError(f"{self.kind} needs a policy from {policies} (write {self.kind}:POLICY)")
        if not policies and self.policy is not None:
            raise ValueError(f"{self.kind} takes no policy")

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        kind, _, policy = text.strip().partition(":")
        return cls(kind, policy or None)

    @property
    def name(self) -> str:
        return self.kind if self.policy is None else f"{self.kind}:{self.policy}"

    @property
    def sends_prefix_hash(self) -> bool:
        """Whether the client computes the routing key (nginx cannot read a body)."""
        return self.kind == NGINX


@dataclass(frozen=True)
class ReplicaSettings:
    """How each replica of the stand runs (the engine flags the benchmark sets)."""

    model: str
    num_kv_blocks: int
    block_size: int
    seed: int = 0
    extra_args: tuple[str, ...] = ()  # more ``prefixserve replica`` flags (LoRA adapters)


def prefixserve_command() -> list[str]:
    """This environment's ``prefixserve`` entry point."""
    script = Path(sys.executable).parent / "prefixserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prefixserve.router.cli"]


def find_nginx() -> str | None:
    return shutil.which(NGINX) or next((p for p in NGINX_CANDIDATES if Path(p).exists()), None)


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextmanager
def running_replicas(settings: ReplicaSettings, count: int, work_dir: Path, timeout_s: float) -> Iterator[list[str]]:
    """``count`` fresh replicas started together (their start is the stand's slowest step); yields their URLs.

    Each runs on cores of its own, one torch thread a core (as a Ray replica of ``num_cpus`` n
    runs n threads), so that the stand models replicas on machines of their own: two replicas
    sharing every core slow each other's steps, which would charge a router for keeping both busy.
    """
    ports = _distinct_ports(count)
    cores = core_sets(count)
    procs = []
    try:
        for i, port in enumerate(ports):
            command = [
                *prefixserve_command(),
                "replica",
                "--model",
                settings.model,
                "--host",
                HOST,
                "--port",
                str(port),
                "--num-kv-blocks",
                str(settings.num_kv_blocks),
                "--block-size",
                str(settings.block_size),
                "--seed",
                str(settings.seed),
                "--log-level",
                "warning",
                *settings.extra_args,
            ]
            env, own_cores = server_env(), None
            if cores is not None:
                own_cores = cores[i]
                env["OMP_NUM_THREADS"] = str(len(own_cores))
            log = work_dir / f"replica-{port}.log"
            procs.append((start_server(command, log, env, cores=own_cores), port))
        for proc, port in procs:
            wait_until_answers(proc, f"http://{HOST}:{port}/health", timeout_s, work_dir / f"replica-{port}.log")
        yield [f"http://{HOST}:{port}" for port in ports]
    finally:
        for proc, _ in procs:
            stop_server(proc)


@dataclass(frozen=True)
class EventFeed:
    """The replicas' KV event sockets and how their blocks are named (vLLM servers)."""

    sources: tuple[tuple[str, str, str], ...]  # (replica URL, PUB endpoint, replay endpoint)
    block_size: int
    hash_seed: str
    tokenizer: Path  # the servers' tokenizer folder: the router hashes the token ids they will see
    model: str  # the name the servers serve

    def prefixserve_args(self) -> list[str]:
        args = ["--tokenizer", str(self.tokenizer), "--kv-events-hash", "vllm"]
        args += ["--kv-events-block-size", str(self.block_size), "--kv-events-seed", self.hash_seed]
        for url, endpoint, replay in self.sources:
            args += ["--kv-events", f"{url}={endpoint},{replay}"]
        return args


@dataclass(frozen=True)
class RunningRouter:
    """A router the stand started: where to send requests, and its log."""

    spec: RouterSpec
    base_url: str
    log_path: Path
    metrics_url: str | None = None  # the router's Prometheus endpoint (None: nginx has none)

    def save_metrics(self, path: Path) -> None:
        """The router's metrics text, into ``path`` (nothing for nginx)."""
        if self.metrics_url is not None:
            try:
                path.write_text(httpx.get(self.metrics_url, timeout=10).text)
            except httpx.HTTPError as exc:
                path.write_text(f"# could not scrape {self.metrics_url}: {exc!r}\n")


def _nginx_command(replicas: Sequence[str], port: int, work_dir: Path) -> list[str]:
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError("nginx is not installed (scripts/system-deps.sh)")
    root = (work_dir / "nginx").resolve()  # nginx reads a relative -c under its -p prefix
    conf = write_prefix_config(
        root, f"{HOST}:{port}", replicas=tuple(RingServer(url.removeprefix("http://")) for url in replicas)
    )
    return [nginx, "-p", str(root), "-c", str(conf), "-g", "daemon off;"]


def _command(
    spec: RouterSpec,
    replicas: Sequence[str],
    port: int,
    work_dir: Path,
    venv: PeerRouterVenv | None,
    feed: EventFeed | None = None,
    metrics_port: int = 0,
    log_level: str = "warning",
) -> tuple[list[str], str]:
    """The router's command line and the path that answers 200 once it serves (``log_level``:
    prefixserve's router's; ``debug`` logs each decision)."""
    if spec.kind in PEER_ROUTERS:
        if venv is None:
            raise ValueError(f"{spec.name} needs the peer routers' venv (PeerRouterVenv.ensure)")
        assert spec.policy is not None
        if spec.kind == SMG:
            return smg_command(venv, spec.policy, replicas, HOST, port, metrics_port), "/readiness"
        sources = feed.sources if feed is not None and spec.policy in VLLM_ROUTER_EVENT_POLICIES else ()
        block, model = (feed.block_size, feed.model) if feed is not None else (16, "")
        command = vllm_router_command(venv, spec.policy, replicas, HOST, port, metrics_port, sources, block, model)
        return command, "/readiness"
    if spec.kind == NGINX:
        return _nginx_command(replicas, port, work_dir), "/health"
    assert spec.policy is not None
    command = [*prefixserve_command(), "router", "--host", HOST, "--port", str(port), "--policy", spec.policy]
    for url in replicas:
        command += ["--replica", url]
    if feed is not None and spec.policy == "placed":
        command += feed.prefixserve_args()
    return [*command, "--log-level", log_level], "/health"


def healthy_upstreams(spec: RouterSpec, base_url: str, replicas: int) -> int:
    """How many replicas the router would route to now, by its own report (nginx has none: all)."""
    if spec.kind == NGINX:
        return replicas
    if spec.kind in PEER_ROUTERS:
        return int(httpx.get(f"{base_url}/readiness", timeout=5).json().get("healthy_workers", 0))
    return len(httpx.get(f"{base_url}/health", timeout=5).json().get("admitted", []))


def _wait(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:g} s")
        time.sleep(0.25)


@contextmanager
def running_router(
    spec: RouterSpec,
    replicas: Sequence[str],
    work_dir: Path,
    timeout_s: float,
    venv: PeerRouterVenv | None = None,
    feed: EventFeed | None = None,
    log_level: str = "warning",
) -> Iterator[RunningRouter]:
    """Start ``spec`` in front of ``replicas``; yields once it serves and sees every replica healthy.

    ``feed``: the replicas' KV event sockets, for the routers that read them. ``log_level``:
    prefixserve's router's (its log is kept beside the run's).
    """
    port, metrics_port = free_port(), free_port()
    command, ready_path = _command(spec, replicas, port, work_dir, venv, feed, metrics_port, log_level)
    base = f"http://{HOST}:{port}"
    metrics_url = {NGINX: None, PREFIXSERVE: f"{base}/metrics"}.get(spec.kind, f"http://{HOST}:{metrics_port}/metrics")
    log = work_dir / f"router-{spec.name.replace(':', '-')}.log"
    with running_server(command, server_env(), base + ready_path, log, timeout_s):
        _wait(
            lambda: healthy_upstreams(spec, base, len(replicas)) == len(replicas),
            f"{spec.name} did not see all {len(replicas)} replicas healthy (see {log})",
            timeout_s,
        )
        yield RunningRouter(spec, base, log, metrics_url)
