"""Grammar compilation off the engine loop: a fair, bounded worker pool, a time bound, a bounded cache.

``GrammarCache.get`` (blocking, for the offline ``LLM``) and ``get_async`` (for the
front ends' event loops) return the compiled grammar of a constraint, compiling it in a
worker thread at most once per (kind, spec) hash while it stays cached (least recently
used entries leave past ``max_entries``). Concurrent requests for the same spec share
one compile. A compile that does not finish within ``timeout_s`` is refused
(``GrammarTimeoutError``, a 400 at the front ends); its worker finishes in the
background (xgrammar cannot be interrupted) and caches the result.

A constraint can make a compile slow, and a slow compile holds its worker, so no
request may take the pool for itself:

* before anything is queued, ``GrammarLimits`` (limits.py) refuses a constraint that
  asks for more repeats or lengths than allowed (``GrammarLimitError``, 400), which keeps
  any one compile well under a second;
* each client (the API key or address the front end names, ``EngineRequest.client``) may
  have at most ``max_workers_per_client`` compiles running; the next waiting compile of
  another client takes a free worker first (round robin over clients), so one client's
  slow schemas never hold every worker;
* at most ``max_queued`` compiles wait for a worker, ``max_queued_per_client`` of one
  client; past either the request is refused with ``GrammarQueueFullError`` (429 with
  Retry-After) instead of joining an unbounded queue.

The engine loop only ever receives compiled grammars.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.replica.errors import EngineOverloadedError, RequestRejected
from prefixserve.replica.structured_output.backend import Backend, Grammar, GrammarError
from prefixserve.replica.structured_output.limits import GrammarLimitError, GrammarLimits
from prefixserve.replica.structured_output.metrics import StructuredOutputMetrics
from prefixserve.replica.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from prefixserve.replica.config import EngineConfig

# The client of compiles whose caller names none (the offline LLM, internal callers).
ANONYMOUS = ""


class GrammarRejected(RequestRejected):
    """A constraint that cannot be used: invalid, unsupported, or too slow to compile (HTTP 400)."""


class GrammarTimeoutError(GrammarRejected):
    """A constraint that did not compile within the time bound (HTTP 400)."""


class GrammarQueueFullError(EngineOverloadedError):
    """Too many compiles wait already, in all or of this client (HTTP 429 with Retry-After)."""


@dataclass(frozen=True)
class CompilePoolConfig:
    """The compile pool's shape (``EngineConfig.grammar_compile_*``).

    ``max_workers`` threads compile; one client's compiles run on at most
    ``max_workers_per_client`` of them; at most ``max_queued`` compiles wait for a thread,
    ``max_queued_per_client`` of one client.
    """

    max_workers: int = 2
    max_workers_per_client: int = 1
    max_queued: int = 64
    max_queued_per_client: int = 8

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"grammar_compile_workers must be at least 1, got {self.max_workers}")
        if not 1 <= self.max_workers_per_client <= self.max_workers:
            raise ValueError(
                f"grammar_compile_workers_per_client must be in [1, grammar_compile_workers={self.max_workers}], "
                f"got {self.max_workers_per_client}"
            )
        if self.max_queued < 0 or not 0 <= self.max_queued_per_client <= max(self.max_queued, 0):
            raise ValueError(
                "grammar_compile_queue_size must be >= 0 and grammar_compile_queue_per_client in "
                f"[0, grammar_compile_queue_size], got {self.max_queued} and {self.max_queued_per_client}"
            )


@dataclass(eq=False)
class _Job:
    """One compile waiting for, or holding, a worker."""

    params: StructuredOutputsParams
    client: str
    future: concurrent.futures.Future[Grammar]


class GrammarCache:
    """Compiled grammars by (kind, spec) hash, compiled in a fair pool (the module docstring).

    ``backend_factory`` builds the backend on first use (building xgrammar's tokenizer
    info costs ~0.2 s: engines that never see a constraint do not pay it).
    """

    def __init__(
        self,
        backend_factory: Callable[[], Backend],
        *,
        timeout_s: float = 10.0,
        max_entries: int = 256,
        pool: CompilePoolConfig | None = None,
        limits: GrammarLimits | None = None,
        metrics: StructuredOutputMetrics | None = None,
    ) -> None:
        self._factory = backend_factory
        self._backend: Backend | None = None
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.pool = pool or CompilePoolConfig()
        self.limits = limits or GrammarLimits()
        self.metrics = metrics
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._entries: OrderedDict[str, concurrent.futures.Future[Grammar]] = OrderedDict()
        # Waiting compiles per client, in the order clients are served (round robin).
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._queued = 0
        self._running: dict[str, int] = {}
        self._running_total = 0
        self._closed = False
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.pool.max_workers, thread_name_prefix="prefixserve-grammar"
        )

    @classmethod
    def from_config(
        cls,
        backend_factory: Callable[[], Backend],
        config: EngineConfig,
        metrics: StructuredOutputMetrics | None = None,
    ) -> GrammarCache:
        """The engine's cache: its time bound, size, pool and limits from ``config``'s grammar knobs."""
        return cls(
            backend_factory,
            timeout_s=config.grammar_compile_timeout_s,
            max_entries=config.grammar_cache_size,
            pool=CompilePoolConfig(
                max_workers=config.grammar_compile_workers,
                max_workers_per_client=config.grammar_compile_workers_per_client,
                max_queued=config.grammar_compile_queue_size,
                max_queued_per_client=config.grammar_compile_queue_per_client,
            ),
            limits=GrammarLimits(
                max_repeat=config.max_grammar_repeat,
                max_length=config.max_grammar_length,
                max_spec_chars=config.max_grammar_spec_chars,
            ),
            metrics=metrics,
        )

    @property
    def backend(self) -> Backend:
        """The backend (built on first use)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def submit(self, params: StructuredOutputsParams, client: str | None = None) -> concurrent.futures.Future[Grammar]:
        """The future compiled grammar of ``params``: cached, in progress, or queued from now for ``client``.

        Raises GrammarLimitError (400) for a constraint over the limits and GrammarQueueFullError
        (429) when the queue, or this client's share of it, is full.
        """
        key = params.key
        who = client or ANONYMOUS
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
        if future is not None:
            if self.metrics is not None:
                self.metrics.cache_hits.inc()
            return future
        try:
            self.limits.check(params)
        except GrammarLimitError:
            if self.metrics is not None:
                self.metrics.failures["limit"].inc()
            raise
        with self._lock:
            future = self._entries.get(key)
            if future is None:
                future = self._enqueue_locked(params, who)
                self._entries[key] = future
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
                self._dispatch_locked()
                missed = True
            else:
                missed = False
        if self.metrics is not None:
            (self.metrics.cache_misses if missed else self.metrics.cache_hits).inc()
        if missed:
            # A failed compile is not cached: the error is the request's, and a retry compiles again.
            future.add_done_callback(lambda f, k=key: self._forget_failed(k, f))
        return future

    def _enqueue_locked(self, params: StructuredOutputsParams, client: str) -> concurrent.futures.Future[Grammar]:
        if self._closed:
            raise RuntimeError("the grammar cache is closed")
        queue = self._queues.get(client)
        waiting = len(queue) if queue is not None else 0
        # A compile that can start at once does not wait: only waiting ones count against the queue.
        starts_now = (
            self._running_total < self.pool.max_workers
            and self._running.get(client, 0) < self.pool.max_workers_per_client
            and waiting == 0
        )
        if not starts_now:
            if waiting >= self.pool.max_queued_per_client or self._queued >= self.pool.max_queued:
                if self.metrics is not None:
                    self.metrics.failures["overloaded"].inc()
                mine = waiting >= self.pool.max_queued_per_client
                raise GrammarQueueFullError(
                    f"{'this client has' if mine else 'this server has'} {waiting if mine else self._queued} "
                    f"grammars waiting to compile already, the most it queues "
                    f"({'grammar_compile_queue_per_client' if mine else 'grammar_compile_queue_size'}): "
                    "retry later",
                    retry_after_s=max(1.0, self.timeout_s / 2),
                )
        job = _Job(params, client, concurrent.futures.Future())
        self._queues.setdefault(client, deque()).append(job)
        self._queued += 1
        return job.future

    def _next_job_locked(self) -> _Job | None:
        """The first waiting job, in round-robin order of clients, whose client is under its share."""
        for client, queue in self._queues.items():
            if self._running.get(client, 0) >= self.pool.max_workers_per_client:
                continue
            job = queue.popleft()
            self._queued -= 1
            del self._queues[client]
            if queue:
                self._queues[client] = queue  # to the back: the other clients go first
            return job
        return None

    def _dispatch_locked(self) -> None:
        while self._running_total < self.pool.max_workers and not self._closed:
            job = self._next_job_locked()
            if job is None:
                return
            self._running[job.client] = self._running.get(job.client, 0) + 1
            self._running_total += 1
            self._threads.submit(self._run, job)

    def _run(self, job: _Job) -> None:
        try:
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self._compile(job.params))
                except BaseException as exc:  # noqa: BLE001 - the waiting requests' error
                    job.future.set_exception(exc)
        finally:
            with self._lock:
                self._running_total -= 1
                left = self._running[job.client] - 1
                if left:
                    self._running[job.client] = left
                else:
                    del self._running[job.client]
                self._dispatch_locked()

    def _forget_failed(self, key: str, future: concurrent.futures.Future[Grammar]) -> None:
        if not future.cancelled() and future.exception() is None:
            return
        with self._lock:
            if self._entries.get(key) is future:
                del self._entries[key]

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        backend = self.backend
        start = time.perf_counter()
        grammar = backend.compile(params)
        if self.metrics is not None:
            self.metrics.compile_time.observe(time.perf_counter() - start)
        return grammar

    def get(self, params: StructuredOutputsParams, client: str | None = None) -> Grammar:
        """The compiled grammar of ``params``, waiting at most ``timeout_s``; raises GrammarRejected
        (GrammarLimitError included) or GrammarQueueFullError."""
        future = self.submit(params, client)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(params) from None
        except GrammarError as exc:
            raise self._invalid(exc) from None

    async def get_async(self, params: StructuredOutputsParams, client: str | None = None) -> Grammar:
        """``get`` for an event loop: the loop keeps running while the worker compiles."""
        future = asyncio.wrap_future(self.submit(params, client))
        try:
            # Shielded: a timeout here must not cancel the shared compile other requests wait on.
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise self._timed_out(params) from None
        except GrammarError as exc:
            raise self._invalid(exc) from None

    def _timed_out(self, params: StructuredOutputsParams) -> GrammarTimeoutError:
        if self.metrics is not None:
            self.metrics.failures["timeout"].inc()
        return GrammarTimeoutError(
            f"structured_outputs.{params.kind} did not compile within {self.timeout_s:g} s: simplify it"
        )

    def _invalid(self, exc: GrammarError) -> GrammarRejected:
        if self.metrics is not None:
            self.metrics.failures["invalid"].inc()
        return GrammarRejected(str(exc))

    def close(self) -> None:
        """Stop the workers (compiles in progress finish; waiting ones are cancelled, none start)."""
        with self._lock:
            self._closed = True
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._queued = 0
        for job in jobs:
            job.future.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)
