"""The one thread that tokenizes prompts and renders chat templates, and the release of its freed memory.

Job: keep the native memory that tokenization leaves behind bounded. A fast
(Rust) tokenizer allocates about 500 bytes per token while it encodes (the
normalized text with its alignments, the pre-tokenized pieces, the encoding's
offsets and token strings), tens of MB for a text prompt near the character
bound, and frees it all before it returns. glibc's malloc keeps such freed
memory in the arena of the thread that used it, and the replica raises glibc's
trim threshold so that the engine's activations stay mapped between steps
(``model_shard.keep_freed_memory_mapped``): every arena keeps its largest
tokenization for good. Worker threads come and go (anyio retires idle ones)
and land on different arenas (up to eight per core), so with a thread per call
the resident size grows in steps of one large tokenization each, for as long
as new arenas are touched.

:class:`TokenizerExecutor` runs every tokenization of a replica on one
long-lived thread (vLLM's front end does the same: ``ThreadPoolExecutor(max_workers=1)``
for its tokenizer), so one arena holds that memory, and after a prompt of at
least ``trim_after_chars`` characters it hands the freed pages back to the OS
with :func:`release_freed_memory` (glibc's ``malloc_trim(0)``, as Cube Store
does after allocation-heavy work). Such prompts are rare (at that size most are
refused as too long), so the trim costs the normal traffic nothing; small
prompts reuse the pages the arena keeps.

Imports no torch and no HTTP framework.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prefixserve.replica.errors import EngineDeadError

log = logging.getLogger(__name__)

T = TypeVar("T")

# A prompt of this many characters costs the tokenizer about 10 MB of transient native memory
# (measured with SmolLM2's tokenizer: ~160 bytes per character of English text), which is what
# is worth giving back; below it the arena's kept pages are simply reused.
TRIM_AFTER_CHARS = 1 << 16

_libc_lock = threading.Lock()
_malloc_trim: Any = None
_looked_up = False


def _trim_function() -> Any:
    """glibc's ``malloc_trim``, or None off glibc; looked up once."""
    global _malloc_trim, _looked_up
    with _libc_lock:
        if not _looked_up:
            _looked_up = True
            name = ctypes.util.find_library("c") or "libc.so.6"
            try:
                trim = ctypes.CDLL(name).malloc_trim
                trim.argtypes = [ctypes.c_size_t]
                trim.restype = ctypes.c_int
                _malloc_trim = trim
            except (OSError, AttributeError):
                _malloc_trim = None
        return _malloc_trim


def release_freed_memory() -> bool:
    """Hand the whole free pages of every malloc arena back to the OS (``malloc_trim(0)``).

    Returns whether glibc released anything; False off glibc (a no-op there).
    Thread-safe; it takes each arena's lock in turn, so call it off the event loop.
    """
    trim = _trim_function()
    return bool(trim(0)) if trim is not None else False


def messages_chars(messages: list[dict[str, Any]] | None) -> int:
    """The characters of a chat's string contents: the size hint for :meth:`TokenizerExecutor.run`."""
    if not messages:
        return 0
    return sum(len(c) for m in messages if isinstance(c := m.get("content"), str))


class TokenizerExecutor:
    """One long-lived thread for tokenization and chat templates; trims after large prompts.

    ``trim_after_chars``: prompts of at least this many characters are followed by
    :func:`release_freed_memory` on the same thread (0 disables the trim).
    """

    def __init__(self, trim_after_chars: int = TRIM_AFTER_CHARS, *, name: str = "prefixserve-tokenizer") -> None:
        if trim_after_chars < 0:
            raise ValueError(f"trim_after_chars must be >= 0, got {trim_after_chars}")
        self.trim_after_chars = trim_after_chars
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Counted on the tokenizer thread only.
        self.num_trims = 0
        self._closed = False

    def _call(self, fn: Callable[[], T], chars: int) -> T:
        try:
            return fn()
        finally:
            # Also after a refusal: the tokenizer's memory was allocated and freed all the same.
            if self.trim_after_chars and chars >= self.trim_after_chars:
                self.num_trims += 1
                released = release_freed_memory()
                log.debug("released freed memory after a prompt of %d characters: %s", chars, released)

    async def run(self, fn: Callable[[], T], *, chars: int) -> T:
        """``fn()`` on the tokenizer thread; ``chars``: the size of the prompt it encodes.

        Raises EngineDeadError once :meth:`shutdown` ran: the engine this thread serves has
        stopped, which front ends answer 503, as every other call on a dead engine.
        """
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, chars)
        except RuntimeError:
            # submit() raced with shutdown(): the pool refuses new calls.
            if self._closed:
                raise EngineDeadError("the engine was shut down") from None
            raise

    def shutdown(self) -> None:
        """Stop the thread once the calls already queued have run."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
