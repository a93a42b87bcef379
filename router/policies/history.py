"""Router-side index of which replica holds which prompt blocks (conversation affinity).

Job: answer, for a request's chained block hashes (design Contract 2: block i's
hash covers blocks 0..i, so a hash names a whole prefix), how many leading
blocks each replica holds. ``placed`` (router/policies/placed.py) sends a request that
continues a conversation to the replica holding the longest cached prefix of its
whole prompt.

Inputs:

* ``record(replica, hashes)``: the router sent a prompt with these block hashes
  to ``replica``; until a later report says otherwise they count as held (the
  replica computes and caches them when it prefills).
* ``report(replica, stored, removed, reset)``: the replica's history events
  (replica/contract/history_events.py: HistoryStored / HistoryRemoved, and a reset
  when its earlier reports cannot be trusted). A removal never undoes what the
  router sent the replica since the report before this one (the replica may not
  have seen that request when it made the report; a request it had seen and not
  finished is never reported removed): those hashes stay held. A reset keeps them
  and nothing else the replica was said to hold.
* ``store(replica, hashes)`` / ``remove(replica, hashes)``: the same, directly.
* ``forget(replica)``: a replica left the cluster or passed its name on: nothing
  it was said to hold is trusted any more.

Bound: at most ``max_entries`` hashes, least recently recorded or matched
evicted first; an index at its bound evicts, never grows. Per entry one bytes
key and one int (a bitmask of replica slots): about 200 bytes in CPython. The
hashes sent each replica since its last report (before its first: since it was
first sent one) are kept beside them
(at most ``max_entries`` in all; beyond, later sends are not protected) and
dropped at each report.

Pure Python: no Ray, no HTTP, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Default bound: ~40 MB of index (200k block hashes of 16 tokens: 3.2M tokens of history).
DEFAULT_MAX_ENTRIES = 200_000


class HistoryIndex:
    """Block hash -> the replicas holding it, bounded (least recently used evicted)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._slot: dict[str, int] = {}  # replica name -> its bit
        self._name_of: dict[int, str] = {}  # bit -> replica name
        self._next_bit = 0
        self._free_bits: list[int] = []
        # Replica -> hashes sent since its last report (or ever, before its first), in order; their count.
        self._sent: dict[str, dict[bytes, None]] = {}
        self._sent_total = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bit(self, replica: str) -> int:
        """The replica's bitmask (a slot is assigned at first sight)."""
        b = self._slot.get(replica)
        if b is None:
            if self._free_bits:
                b = self._free_bits.pop()
            else:
                b = self._next_bit
                self._next_bit += 1
            b = self._slot[replica] = 1 << b
            self._name_of[b] = replica
        return b

    def record(self, replica: str, hashes: Sequence[bytes]) -> None:
        """``replica`` was sent these blocks: count them as held (and keep them so until its next report).

        A chain's leading blocks become the most recently used (walked last), so
        eviction takes a prompt's tail before the prefix every later turn needs.
        """
        sent = self._sent.setdefault(replica, {})
        if self._sent_total + len(hashes) <= self.max_entries:
            before = len(sent)
            sent.update(dict.fromkeys(hashes))
            self._sent_total += len(sent) - before
        self.store(replica, hashes)

    def store(self, replica: str, hashes: Sequence[bytes]) -> None:
        """``replica`` holds these blocks (a HistoryStored event, or ``record``'s send)."""
        b = self.bit(replica)
        entries = self._entries
        get, move = entries.get, entries.move_to_end
        for h in reversed(hashes):
            m = get(h)
            if m is None:
                entries[h] = b
            else:
                entries[h] = m | b
                move(h)
        over = len(entries) - self.max_entries
        if over > 0:
            pop = entries.popitem
            for _ in range(over):
                pop(last=False)
            self.evictions += over

    def report(self, replica: str, stored: Sequence[bytes], removed: Iterable[bytes], reset: bool = False) -> None:
        """Apply one report of ``replica``'s history events (the module docstring)."""
        sent = self._sent.pop(replica, {})
        self._sent_total -= len(sent)
        if reset:
            self.forget(replica)
        elif sent:
            self.remove(replica, (h for h in removed if h not in sent))
        else:
            self.remove(replica, removed)
        if stored:
            self.store(replica, stored)
        if reset and sent:
            self.store(replica, list(sent))

    def remove(self, replica: str, hashes: Iterable[bytes]) -> None:
        """``replica`` no longer holds these blocks (a HistoryRemoved event)."""
        b = self._slot.get(replica)
        if b is None:
            return
        entries = self._entries
        for h in hashes:
            m = entries.get(h)
            if m is not None and m & b:
                m &= ~b
                if m:
                    entries[h] = m
                else:
                    del entries[h]

    def forget(self, replica: str) -> None:
        """Drop everything ``replica`` was said to hold (left, or its reports cannot be trusted).

        O(entries): every entry is scrubbed of the replica's bit before the bit is reused.
        """
        self._sent_total -= len(self._sent.pop(replica, {}))
        b = self._slot.pop(replica, None)
        if b is None:
            return
        del self._name_of[b]
        entries = self._entries
        for h in [h for h, m in entries.items() if m & b]:
            m = entries[h] & ~b
            if m:
                entries[h] = m
            else:
                del entries[h]
        self._free_bits.append(b.bit_length() - 1)

    def held(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per replica holding block 0, the number of leading blocks of ``hashes`` it holds.

        Walks the chain once, stopping where no replica holds the next block;
        the blocks walked are refreshed (recently used, the leading ones last).
        """
        entries = self._entries
        get, move = entries.get, entries.move_to_end
        alive = -1  # replicas still matching
        lengths: dict[int, int] = {}
        n = 0
        for n, h in enumerate(hashes):
            m = get(h)
            if m is None:
                m = 0
            now = alive & m
            dropped = alive & ~now if alive != -1 else 0
            if dropped:
                for bit in _bits(dropped):
                    lengths[bit] = n
            if not now:
                alive = 0
                break
            alive = now
        else:
            n = len(hashes)
        for i in range(n - 1, -1, -1):
            move(hashes[i])
        if alive and alive != -1:
            for bit in _bits(alive):
                lengths[bit] = n
        names = self._name_of
        return {names[b]: length for b, length in lengths.items() if b in names and length > 0}


def _bits(mask: int) -> Iterable[int]:
    """The set bits of ``mask``, each as its own mask."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low
