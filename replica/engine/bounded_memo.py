"""A memo bounded by bytes and by entries, least recently used out first, safe across threads.

Job: the one shape of every memo on a replica's request path, so that no
client can grow a replica's memory through one: each entry carries its
caller-estimated size in bytes, the memo evicts least recently used entries
until it is back under both bounds, and refuses an entry larger than a share
of the whole (one huge entry must not flush every other). ``nbytes`` is what a
metric exports.

Pure Python, no dependency. Worker threads (the tokenizer's) read and write it,
so every operation holds a lock.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

V = TypeVar("V")

# Bytes of one entry's bookkeeping: the OrderedDict slot and its link, the (value, size) pair.
ENTRY_OVERHEAD_BYTES = 200
# An entry larger than this share of max_bytes is not stored.
MAX_ENTRY_SHARE = 0.25


def str_bytes(strings: Iterable[object]) -> int:
    """The memory of the strings among ``strings`` (CPython's object size; other objects count 0)."""
    return sum(sys.getsizeof(s) for s in strings if isinstance(s, str))


class BoundedMemo(Generic[V]):
    """``key -> value`` holding at most ``max_entries`` entries and ``max_bytes`` of estimated size."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        if max_bytes < 1 or max_entries < 1:
            raise ValueError(f"max_bytes and max_entries must be positive, got {max_bytes}, {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Estimated bytes held: the entries' sizes plus their bookkeeping."""
        return self._bytes

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                return None
            self._entries.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> bool:
        """Remember ``value`` under ``key`` (``nbytes``: its size and its key's); False when it is too large."""
        size = max(0, int(nbytes)) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes * MAX_ENTRY_SHARE:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
