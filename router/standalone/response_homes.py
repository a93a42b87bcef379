"""Which replica holds each stored Response the router relayed (``/v1/responses``).

A replica keeps the Responses it answers in its own store (prefixserve's and vLLM's alike), so a
continuation (``previous_response_id``), a GET or a DELETE of a response must reach the replica
that answered it. The router learns that from the answers it relays: each Response's ``id``
and the replica it came from. Bounded, least recently used first out. A home that is down is
only passed over (its store may come back with it). Pure stdlib.
"""

from __future__ import annotations

from collections import OrderedDict

# Entries kept: a continuation beyond them goes where the routing key sends it.
MAX_ENTRIES = 100_000


class ResponseHomes:
    """Response id -> the replica whose answer carried it, least recently used first out."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._homes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, replica: str) -> None:
        self._homes[response_id] = replica
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        """The replica that answered ``response_id`` (None: not seen, or forgotten)."""
        replica = self._homes.get(response_id)
        if replica is not None:
            self._homes.move_to_end(response_id)
        return replica

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)
