"""A server process a test starts: its log file, a readiness poll, and a stop that always reaps it.

:class:`ManagedProcess` is the lifecycle both real-process helpers share
(``prefixserve replica`` in server_helpers.py, Prometheus in prometheus_helpers.py):
entering starts the command in its own session with output to a log file and
polls ``ready_url`` until it answers 200 (or the process exits, or the deadline
passes: then the log tail is in the error); leaving sends SIGTERM, then SIGKILL,
so that no process outlives the test.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


class ManagedProcess:
    """``command`` as a context-managed child process; ready when ``ready_url`` answers 200."""

    name = "process"

    def __init__(
        self,
        command: Sequence[str],
        *,
        log_path: Path,
        ready_url: str,
        startup_timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.ready_url = ready_url
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ManagedProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.ready_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise RuntimeError(f"{self.name} not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()
