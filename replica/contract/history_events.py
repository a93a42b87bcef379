"""History events: which of the router's text blocks (conversation history) a replica still holds.

Job: let the router's history index (router/policies/history.py) follow what a replica
really caches. The router names a prompt's history by chained text-block hashes
(replica/contract/prompt_blocks.py), the KV cache by Contract-2 token-block hashes;
the replica computes both for each finished request, keeps a bounded map from each
text block to the token block at its end (``token_blocks_at``), and at every
routing-stats publish reports the text blocks whose token block came or went
(``HistoryTracker.diff``), inside the KV event payload (replica/contract/kv_events.py)::

    "history_events": [{"type": "HistoryStored", "block_hashes": ["ab..", ...]},
                       {"type": "HistoryRemoved", "block_hashes": [...]}],
    "history_reset": true      # only on a publisher's first payload

* Batched and bounded: at most ``max_events`` hashes a payload; changes beyond it wait
  for the next publish (their entries keep their last reported state until then).
* A text block of a request still in flight on the replica is never reported removed
  (``begin`` / ``end``): that request recomputes it. One reported removed before such a
  request arrived is reported again after it (stored, or removed once more).
* The map holds at most ``max_entries`` text blocks, least recently remembered dropped
  first; a dropped block that was reported held is reported removed (the replica could
  no longer say when it goes).
* Periodic restatement: a snapshot payload also restates held blocks, up to the payload's
  bound (``restate``, a rotating window over the map), as HistoryStored, so a router that reset
  what it knew of the replica (a missed payload) learns the rest back within
  ``len / max_events`` snapshots.
* Tiers: a token block in any tier counts as held (a lookup continues there).
* Cost: a publish walks the whole map (one membership test per entry: 2.4 ms at
  16,384 entries on this project's 2-core machine, once per routing-stats period).

Where a text block ends in tokens (``token_blocks_at``): the template renders the
messages with tokens of its own, so the character offset of a text block's end maps to
a token offset by scale, piecewise over the static prefix (whose token count the engine
knows) and the rest; a token-id prompt maps exactly. A block estimated a little early or
late is reported a block early or late: a routing hint, never an answer.

Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

HISTORY_STORED = "HistoryStored"
HISTORY_REMOVED = "HistoryRemoved"
DEFAULT_MAX_ENTRIES = 16_384  # text blocks of ~64 tokens: about 1M tokens of conversations


def token_blocks_at(
    ends: Sequence[int], static_blocks: int, static_tokens: int, prompt_tokens: int, block_size: int
) -> list[int]:
    """Per text block (ending at byte ``ends[i]``), the index of the full token block at its end (-1: none).

    Bytes scale to tokens piecewise: the static prefix's bytes (the first ``static_blocks``
    blocks) onto its ``static_tokens`` tokens, the rest onto the rest of ``prompt_tokens``.
    A block ending in the prompt's partial last token block maps to the last full one.
    """
    full = prompt_tokens // block_size
    if not ends or full == 0:
        return [-1] * len(ends)
    total = ends[-1]
    static_bytes = ends[static_blocks - 1] if 0 < static_blocks <= len(ends) else 0
    if static_bytes == 0 or not 0 < static_tokens < prompt_tokens or static_bytes >= total:
        static_bytes, static_tokens = 0, 0
    out = []
    for e in ends:
        if e <= static_bytes:
            t = e * static_tokens / static_bytes
        else:
            t = static_tokens + (e - static_bytes) * (prompt_tokens - static_tokens) / (total - static_bytes)
        j = -(-int(round(t)) // block_size) - 1  # the block holding token t - 1
        out.append(min(max(j, 0), full - 1))
    return out


class HistoryTracker:
    """The replica's map text block -> token block, and the bounded diffs of which are held."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_events: int = 2048) -> None:
        for name, v in (("max_entries", max_entries), ("max_events", max_events)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.max_entries = max_entries
        self.max_events = max_events
        # text hash -> [token hash, held as last reported (None: to be restated)]
        self._entries: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._dropped: list[bytes] = []  # reported held, then dropped from the map: removals to send
        self._in_flight: dict[bytes, int] = {}  # text hash -> requests in flight that cover it
        self._restate_at = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the map (two 16-byte hashes and a list per entry) and the in-flight counts."""
        per = 2 * (sys.getsizeof(b"\x00" * 16) + 8) + 120
        return per * len(self._entries) + 100 * len(self._in_flight) + 50 * len(self._dropped)

    def begin(self, text_hashes: Iterable[bytes]) -> None:
        """A request covering these text blocks is in flight: none of them is reported removed until ``end``.

        A block already reported removed is reported again once the request is done, stored
        or removed: a router keeps what it sent as held through the report it may have sent
        it after (router/policies/history.py), and this restates what became of it.
        """
        counts, entries = self._in_flight, self._entries
        for h in text_hashes:
            counts[h] = counts.get(h, 0) + 1
            entry = entries.get(h)
            if entry is not None and entry[1] is False:
                entry[1] = None

    def end(self, text_hashes: Iterable[bytes]) -> None:
        """The request ``begin`` named finished or failed."""
        counts = self._in_flight
        for h in text_hashes:
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            else:
                counts.pop(h, None)

    def remember(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        """A finished request's (text block hash, token block hash at its end) pairs."""
        entries = self._entries
        for text, token in pairs:
            entry = entries.get(text)
            if entry is None:
                entries[text] = [token, False]
            else:
                entry[0] = token
                entries.move_to_end(text)
        while len(entries) > self.max_entries:
            text, (_, held) = entries.popitem(last=False)
            if held:
                self._dropped.append(text)

    def diff(self, held: Callable[[bytes], bool]) -> tuple[list[str], list[str]]:
        """The text blocks (hex) whose token block came or went since they were last reported,
        at most ``max_events`` in all; ``held(token_hash)``: is that block cached now."""
        budget = self.max_events
        removed = [h.hex() for h in self._dropped[:budget]]
        del self._dropped[: len(removed)]
        budget -= len(removed)
        stored: list[str] = []
        in_flight = self._in_flight
        for text, entry in self._entries.items():
            if budget <= 0:
                break
            now = held(entry[0])
            if now == entry[1] or (not now and text in in_flight):
                continue
            entry[1] = now
            (stored if now else removed).append(text.hex())
            budget -= 1
        return stored, removed

    def restate(self, limit: int) -> list[str]:
        """Up to ``limit`` blocks reported held (hex), the next window of a rotation over the map."""
        n = len(self._entries)
        if n == 0 or limit <= 0:
            return []
        start = self._restate_at if self._restate_at < n else 0
        out: list[str] = []
        scanned = 0
        for text, entry in islice(self._entries.items(), start, None):
            scanned += 1
            if entry[1]:
                out.append(text.hex())
                if len(out) >= limit:
                    break
        self._restate_at = start + scanned
        return out

    def payload(self, held: Callable[[bytes], bool], first: bool, snapshot: bool) -> dict[str, Any]:
        """The history part of a KV event payload (the module docstring)."""
        stored, removed = self.diff(held)
        if snapshot:
            known = set(stored)
            stored += [h for h in self.restate(self.max_events - len(stored) - len(removed)) if h not in known]
        events = []
        if stored:
            events.append({"type": HISTORY_STORED, "block_hashes": stored})
        if removed:
            events.append({"type": HISTORY_REMOVED, "block_hashes": removed})
        out: dict[str, Any] = {"history_events": events}
        if first:
            out["history_reset"] = True
        return out


@dataclass(frozen=True)
class HistoryReport:
    """What one applied payload says of a replica's history blocks (router/policies/history.py ``report``).

    reset: forget what was known of the replica first (its first payload, a new epoch, or
    payloads missed since the last one applied); stored / removed: text block hashes.
    """

    replica: str
    reset: bool
    stored: list[bytes]
    removed: list[bytes]


def parse_history(replica: str, payload: dict[str, Any], reset: bool) -> HistoryReport | None:
    """The HistoryReport of an accepted payload (None when the replica reports no history); bad hashes skipped."""
    events = payload.get("history_events")
    if not isinstance(events, list):
        return None
    lists: dict[str, list[bytes]] = {HISTORY_STORED: [], HISTORY_REMOVED: []}
    for event in events:
        if not isinstance(event, dict) or event.get("type") not in lists:
            continue
        out = lists[event["type"]]
        for h in event.get("block_hashes") or ():
            try:
                out.append(bytes.fromhex(h))
            except (TypeError, ValueError):
                continue
    return HistoryReport(
        replica, reset or bool(payload.get("history_reset")), lists[HISTORY_STORED], lists[HISTORY_REMOVED]
    )
