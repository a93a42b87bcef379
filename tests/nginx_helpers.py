"""Run a real nginx in a private directory for tests, and tiny nginx-served backends.

The nginx runs in the foreground (``daemon off``) as our own child process, with
its pid file, logs and temp paths under a temporary prefix, and is terminated and
reaped on exit: nothing outlives the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prefixserve.router.nginx.config import write_prefix_config
from prefixserve.router.ring import HashRing
from prefixserve.router.routing_key import prefix_hash

NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)


NGINX = find_nginx()
# Tests that run the real nginx binary (CI installs nginx-light: scripts/system-deps.sh).
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/system-deps.sh)")


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free right now (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_private_config(tmp_path: Path, front: int, backends_text: str, **fields: Any) -> Path:
    """``tmp_path / "nginx.conf"``, rendered from an NginxConfig with ``fields`` that listens on
    ``front`` with one worker, keeps its pid file, error log and temp paths under ``tmp_path``, logs
    no access and includes ``backends_text`` (written to ``backends.conf`` there)."""
    (tmp_path / "backends.conf").write_text(backends_text)
    conf = write_prefix_config(tmp_path, f"127.0.0.1:{front}", includes=(str(tmp_path / "backends.conf"),), **fields)
    return conf


# A minimal OpenAI chat completion naming the backend's port in its content.
_CHAT_COMPLETION = (
    '{"id":"chatcmpl-test","object":"chat.completion","created":0,"model":"test",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"port $server_port"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}'
)


def backends_conf(ports: Sequence[int], chat_completion: bool = False) -> str:
    """nginx ``server`` blocks, one per port, each answering with its own port number
    (as plain text, or inside an OpenAI chat-completion body)."""
    if chat_completion:
        answer = f"default_type application/json; return 200 '{_CHAT_COMPLETION}';"
    else:
        answer = 'return 200 "$server_port";'
    return "".join(f"server {{\n    listen 127.0.0.1:{p};\n    location / {{ {answer} }}\n}}\n" for p in ports)


def nginx_test_config(nginx: str, conf: Path, prefix: Path) -> subprocess.CompletedProcess:
    """``nginx -t`` on a config file; the result carries nginx's message on stderr."""
    return subprocess.run([nginx, "-t", "-p", str(prefix), "-c", str(conf)], capture_output=True, text=True, timeout=30)


class NginxProcess:
    """A foreground nginx started from ``conf``; use as a context manager."""

    def __init__(self, nginx: str, conf: Path, prefix: Path, wait_ports: Sequence[int]):
        self.nginx = nginx
        self.conf = conf
        self.prefix = prefix
        self.wait_ports = list(wait_ports)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> NginxProcess:
        checked = nginx_test_config(self.nginx, self.conf, self.prefix)
        if checked.returncode != 0:
            raise RuntimeError(f"nginx -t rejected {self.conf}:\n{checked.stderr}")
        self.proc = subprocess.Popen(
            [self.nginx, "-p", str(self.prefix), "-c", str(self.conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 20
        for port in self.wait_ports:
            while not _accepts(port):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self.proc.stderr.read()}")
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"nginx did not listen on 127.0.0.1:{port}")
                time.sleep(0.02)
        return self

    def worker_pids(self) -> set[int]:
        """The pids of the master's children (its workers), read from /proc."""
        assert self.proc is not None
        master = self.proc.pid
        children = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process exited while we looked
            if int(fields[1]) == master:  # fields after "(comm)": state, ppid, ...
                children.add(int(stat.parent.name))
        return children

    def reload(self, timeout_s: float = 20.0) -> None:
        """``nginx -s reload`` with ``self.conf`` (checked first), returning once only new workers remain."""
        assert self.proc is not None
        checked = nginx_test_config(self.nginx, self.conf, self.prefix)
        if checked.returncode != 0:
            raise RuntimeError(f"nginx -t rejected {self.conf}:\n{checked.stderr}")
        old = self.worker_pids()
        subprocess.run(
            [self.nginx, "-p", str(self.prefix), "-c", str(self.conf), "-s", "reload"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.worker_pids()
            if workers and not workers & old:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode} on reload")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx still runs old workers {sorted(workers & old)} after reload")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown of master and workers
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def keys_owned(ring: HashRing, owner: str, n: int, seed: str = "k") -> list[str]:
    """The first ``n`` routing keys ``prefix_hash(f"{seed}-{i}")`` whose ring owner is ``owner``."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        key = prefix_hash(f"{seed}-{i}")
        if ring.owner(key) == owner:
            out.append(key)
        i += 1
    return out
