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

KV tiers (additive: a consumer that ignores them reads the payload as above). A publisher
given ``medium_of`` (a block's fastest tier: ``device``, ``host`` or ``disk``, the media of
replica/kv/tiers.py, or None) also tracks each block's medium: every event carries
``"medium"`` (vLLM's ``BlockStored.medium``; absent means ``device``) and a block moving
between tiers is a ``BlockRemoved`` from one medium and a ``BlockStored`` in the other.
``held`` stays the device's. Beside it, for the same keys, ``tiers`` gives
``[device, host, disk, shared]``: the blocks of the key's leading run held in any tier
(from block 0 on) by their fastest medium, and how many leading blocks the shared disk
directory holds (``shared_of``; any replica mounting it can load those). ``disk_group``
names that directory (replicas that report the same one share it).

The consumer weighs a tier block as cheaper than a recompute but dearer than a device hit
(``TierWeights``, ``weighted_blocks``): a key is held when the weighted leading run, with
the group's shared disk run counted for every replica of the group, is at least half the
key's prefix. A change of a group's shared run for a key queues facts for the group's
other replicas (``take_shared_facts``).

History (additive): a publisher given a ``history`` tracker also carries ``history_events``
(``HistoryStored`` / ``HistoryRemoved`` of the router's text-block hashes) and, on its first
payload, ``history_reset`` (replica/contract/history_events.py); the consumer turns each
accepted payload's into a ``HistoryReport`` (``take_history``), a reset when the payload is the
first of its epoch it applies or follows missed ones.

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

from prefixserve.replica.contract.history_events import HistoryReport, HistoryTracker, parse_history

KV_EVENTS_FORMAT = 1
BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
# replica/kv/tiers.py's media (kept as literals: the contract imports nothing of ours).
MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "device", "host", "disk"


@dataclass(frozen=True)
class TierWeights:
    """What a prefix block in each tier is worth to a router against a device hit (1).

    A host block costs a host -> device copy, a disk block a file read and that copy:
    both far cheaper than recomputing it, dearer than a device hit. The defaults are the
    copy costs of docs/benchmarks/tiers.md's restore table against a recompute, rounded
    down to leave the device its edge.
    """

    host: float = 0.9
    disk: float = 0.6

    def __post_init__(self) -> None:
        for name in ("host", "disk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"the {name} tier weight must be a number in [0, 1], got {v!r}")


def weighted_blocks(device: int, host: int, disk: int, shared: int, weights: TierWeights) -> float:
    """A key's leading run in device-block equivalents: its device blocks, its host and disk
    blocks at their weights, and the shared disk run (``shared`` leading blocks any replica of
    the directory can load) where that is worth more."""
    own = device + weights.host * host + weights.disk * disk
    return max(own, weights.disk * shared)


@dataclass
class _KeyState:
    hashes: list[bytes]
    present: list[bool] = field(default_factory=list)  # as of the last publish ([] before the first)
    media: list[str | None] = field(default_factory=list)  # each block's medium at the last publish
    tiers: list[int] = field(default_factory=list)  # the last [device, host, disk, shared] published


def leading_held(present: Sequence[bool]) -> int:
    """How many blocks from block 0 on are present (a request hits exactly those)."""
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def holds_prefix(leading: float, total: int) -> bool:
    """The router's reading of a ``held`` summary: at least half of the key's prefix, from block 0, is held."""
    return leading > 0 and 2 * leading >= total


def tier_summary(media: Sequence[str | None], shared: int) -> list[int]:
    """``[device, host, disk, shared]`` of a key's blocks (the module docstring's ``tiers``)."""
    counts = {MEDIUM_DEVICE: 0, MEDIUM_HOST: 0, MEDIUM_DISK: 0}
    for m in media:
        if m not in counts:
            break
        counts[m] += 1
    return [counts[MEDIUM_DEVICE], counts[MEDIUM_HOST], counts[MEDIUM_DISK], shared]


class KVEventPublisher:
    """Remembers keys' prefix hashes and publishes bounded, lossy-safe diffs of their presence."""

    def __init__(
        self,
        max_keys: int = 512,
        max_blocks_per_key: int = 32,
        max_events: int = 2048,
        snapshot_every: int = 10,
        history: HistoryTracker | None = None,
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
        # The router's text blocks this replica holds (replica/contract/history_events.py), when tracked.
        self.history = history

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the remembered keys and hashes: at most ``max_keys`` keys (routing keys
        are short, a client's X-Prefix-Hash at most router/routing_key.py's max_header_len) of at most
        ``max_blocks_per_key`` hashes each, so bounded in bytes too."""
        total = 0 if self.history is None else self.history.nbytes
        for key, state in list(self._keys.items()):
            total += (
                sys.getsizeof(key) + 200 + sum(sys.getsizeof(h) + 8 for h in state.hashes) + 16 * len(state.present)
            )
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
            del state.media[n:]
            if not state.hashes:
                del self._keys[key]
                self._forgotten = True

    def publish(
        self,
        contains: Callable[[bytes], bool],
        medium_of: Callable[[bytes], str | None] | None = None,
        shared_of: Callable[[bytes], bool] | None = None,
        disk_group: str | None = None,
    ) -> dict[str, Any]:
        """The next payload (see the module docstring); ``contains(hash)``: is that block in the pool now.

        With ``medium_of`` (a block's fastest tier, or None) the payload carries the tiers too;
        ``shared_of(hash)``: is that block in the shared disk directory ``disk_group``. With a
        ``history`` tracker, its events too (replica/contract/history_events.py).
        """
        self.seq += 1
        snapshot = self.seq == 1 or self.seq % self.snapshot_every == 0 or self._forgotten
        tiered = medium_of is not None
        events: list[dict[str, Any]] = []
        held: dict[str, list[int]] = {}
        tiers: dict[str, list[int]] = {}
        num_hashes = 0
        for key, state in self._keys.items():
            if medium_of is None:
                media = [MEDIUM_DEVICE if contains(h) else None for h in state.hashes]
            else:
                media = [MEDIUM_DEVICE if contains(h) else medium_of(h) for h in state.hashes]
            shared = 0
            if shared_of is not None:
                for h in state.hashes:  # the leading run only: a lookup stops at the first miss
                    if not shared_of(h):
                        break
                    shared += 1
            before = state.media + [None] * (len(media) - len(state.media))
            moves: dict[tuple[str, str], list[str]] = {}
            for h, a, b in zip(state.hashes, before, media, strict=True):
                if a != b:
                    if a is not None:
                        moves.setdefault((BLOCK_REMOVED, a), []).append(h.hex())
                    if b is not None:
                        moves.setdefault((BLOCK_STORED, b), []).append(h.hex())
            now = [m == MEDIUM_DEVICE for m in media]
            summary = tier_summary(media, shared)
            changed = bool(moves) or not state.media or summary != state.tiers
            state.present, state.media, state.tiers = now, media, summary
            if snapshot or changed:
                held[key] = [leading_held(now), len(now)]
                tiers[key] = summary
            if not snapshot:
                for (kind, medium), hashes in sorted(moves.items(), key=_event_order):
                    num_hashes += len(hashes)
                    event: dict[str, Any] = {"type": kind, "key": key, "block_hashes": hashes}
                    if tiered:
                        event["medium"] = medium
                    events.append(event)
        if not snapshot and num_hashes > self.max_events:
            # Overflow: drop the events, send every key's summary instead.
            snapshot = True
            events = []
            held = {key: [leading_held(s.present), len(s.present)] for key, s in self._keys.items()}
            tiers = {key: list(s.tiers) for key, s in self._keys.items()}
        if snapshot:
            self._forgotten = False
        payload: dict[str, Any] = {
            "format": KV_EVENTS_FORMAT,
            "epoch": self.epoch,
            "seq": self.seq,
            "snapshot": snapshot,
            "events": events,
            "held": held,
        }
        if tiered:
            payload["tiers"] = tiers
            if disk_group is not None:
                payload["disk_group"] = disk_group
        if self.history is not None:
            in_cache = contains if medium_of is None else lambda h: contains(h) or medium_of(h) is not None
            payload.update(self.history.payload(in_cache, self.seq == 1, snapshot))
        return payload


def _event_order(item: tuple[tuple[str, str], list[str]]) -> tuple[bool, str]:
    """A key's events: stored before removed, then by medium (a stable payload)."""
    (kind, medium), _ = item
    return kind != BLOCK_STORED, medium


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

    def __init__(self, weights: TierWeights | None = None) -> None:
        self.weights = weights if weights is not None else TierWeights()
        self._last: dict[str, tuple[str, int]] = {}  # replica -> (epoch, seq) applied
        self._held: dict[str, set[str]] = {}  # replica -> keys known held there
        self.gaps = 0  # diffs applied after missed payloads
        # KV tiers: each replica's last tier summary per key, its disk group, and per group
        # and key the shared disk run each member reported.
        self._tiers: dict[str, dict[str, list[int]]] = {}
        self._group: dict[str, str] = {}
        self._shared: dict[str, dict[str, dict[str, int]]] = {}  # group -> key -> replica -> run
        self._totals: dict[str, dict[str, int]] = {}  # replica -> key -> prefix blocks
        self._shared_facts: list[tuple[str, str, bool]] = []
        self._history: list[HistoryReport] = []

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
        self._held.pop(replica, None)
        self._tiers.pop(replica, None)
        self._totals.pop(replica, None)
        group = self._group.pop(replica, None)
        if group is not None:
            for runs in self._shared.get(group, {}).values():
                runs.pop(replica, None)

    def take_history(self) -> list[HistoryReport]:
        """The history reports of the payloads applied since the last call (call it after each ``apply``)."""
        reports, self._history = self._history, []
        return reports

    def take_shared_facts(self) -> list[tuple[str, str, bool]]:
        """``(replica, key, holds)`` for the other replicas of a disk group whose shared run for
        ``key`` changed in the payloads applied since the last call."""
        facts, self._shared_facts = self._shared_facts, []
        return facts

    def _shared_run(self, replica: str, key: str) -> int:
        group = self._group.get(replica)
        if group is None:
            return 0
        return max(self._shared.get(group, {}).get(key, {}).values(), default=0)

    def _holds(self, replica: str, key: str, leading: int, total: int) -> bool:
        summary = self._tiers.get(replica, {}).get(key)
        if summary is None:
            shared = self._shared_run(replica, key)
            return holds_prefix(max(leading, self.weights.disk * shared), total)
        device, host, disk, _ = summary
        return holds_prefix(weighted_blocks(device, host, disk, self._shared_run(replica, key), self.weights), total)

    def _take_tiers(self, replica: str, payload: dict[str, Any], totals: dict[str, int]) -> None:
        """Record a payload's tier summaries; queue facts for the group members a shared run change reaches."""
        group = payload.get("disk_group")
        if isinstance(group, str):
            self._group[replica] = group
        group = self._group.get(replica)
        mine = self._tiers.setdefault(replica, {})
        for key, summary in (payload.get("tiers") or {}).items():
            try:
                device, host, disk, shared = (int(x) for x in summary)
            except (TypeError, ValueError):
                continue
            key = str(key)
            mine[key] = [device, host, disk, shared]
            if group is None:
                continue
            runs = self._shared.setdefault(group, {}).setdefault(key, {})
            before = max(runs.values(), default=0)
            runs[replica] = shared
            if max(runs.values(), default=0) != before:
                for other, other_group in self._group.items():
                    if other != replica and other_group == group and key in self._totals.get(other, {}):
                        holds = self._holds(other, key, 0, self._totals[other][key])
                        self._shared_facts.append((other, key, holds))
                        self._note(other, key, holds)
        self._totals.setdefault(replica, {}).update(totals)

    def _note(self, replica: str, key: str, holds: bool) -> None:
        known = self._held.setdefault(replica, set())
        if holds:
            known.add(key)
        else:
            known.discard(key)

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
        new_epoch = last is None or last[0] != epoch
        gap = not new_epoch and last is not None and seq != last[1] + 1
        if not snapshot:
            if new_epoch:
                return []  # no snapshot of this publisher yet: wait for one
            if gap:
                self.gaps += 1  # missed payloads: their keys keep their last known state
        self._last[replica] = (epoch, seq)
        # History has no absolute summary: what missed payloads said is lost, so a gap or a
        # publisher met anew resets what the router knew of the replica's history.
        history = parse_history(replica, payload, new_epoch or gap)
        if history is not None:
            self._history.append(history)
        known = self._held.setdefault(replica, set())
        facts: list[tuple[str, bool]] = []
        held = payload.get("held") or {}
        self._take_tiers(replica, payload, {str(k): int(v[1]) for k, v in held.items()})
        for key, summary in held.items():
            leading, total = int(summary[0]), int(summary[1])
            holds = self._holds(replica, str(key), leading, total)
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
