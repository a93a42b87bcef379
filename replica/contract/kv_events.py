"""KV events for routers: which routing keys' prefix blocks this replica holds (lossy-safe).

Job: let a router know, per routing key (Contract 1), whether an engine replica
still holds that key's prefix blocks, in vLLM's event vocabulary (``BlockStored``
/ ``BlockRemoved`` with Contract-2 block hashes), without a hook inside the
block pool. The engine host remembers, per routing key, the block hashes of the
key's static prefix (``remember``, from requests carrying ``routing_key``); at
publish time (``publish``, called with the pool's membership test) it diffs which
of those hashes are in the pool against the last publish and emits what changed.

The static prefix of a key: the longest common run of leading full-block hashes
of the requests seen with that key (the first request's whole prompt, narrowed
by every later one), at most ``max_blocks_per_key`` blocks. A key's ``held``
summary is ``[leading, total]``: how many of its prefix blocks, from block 0 on,
the pool holds (what a request of the key would hit) and how many it has.

Payload of ``publish`` (JSON-serializable; carried in the Serve deployment's
routing stats, replica/entrypoints/serve/deployment.py)::

    {"format": 1, "epoch": "<random per publisher>", "seq": 7, "snapshot": false,
     "events": [{"type": "BlockStored", "key": "1f..", "block_hashes": ["ab..", ...]},
                {"type": "BlockRemoved", "key": "1f..", "block_hashes": [...]}],
     "held": {"1f..": [leading, total], ...}}

* ``seq`` counts publishes from 1; ``epoch`` changes when the publisher is new.
* Diff payloads carry ``held`` for the keys whose presence changed since the
  previous publish; a snapshot (``snapshot: true``) carries ``held`` for every
  key it tracks and no events. Snapshots go out on the first publish, every
  ``snapshot_every`` publishes, and when a diff would exceed ``max_events``
  block hashes (overflow: the events are dropped, the snapshot replaces them).
* Lossy-safe: every ``held`` summary is absolute (the key's state at that
  publish), so a consumer that sees a gap in ``seq`` (reports it never saw:
  Serve hands a router only each replica's latest routing stats) still applies
  the diff after it, for the keys it lists; a key only the missed payloads
  changed keeps its last known state until the next snapshot restates every
  key. A diff from a publisher the consumer has no snapshot of (a new
  ``epoch``: a restarted replica) is ignored until its next snapshot
  (router/serve/request_router.py).
* A key the publisher forgets (more than ``max_keys``, least recently seen
  first) is absent from the next snapshot.

Pure Python: no Ray, no torch. The caller passes hashes and a membership test
(the pool's ``hash_to_block.__contains__``; a dict lookup is atomic under the
GIL, so the engine thread may run meanwhile).
"""

from __future__ import annotations

import sys
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

KV_EVENTS_FORMAT = 1
BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"


@dataclass
class _KeyState:
    hashes: list[bytes]
    present: list[bool] = field(default_factory=list)  # as of the last publish ([] before the first)


def leading_held(present: Sequence[bool]) -> int:
    """How many blocks from block 0 on are present (a request hits exactly those)."""
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def holds_prefix(leading: int, total: int) -> bool:
    """The router's reading of a ``held`` summary: at least half of the key's prefix, from block 0, is held."""
    return leading > 0 and 2 * leading >= total


