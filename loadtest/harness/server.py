"""A server under test run as a child process: a free port, its start, its readiness, its stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

HOST = "127.0.0.1"  # loopback only: a benchmark's server is never reachable from outside


def free_port() -> int:
    """A TCP port on :data:`HOST` that nothing listens on (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_env() -> dict[str, str]:
    """This process's environment for a server: no hub downloads, no tokenizer threads, unbuffered logs."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def core_sets(count: int) -> list[tuple[int, ...]] | None:
    """This process's cores split into ``count`` disjoint sets of equal size, one per server, so
    that servers modelled as machines of their own do not wait on each other's threads; None when
    there are fewer cores than servers."""
    cores = sorted(os.sched_getaffinity(0))
    per_server = len(cores) // count if count > 0 else 0
    if per_server == 0:
        return None
    return [tuple(cores[i * per_server : (i + 1) * per_server]) for i in range(count)]


def start_server(
    command: Sequence[str],
    log_path: Path,
    env: dict[str, str],
    cwd: Path | None = None,
    cores: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, output to ``log_path``: :func:`stop_server` reaches its
    children. ``cores``: the CPUs it (and every thread and child it starts) may run on."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    if cores is not None:
        # Set before the interpreter has started any thread (it is still loading): threads and
        # children inherit the mask. Not preexec_fn, which is unsafe beside the caller's threads.
        with contextlib.suppress(ProcessLookupError):  # exited already: its waiter reports that
            os.sched_setaffinity(proc.pid, cores)
    return proc


def wait_until_answers(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    """Poll ``url`` until it answers 200; RuntimeError, naming the log, if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            program = proc.args[0] if isinstance(proc.args, list) else "the server"
            raise RuntimeError(f"{program} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from {url} within {timeout_s:g} s; see {log_path}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM the server's whole session, SIGKILL it after ``grace_s``; nothing if it has exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def running_server(
    command: Sequence[str],
    env: dict[str, str],
    ready_url: str,
    log_path: Path,
    timeout_s: float,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (in ``cwd``) until ``ready_url`` answers, yield it, and always stop it and its children."""
    proc = start_server(command, log_path, env, cwd)
    try:
        wait_until_answers(proc, ready_url, timeout_s, log_path)
        yield proc
    finally:
        stop_server(proc)
