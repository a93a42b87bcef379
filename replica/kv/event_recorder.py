"""What the KV cache did between two engine steps, as vLLM's KV events (replica/contract/vllm_kv_events.py).

Job: the KV manager reports here each run of blocks it registers under a hash (a
``BlockStored`` with the chain's parent, the tokens and the medium), each hashed block
it evicts or drops from a tier (``BlockRemoved``) and each reset (``AllBlocksCleared``);
the engine takes the list once per step and publishes it as one batch, as vLLM's
scheduler does. Unlike the routing-stats events (replica/contract/kv_events.py, a diff
of remembered prefixes), these follow every block, so a router can index the whole cache.

Hashes are our Contract-2 digests (replica/kv/hashing.py) in vLLM's default event form
(``external_block_hash``: the low 64 bits, an int). A vLLM-hashing router will not find
them among its own, but consumers that rebuild keys from ``token_ids`` (llm-d's indexer)
and routers that hash the way we do (router/kv_index/) will.

Bounded: at most ``max_events`` events wait between two ``take`` calls; past that the
list is replaced by one ``AllBlocksCleared`` (a consumer then forgets this replica's
blocks and under-claims until they are stored again: the safe direction for routing).

Pure: no torch, no ZMQ. Called on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixserve.replica.contract.vllm_kv_events import (
    MEDIUM_OF_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)


class KVEventRecorder:
    """Collects the KV manager's block events between ``take`` calls (one engine step)."""

    def __init__(self, max_events: int = 65_536) -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an integer >= 1, got {max_events!r}")
        self.max_events = max_events
        self._events: list[KVEvent] = []
        self.overflows = 0  # steps whose events were replaced by AllBlocksCleared
        # Counts AllBlocksCleared events: after one, a consumer holds nothing of this replica.
        self.generation = 0

    def __len__(self) -> int:
        return len(self._events)

    def _add(self, event: KVEvent) -> None:
        if len(self._events) >= self.max_events:
            self.overflows += 1
            self._events = [AllBlocksCleared()]
            self.generation += 1
            return
        self._events.append(event)

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        tier: str = "device",
    ) -> None:
        """Consecutive blocks of one chain registered in ``tier``: ``parent`` the hash of the block
        before the first (None at block 0), ``token_ids`` their tokens (empty when the caller does
        not hold them, with ``block_size`` 0: vLLM's form for a tier copy)."""
        if not hashes:
            return
        self._add(
            BlockStored(
                block_hashes=[external_block_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=list(token_ids),
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_OF_TIER[tier],
                lora_name=None,
            )
        )

    def removed(self, hashes: Sequence[bytes], tier: str = "device") -> None:
        """The blocks of these hashes left ``tier``."""
        if hashes:
            self._add(BlockRemoved(block_hashes=[external_block_hash(h) for h in hashes], medium=MEDIUM_OF_TIER[tier]))

    def cleared(self) -> None:
        """Every cached block is gone; what was recorded before it no longer matters."""
        self._events = [AllBlocksCleared()]
        self.generation += 1

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order (empty when nothing changed)."""
        events, self._events = self._events, []
        return events


class TierSetReporter:
    """Reports a tier known only as a set of hashes (the shared disk directory, which other
    replicas write too) by diffing each set against the one reported before: a ``BlockStored``
    for what appeared, a ``BlockRemoved`` for what went. After an ``AllBlocksCleared`` (the
    recorder's ``generation`` moved) everything present is stored again, since a consumer then
    forgot it. O(set) per call: the caller spaces the calls (the disk relists at most every
    few seconds anyway)."""

    def __init__(self, recorder: KVEventRecorder, tier: str = "disk") -> None:
        self.recorder = recorder
        self.tier = tier
        self._reported: set[bytes] = set()
        self._generation = recorder.generation

    def update(self, present: set[bytes]) -> None:
        rec = self.recorder
        if rec.generation != self._generation:
            self._reported = set()
            self._generation = rec.generation
        gone = self._reported - present
        new = present - self._reported
        # Sorted: the batch's bytes do not depend on set order.
        rec.removed(sorted(gone), self.tier)
        rec.stored(sorted(new), None, (), 0, self.tier)
        self._reported = set(present)
        if rec.generation != self._generation:  # the recorder overflowed meanwhile: report all next time
            self._reported = set()
            self._generation = rec.generation
