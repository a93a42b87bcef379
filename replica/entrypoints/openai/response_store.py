"""The stored answers of ``/v1/responses``: what ``previous_response_id`` continues and GET returns.

Job: keep, per response id, the Response object as it was answered (JSON bytes), the
conversation it ended (the chat messages its input expanded to, without its
``instructions``, followed by its output), its owner and the engine replica that answered
it, within a bound on the entries and one on their bytes.

Invariants:
* At most ``max_entries`` entries and ``max_bytes`` bytes (an entry's size is the length of
  its two JSON texts): storing past either drops the least recently used entries first;
  a lookup (a continuation, a GET) counts as a use. An entry larger than ``max_bytes`` on
  its own is not stored (``put`` says so) and drops nothing.
* An entry is seen only by its owner: a lookup or delete under another owner finds nothing,
  exactly as for an id never stored, so nothing of another owner's response leaks, not even
  that it exists. A ``put`` over another owner's entry of the same id stores nothing.
* Entries are immutable once stored (the bytes are what GET answers).

Pure data and the json module: no HTTP framework, Ray or torch; one event loop uses it, so
no locks.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored answer.

    ``response_json``: the Response object as GET returns it. ``conversation_json``: the chat
    messages (``{"role", "content", "tool_calls"?, "tool_call_id"?}``) a continuation starts
    from. ``owner``: the tenant or API-key digest it belongs to (None: no owner, on a host
    without keys or tenants). ``replica``: the engine replica that answered it, when the
    engine stream named one (a router may send the continuation there).
    """

    response_id: str
    response_json: bytes
    conversation_json: bytes
    owner: str | None = None
    replica: str | None = None

    @classmethod
    def build(
        cls,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        owner: str | None = None,
        replica: str | None = None,
    ) -> StoredResponse:
        """The entry of ``response`` (a Response object's JSON data) and ``conversation``."""
        return cls(response_id, _json(response), _json(conversation), owner, replica)

    @property
    def size(self) -> int:
        """The bytes this entry counts against the store's bound."""
        return len(self.response_json) + len(self.conversation_json)

    def response(self) -> dict[str, Any]:
        """The Response object."""
        data: dict[str, Any] = json.loads(self.response_json)
        return data

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages a continuation of this response starts from."""
        messages: list[dict[str, Any]] = json.loads(self.conversation_json)
        return messages


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass
class ResponseStore:
    """Stored responses by id, least recently used first, bounded by count and bytes."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict, repr=False)
    _bytes: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def entries(self) -> int:
        """How many responses are stored."""
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """The stored entries' sizes together."""
        return self._bytes

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` as the most recently used; False when it is not stored (larger than
        ``max_bytes`` alone, no room at all, or its id held by another owner's entry)."""
        if entry.size > self.max_bytes or self.max_entries == 0:
            return False
        old = self._entries.get(entry.response_id)
        if old is not None:
            if old.owner != entry.owner:
                return False
            self._remove(entry.response_id)
        self._entries[entry.response_id] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """``owner``'s entry of ``response_id``, now the most recently used; None when there is none."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Remove ``owner``'s entry of ``response_id``; False when there is none."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._remove(response_id)
        return True

    def _remove(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size