class KVEventPublisher:
    """Remembers keys' prefix hashes and publishes bounded, lossy-safe diffs of their presence."""

    def __init__(
        self, max_keys: int = 512, max_blocks_per_key: int = 32, max_events: int = 2048, snapshot_every: int = 10
    ) -> None:
        for name, v in (
            ("max_keys", max_keys),
            ("max_blocks_per_key", max_blocks_per_key),
            ("max_events", max_events),
            ("snapshot_every", snapshot_every),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.max_keys = max_keys
        self.max_blocks_per_key = max_blocks_per_key
        self.max_events = max_events
        self.snapshot_every = snapshot_every
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()
        self._forgotten = False  # a key was dropped since the last snapshot

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the remembered keys and hashes: at most ``max_keys`` keys (routing keys
        are short, a client's X-Prefix-Hash at most router/contracts/prefix.py's max_header_len) of at most
        ``max_blocks_per_key`` hashes each, so bounded in bytes too."""
        total = 0
        for key, state in list(self._keys.items()):
            total += sys.getsizeof(key) + 200 + sum(sys.getsizeof(h) + 8 for h in state.hashes) + 8 * len(state.present)
        return total

    def prefix_blocks(self, key: str) -> int | None:
        """How many blocks ``remember`` still hashes for ``key`` (None: a new key, up to the cap)."""
        state = self._keys.get(key)
        return None if state is None else len(state.hashes)

    def prefix(self, key: str) -> list[bytes]:
        """The key's remembered prefix hashes (empty when unknown)."""
        state = self._keys.get(key)
        return [] if state is None else list(state.hashes)

    def remember(self, key: str, hashes: Sequence[bytes]) -> None:
        """Record a request of ``key`` whose prompt's leading full-block hashes are ``hashes``."""
        hashes = list(hashes[: self.max_blocks_per_key])
        state = self._keys.get(key)
        if state is None:
            if not hashes:
                return
            self._keys[key] = _KeyState(hashes)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
                self._forgotten = True
            return
        self._keys.move_to_end(key)
        n = 0
        for a, b in zip(state.hashes, hashes, strict=False):
            if a != b:
                break
            n += 1
        if n < len(state.hashes):
            del state.hashes[n:]
            del state.present[n:]
            if not state.hashes:
                del self._keys[key]
                self._forgotten = True

    def publish(self, contains: Callable[[bytes], bool]) -> dict[str, Any]:
        """The next payload (see the module docstring); ``contains(hash)``: is that block in the pool now."""
        self.seq += 1
        snapshot = self.seq == 1 or self.seq % self.snapshot_every == 0 or self._forgotten
        events: list[dict[str, Any]] = []
        held: dict[str, list[int]] = {}
        num_hashes = 0
        for key, state in self._keys.items():
            now = [contains(h) for h in state.hashes]
            before = state.present + [False] * (len(now) - len(state.present))
            stored = [h.hex() for h, a, b in zip(state.hashes, before, now, strict=True) if b and not a]
            removed = [h.hex() for h, a, b in zip(state.hashes, before, now, strict=True) if a and not b]
            changed = bool(stored or removed) or not state.present
            state.present = now
            if snapshot or changed:
                held[key] = [leading_held(now), len(now)]
            if not snapshot:
                num_hashes += len(stored) + len(removed)
                if stored:
                    events.append({"type": BLOCK_STORED, "key": key, "block_hashes": stored})
                if removed:
                    events.append({"type": BLOCK_REMOVED, "key": key, "block_hashes": removed})
        if not snapshot and num_hashes > self.max_events:
            # Overflow: drop the events, send every key's summary instead.
            snapshot = True
            events = []
            held = {key: [leading_held(s.present), len(s.present)] for key, s in self._keys.items()}
        if snapshot:
            self._forgotten = False
        return {
            "format": KV_EVENTS_FORMAT,
            "epoch": self.epoch,
            "seq": self.seq,
            "snapshot": snapshot,
            "events": events,
            "held": held,
        }


class KVEventConsumer:
    """A router's side: per publisher (replica), apply each payload newer than the last one applied.

    ``apply(replica, payload)`` returns the ``(key, holds)`` facts the payload
    establishes (``holds_prefix`` of each ``held`` summary), in payload order,
    or [] when the payload must be ignored (not newer, a diff of a publisher
    epoch never snapshotted, or an unknown format). A diff after a gap in
    ``seq`` is applied (its summaries are absolute) and counted in ``gaps``. A
    snapshot also yields ``(key, False)`` for keys this consumer knew held on
    the replica and that the snapshot no longer lists.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int]] = {}  # replica -> (epoch, seq) applied
        self._held: dict[str, set[str]] = {}  # replica -> keys known held there
        self.gaps = 0  # diffs applied after missed payloads

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
        self._held.pop(replica, None)

    def held(self) -> dict[str, list[str]]:
        """Per key, the replicas known to hold its prefix (sorted)."""
        out: dict[str, list[str]] = {}
        for replica, keys in sorted(self._held.items()):
            for key in keys:
                out.setdefault(key, []).append(replica)
        return out

    def in_sync(self, replica: str) -> bool:
        return replica in self._last

    def apply(self, replica: str, payload: Any) -> list[tuple[str, bool]]:
        if not isinstance(payload, dict) or payload.get("format") != KV_EVENTS_FORMAT:
            return []
        epoch, seq = str(payload.get("epoch")), int(payload.get("seq", 0))
        last = self._last.get(replica)
        if last is not None and last[0] == epoch and seq <= last[1]:
            return []  # already applied (the same routing stats seen again)
        snapshot = bool(payload.get("snapshot"))
        if not snapshot:
            if last is None or last[0] != epoch:
                return []  # no snapshot of this publisher yet: wait for one
            if seq != last[1] + 1:
                self.gaps += 1  # missed payloads: their keys keep their last known state
        self._last[replica] = (epoch, seq)
        known = self._held.setdefault(replica, set())
        facts: list[tuple[str, bool]] = []
        held = payload.get("held") or {}
        for key, summary in held.items():
            leading, total = int(summary[0]), int(summary[1])
            holds = holds_prefix(leading, total)
            facts.append((str(key), holds))
            if holds:
                known.add(str(key))
            else:
                known.discard(str(key))
        if snapshot:
            for key in sorted(known - set(held)):
                facts.append((key, False))
                known.discard(key)
        return facts
