"""Blocks kept for ``prompt_cache_retention``: pins with a time to live, within a budget.

OpenAI's ``prompt_cache_retention: "24h"`` asks that a request's prefix stay cached. The KV
manager (``KVCacheManager.pin``) keeps such a request's leading full blocks by holding one
reference on each, so no eviction policy can take them; this table is the bookkeeping: which
block hashes are pinned, by whom, until when.

* A pin lives ``ttl_s`` from its last refresh: a request pinning the block again, or any request
  hitting it (``refresh``). One time to live per engine, so the least recently refreshed pin
  is also the first to expire: one ordered map serves both orders.
* The budget: at most ``max_blocks`` pinned blocks on the replica, and at most
  ``max_blocks_per_owner`` of them for one owner (a tenant, else a client), so one tenant's
  sessions cannot take the room every other tenant's pins need.
* Pins give way before running requests do: when the device runs out of blocks the manager
  releases the least recently refreshed pins (``pop_oldest``) before the scheduler preempts,
  and the released blocks leave the device through the ordinary eviction, which copies them to
  the host tier (and from there to the disk tier) when the replica has them.

Pure bookkeeping: no blocks are touched here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Pin:
    """One pinned block: the device block holding the hash, its owner, when it expires."""

    block: int
    owner: str
    expires_at: float


class PinTable:
    """Pinned block hashes, least recently refreshed first (see the module docstring)."""

    def __init__(self, max_blocks: int, max_blocks_per_owner: int, ttl_s: float) -> None:
        if max_blocks < 0 or max_blocks_per_owner < 0:
            raise ValueError(f"pin budgets must be >= 0, got {max_blocks} and {max_blocks_per_owner}")
        if not ttl_s > 0:
            raise ValueError(f"the pins' time to live must be positive, got {ttl_s}")
        self.max_blocks = max_blocks
        self.max_blocks_per_owner = min(max_blocks_per_owner, max_blocks)
        self.ttl_s = ttl_s
        self._pins: OrderedDict[bytes, Pin] = OrderedDict()
        self._per_owner: dict[str, int] = {}
        self.num_expired = 0
        self.num_released_for_room = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._pins

    def items(self) -> Iterable[tuple[bytes, Pin]]:
        return self._pins.items()

    def owned_by(self, owner: str) -> int:
        return self._per_owner.get(owner, 0)

    def room(self, owner: str) -> int:
        """How many more blocks ``owner`` may pin now."""
        return max(0, min(self.max_blocks - len(self._pins), self.max_blocks_per_owner - self.owned_by(owner)))

    def add(self, block_hash: bytes, block: int, owner: str, now: float) -> None:
        """Pin ``block`` (holding ``block_hash``) for ``owner``; the caller checked ``room``."""
        assert block_hash not in self._pins, "a pinned hash is refreshed, not pinned again"
        self._pins[block_hash] = Pin(block, owner, now + self.ttl_s)
        self._per_owner[owner] = self.owned_by(owner) + 1

    def refresh(self, block_hash: bytes, now: float) -> bool:
        """Restart the pin's time to live (False: the hash is not pinned)."""
        pin = self._pins.get(block_hash)
        if pin is None:
            return False
        pin.expires_at = now + self.ttl_s
        self._pins.move_to_end(block_hash)
        return True

    def _pop(self, block_hash: bytes) -> int:
        pin = self._pins.pop(block_hash)
        left = self._per_owner[pin.owner] - 1
        if left:
            self._per_owner[pin.owner] = left
        else:
            del self._per_owner[pin.owner]
        return pin.block

    def pop_expired(self, now: float) -> list[int]:
        """Unpin every pin whose time to live ran out; their blocks, for the caller to release."""
        out = []
        while self._pins:
            block_hash, pin = next(iter(self._pins.items()))
            if pin.expires_at > now:
                break
            out.append(self._pop(block_hash))
        self.num_expired += len(out)
        return out

    def pop_oldest(self, n: int, releasable: Callable[[Pin], bool]) -> list[int]:
        """Unpin up to ``n`` pins that are ``releasable``, least recently refreshed first; their blocks."""
        chosen: list[bytes] = []
        for block_hash, pin in self._pins.items():
            if len(chosen) == n:
                break
            if releasable(pin):
                chosen.append(block_hash)
        out = [self._pop(h) for h in chosen]
        self.num_released_for_room += len(out)
        return out

    def pop_all(self) -> list[int]:
        """Unpin everything (a reset of the prefix cache); the blocks."""
        return [self._pop(h) for h in list(self._pins)]

    def check_invariants(self) -> None:
        counts: dict[str, int] = {}
        for pin in self._pins.values():
            counts[pin.owner] = counts.get(pin.owner, 0) + 1
        assert counts == self._per_owner, "per-owner pin counts out of sync"
        expiries = [p.expires_at for p in self._pins.values()]
        assert expiries == sorted(expiries), "pins not in expiry order"
