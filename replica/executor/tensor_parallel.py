"""The driver's side of a tensor-parallel engine: starting, feeding and stopping its workers.

An engine with ``tensor_parallel_size = N > 1`` is N processes. The engine's own process
is rank 0, the driver: it holds the scheduler, the KV block manager and the sampler,
plus its :class:`~prefixserve.replica.worker.model_shard.ModelShard`. :class:`WorkerGroup`
spawns ranks 1..N-1 (replica/executor/tp_worker.py), each pinned to its GPU (CUDA) or to its
share of the cores (CPU), joined in one ``torch.distributed`` group (NCCL on CUDA, gloo
on CPU) whose every collective times out after ``distributed_timeout_s``.

Each step the driver sends every worker one message through its pipe: a flat int64
buffer (an opcode, then :meth:`StepInputs.pack`; replica/executor/tp_protocol.py), written with ``send_bytes``: no
pickling, one write per worker per step. Then every rank runs the same forward pass;
the collectives inside it (row-parallel all-reduces, the LM head's gather) keep the
ranks in lockstep, and only rank 0 receives logits. Swap copies and cache clears are
messages too (no collective: each rank copies its own shard), and so are the disk tier's
reads and copies of each rank's own files (replica/executor/tp_disk.py), whose reads each
worker answers through its pipe.

Failure is loud: a watcher thread waits on the workers' process sentinels, so a worker
that dies (crash, OOM kill, ``kill -9``) marks the group dead at once; the driver's
next or current collective fails (gloo: "connection closed by peer"; otherwise the
timeout), and the step raises :class:`WorkerDiedError`, an ``EngineDeadError``: the
engine stops for good, its health check fails, Serve replaces the replica. Workers
exit on their own when the driver goes away (pipe EOF, or their parent changes), ignore
Ctrl-C (the driver stops them), and :meth:`WorkerGroup.shutdown` asks, then terminates,
then kills: no process outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.errors import EngineDeadError
from prefixserve.replica.executor.tp_protocol import OP_SHUTDOWN
from prefixserve.replica.model.llama import ModelConfig
from prefixserve.replica.model.loader import CheckpointSource
from prefixserve.replica.worker.model_shard import RankMemory

log = logging.getLogger(__name__)

# The seconds a worker may take to start (imports, weights, KV cache) before the engine gives up.
START_TIMEOUT_S = 600.0
# How long a failed step waits for a dying worker's exit to show, to name it in the error.
DEATH_GRACE_S = 2.0
_env_lock = threading.Lock()


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker died or a collective failed: the engine cannot continue."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (pickled once, at spawn)."""

    config: EngineConfig
    model_cfg: ModelConfig
    checkpoint: CheckpointSource  # an already prepared (converted) checkpoint folder
    max_model_len: int
    checkpoint_dtype: torch.dtype | None
    store_port: int
    # Torch threads of each rank on CPU (None: the default share of the cores).
    cpu_threads: list[int | None]


