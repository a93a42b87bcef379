"""Grammar compilation off the engine loop: a bounded worker pool, a time bound, a bounded cache.

``GrammarCache.get`` (blocking, for the offline ``LLM``) and ``get_async`` (for the
front ends' event loops) return the compiled grammar of a constraint, compiling it in a
worker thread at most once per (kind, spec) hash while it stays cached (least recently
used entries leave past ``max_entries``). Concurrent requests for the same spec share
one compile. A compile that does not finish within ``timeout_s`` is refused
(``GrammarTimeoutError``, a 400 at the front ends); its worker finishes in the
background (xgrammar cannot be interrupted) and caches the result, and at most
``max_workers`` such compiles run at once, so a flood of slow grammars delays only
other compiles, never the engine loop, which only ever receives compiled grammars.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from prefixserve.replica.errors import RequestRejected
from prefixserve.replica.structured_output.backend import Backend, Grammar, GrammarError
from prefixserve.replica.structured_output.metrics import StructuredOutputMetrics
from prefixserve.replica.structured_output.params import StructuredOutputsParams


class GrammarRejected(RequestRejected):
    """A constraint that cannot be used: invalid, unsupported, or too slow to compile (HTTP 400)."""


class GrammarTimeoutError(GrammarRejected):
    """A constraint that did not compile within the time bound (HTTP 400)."""


class GrammarCache:
    """Compiled grammars by (kind, spec) hash; compiles in ``max_workers`` threads.

    ``backend_factory`` builds the backend on first use (building xgrammar's tokenizer
    info costs ~0.2 s: engines that never see a constraint do not pay it).
    """

    def __init__(
        self,
        backend_factory: Callable[[], Backend],
        *,
        timeout_s: float = 10.0,
        max_entries: int = 256,
        max_workers: int = 2,
        metrics: StructuredOutputMetrics | None = None,
    ) -> None:
        self._factory = backend_factory
        self._backend: Backend | None = None
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, concurrent.futures.Future[Grammar]] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="prefixserve-grammar"
        )

    @property
    def backend(self) -> Backend:
        """The backend (built on first use)."""
        with self._lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[Grammar]:
        """The future compiled grammar of ``params``: cached, in progress, or compiling from now."""
        key = params.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
        if self.metrics is not None:
            (self.metrics.cache_misses if future is None else self.metrics.cache_hits).inc()
        if future is not None:
            return future
        future = self._pool.submit(self._compile, params)
        with self._lock:
            self._entries[key] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        # A failed compile is not cached: the error is the request's, and a retry compiles again.
        future.add_done_callback(lambda f, k=key: self._forget_failed(k, f))
        return future

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

    def get(self, params: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of ``params``, waiting at most ``timeout_s``; raises GrammarRejected."""
        future = self.submit(params)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(params) from None
        except GrammarError as exc:
            raise self._invalid(exc) from None

    async def get_async(self, params: StructuredOutputsParams) -> Grammar:
        """``get`` for an event loop: the loop keeps running while the worker compiles."""
        future = asyncio.wrap_future(self.submit(params))
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
        """Stop the workers (compiles in progress finish; no new ones start)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
