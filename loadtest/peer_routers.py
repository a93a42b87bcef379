"""The real peer routers from PyPI, in a virtual environment of their own, and their command lines.

Job: install SGLang's model gateway (``smg``) and vLLM's router (``vllm-router``), both
Rust binaries shipped as Python wheels, at pinned versions into
``cache_root()/peer-routers`` (never into the project's environment: they are
what we measure against, not what we depend on), and build the command that runs
each one, unmodified, in front of a list of OpenAI-compatible workers.

Invariants: an install is reused only when its record names exactly the pinned
packages; every port the routers open (traffic and Prometheus) is on 127.0.0.1
and chosen by the caller, one per run (a Prometheus port still held makes
vllm-router panic).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixserve.common.paths import cache_root

PEER_PACKAGES: tuple[str, ...] = ("smg==1.13.0", "vllm-router==0.1.17")
SMG = "smg"
VLLM_ROUTER = "vllm-router"
PEER_ROUTERS = (SMG, VLLM_ROUTER)
# The policies each router offers that route a plain HTTP worker list (no PD, no KV-event source).
SMG_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "consistent_hashing", "prefix_hash")
VLLM_ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "consistent_hash")
# vllm-router's policy that reads the workers' KV events (vLLM servers' ZMQ publishers).
VLLM_ROUTER_EVENT_POLICIES = ("kv_aware",)
# The file that records what an install holds, one requirement a line.
_RECORD = "installed.txt"


@dataclass(frozen=True)
class PeerRouterVenv:
    """A virtual environment holding the pinned peer routers."""

    root: Path
    packages: tuple[str, ...] = PEER_PACKAGES

    @classmethod
    def default(cls) -> PeerRouterVenv:
        return cls(cache_root() / "peer-routers")

    def binary(self, name: str) -> Path:
        return self.root / "bin" / name

    def installed(self) -> bool:
        """Whether the venv holds exactly the pinned packages and their entry points."""
        record = self.root / _RECORD
        if not record.is_file() or record.read_text().split() != list(self.packages):
            return False
        return all(self.binary(name).exists() for name in PEER_ROUTERS)

    def ensure(self) -> PeerRouterVenv:
        """Create the venv and install the packages unless :meth:`installed`; returns self.

        Uses ``python3.11`` (the interpreter the wheels were checked with), else this one.
        Raises RuntimeError with pip's output when the install fails.
        """
        if self.installed():
            return self
        python = shutil.which("python3.11") or sys.executable
        self.root.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [python, "-m", "venv", str(self.root)],
            [str(self.root / "bin" / "python"), "-m", "pip", "install", "--quiet", *self.packages],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(step)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
                )
        (self.root / _RECORD).write_text("\n".join(self.packages) + "\n")
        return self


def smg_command(
    venv: PeerRouterVenv, policy: str, workers: Sequence[str], host: str, port: int, metrics_port: int
) -> list[str]:
    """``smg launch`` in front of ``workers``.

    ``--disable-tokenizer-autoload``: with no model hub reachable the gateway would
    fail fetching a tokenizer; without one it routes on the request's text.
    """
    if policy not in SMG_POLICIES:
        raise ValueError(f"smg policy must be one of {SMG_POLICIES}, got {policy!r}")
    return [
        str(venv.binary(SMG)),
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--disable-tokenizer-autoload",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]


def vllm_router_command(
    venv: PeerRouterVenv,
    policy: str,
    workers: Sequence[str],
    host: str,
    port: int,
    metrics_port: int,
    event_sources: Sequence[tuple[str, str, str]] = (),
    event_block_size: int = 16,
    event_model: str = "",
) -> list[str]:
    """``vllm-router`` in front of ``workers``.

    ``event_sources``: per worker (its URL, its KV-event PUB endpoint, its replay endpoint),
    which ``kv_aware`` needs and only it reads; ``event_model``: the model the workers serve
    (vllm-router wants one model identity for static event sources).
    """
    policies = VLLM_ROUTER_POLICIES + VLLM_ROUTER_EVENT_POLICIES
    if policy not in policies:
        raise ValueError(f"vllm-router policy must be one of {policies}, got {policy!r}")
    if policy in VLLM_ROUTER_EVENT_POLICIES and not event_sources:
        raise ValueError(f"vllm-router's {policy} needs the workers' KV event sources (vLLM servers)")
    events: list[str] = []
    for url, endpoint, replay in event_sources:
        events += ["--kv-event-source", f"{url}={endpoint}", "--kv-event-replay-source", f"{url}={replay}"]
    if events:
        events += ["--kv-event-block-size", str(event_block_size), "--kv-event-model", event_model]
    return [
        str(venv.binary(VLLM_ROUTER)),
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warning",
        *events,
    ]