class WorkerGroup:
    """Ranks 1..N-1 of one engine, seen from rank 0 (see the module docstring).

    ``cuda_visible_devices``, when given, pins worker ``r`` to that GPU id (the ids a
    Ray placement group reserved, replica/executor/ray_bundles.py); otherwise rank ``r`` uses
    ``cuda:r`` of the node (CUDA) or ``cpu``.
    """

    def __init__(self, spec: WorkerSpec, size: int, *, cuda_visible_devices: list[str] | None = None) -> None:
        from prefixserve.replica.executor.tp_worker import worker_main

        self.size = size
        self.timeout_s = spec.config.distributed_timeout_s
        self._dead: str | None = None
        self._stopping = False
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(1, size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, rank, size, child_end, os.getpid()),
                    name=f"prefixserve-tp{rank}",
                    daemon=True,
                )
                env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices[rank]} if cuda_visible_devices else {}
                with _environment(env):
                    proc.start()
                child_end.close()
                self.conns.append(parent_end)
                self.procs.append(proc)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="prefixserve-tp-watch", daemon=True)
        self._watcher.start()

    # --- liveness ---------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def death_reason(self) -> str | None:
        return self._dead

    def _watch(self) -> None:
        pending = {p.sentinel: p for p in self.procs}
        while pending and not self._stopping:
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                proc = pending.pop(sentinel)  # type: ignore[call-overload]
                proc.join(1.0)  # collect the exit code
                if not self._stopping:
                    self.mark_dead(
                        f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
                    )

    def mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        log.error("engine is dead: %s", reason)

    def failure(self, exc: BaseException) -> WorkerDiedError:
        """The error a failed tensor-parallel step raises: ranks may be out of step, so the
        group is dead whatever the cause. A collective usually fails because a worker died:
        the error then names that worker (waiting a moment for its exit to be visible),
        else it carries ``exc``."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self._dead is None and time.monotonic() < deadline:
            gone = next((p for p in self.procs if not p.is_alive()), None)
            if gone is not None:
                gone.join(1.0)
                self.mark_dead(f"tensor-parallel worker {gone.name} (pid {gone.pid}) exited with code {gone.exitcode}")
                break
            time.sleep(0.05)
        self.mark_dead(f"a tensor-parallel step failed: {type(exc).__name__}: {exc}")
        return WorkerDiedError(f"the engine is dead: {self._dead}")

    # --- messages ---------------------------------------------------------------

    def send(self, message: torch.Tensor) -> None:
        """Send one int64 message to every worker (raises WorkerDiedError when one is gone)."""
        if self._dead is not None:
            raise WorkerDiedError(f"the engine is dead: {self._dead}")
        payload = memoryview(message.contiguous().numpy()).cast("B")
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:
            raise self.failure(exc) from exc

    def collect(self, what: str) -> list[Any]:
        """One reply from each worker (the start-up hand-shake, the disk tier's answers), watching for
        deaths and start-up errors."""
        replies = []
        deadline = time.monotonic() + max(START_TIMEOUT_S, self.timeout_s)
        for conn, proc in zip(self.conns, self.procs, strict=True):
            while not conn.poll(0.2):
                if not proc.is_alive() or self._dead is not None:
                    raise WorkerDiedError(
                        f"tensor-parallel worker {proc.name} died while {what} (exit code {proc.exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel worker {proc.name} did not finish {what} in time")
            try:
                reply = conn.recv()
            except EOFError as exc:
                raise WorkerDiedError(f"tensor-parallel worker {proc.name} died while {what}") from exc
            if isinstance(reply, BaseException):
                raise reply
            replies.append(reply)
        return replies

    def reply(self, message: Any) -> None:
        """Send every worker one pickled object: the start-up hand-shake's answers, the object that
        follows some disk-tier messages (steps use :meth:`send`)."""
        for conn in self.conns:
            conn.send(message)

    def wait_while(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a call that needs the workers, e.g. joining the group) on a helper
        thread; raise as soon as a worker dies or reports an error instead of waiting out
        the collective's timeout."""
        result: list[Any] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                result.append(fn())
            except BaseException as exc:  # handed to the caller
                error.append(exc)

        thread = threading.Thread(target=target, name=f"prefixserve-tp-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            # Only a worker's exit is a failure here: one that finished its part may already be
            # sending its next hand-shake message, which belongs to a later collect() and must
            # stay unread. A worker that fails sends its error and then exits.
            for conn, proc in zip(self.conns, self.procs, strict=True):
                if not proc.is_alive():
                    reply = conn.recv() if conn.poll() else None
                    if isinstance(reply, BaseException):
                        raise reply
                    raise WorkerDiedError(
                        f"tensor-parallel worker {proc.name} died while {what} (exit code {proc.exitcode})"
                    )
        if error:
            raise error[0]
        return result[0] if result else None

    def log_memory(self, own: RankMemory) -> list[RankMemory]:
        """Log every rank's memory (the workers' reports come from :meth:`collect`); return them by rank."""
        memories = [own, *self.collect("reporting memory")]
        for memory in memories:
            log.info("tensor-parallel rank %d/%d %s", memory.rank, self.size, memory.describe())
        return memories

    # --- stopping ---------------------------------------------------------------

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every worker: ask (OP_SHUTDOWN), then SIGTERM, then SIGKILL; idempotent.
        The group is dead afterwards (``send`` raises)."""
        self._stopping = True
        if self._dead is None:
            self._dead = "the engine was shut down"
        bye = memoryview(torch.tensor([OP_SHUTDOWN], dtype=torch.int64).numpy()).cast("B")
        for conn in self.conns:
            try:
                conn.send_bytes(bye)
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


@contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables around a spawn (the child copies the parent's environment),
    and hide the ``__main__`` module from it.

    A spawned child re-imports the parent's ``__main__`` (by path or module name) before
    running its target. A worker needs nothing from it, and re-running a user's script
    without an ``if __name__ == "__main__"`` guard (or Ray's worker entry point) would
    start engines inside the worker; with ``__spec__`` and ``__file__`` hidden for the
    moment of the spawn, multiprocessing skips that import.
    """
    main = sys.modules["__main__"]
    hidden = {k: main.__dict__.pop(k) for k in ("__spec__", "__file__") if k in main.__dict__}
    with _env_lock:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        if hidden:
            main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.update(hidden)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
