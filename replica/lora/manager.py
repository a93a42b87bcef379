"""Which adapters the engine holds in memory and which sit in the model's slots each step.

:class:`LoRAManager` (the driver's) keeps up to ``max_cpu_loras`` loaded adapters, least
recently used evicted first, and counts every load (a name the engine already knows is
reloaded from its path when a request needs it after eviction). An adapter a live request
uses (``in_use``, the engine's requests) is never evicted, so a step never reads an adapter
from disk: its files may be gone by then, and a failed load inside a step would fail every
request in it. While more adapters are in use than ``max_cpu_loras``, more stay loaded. :meth:`add` checks a
request's adapter before the request is queued: a bad adapter is a ValueError and changes
nothing. :meth:`plan_step` gives a step's adapters a slot each (an adapter keeps its slot
while it stays resident; otherwise the least recently used slot is taken) and returns the
slot writes and each row's slot; the model shard applies them just before the forward
(:meth:`LoRASlots.load`), so an asynchronous step in flight never sees its slots change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixserve.kernels.reference_lora import LoRAMapping
from prefixserve.replica.lora.adapter import LoRAAdapter, ModuleShapes, load_adapter
from prefixserve.replica.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAStep:
    """What a step's forward needs: adapters to write into slots first, and the rows' grouping."""

    writes: tuple[tuple[int, LoRAAdapter], ...]
    mapping: LoRAMapping | None


@dataclass
class LoRAManager:
    shapes: ModuleShapes
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    model_name: str
    num_loads: int = 0
    # The adapter names live requests use (set by the engine); None: nothing is pinned.
    in_use: Callable[[], Collection[str]] | None = None
    _known: dict[str, LoRARequest] = field(default_factory=dict)
    _loaded: OrderedDict[str, LoRAAdapter] = field(default_factory=OrderedDict)
    # Slot -> adapter name written there (None: empty), and the slots by last use (least first).
    _slots: list[str | None] = field(default_factory=list)
    _slot_order: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._slots = [None] * self.max_loras
        self._slot_order = list(range(self.max_loras))

    @property
    def loaded(self) -> list[str]:
        """Adapter names in memory, least recently used first."""
        return list(self._loaded)

    @property
    def resident(self) -> list[str | None]:
        """The adapter written in each slot."""
        return list(self._slots)

    def add(self, request: LoRARequest) -> None:
        """Load (or touch) ``request``'s adapter; ValueError for a bad one, with nothing changed."""
        known = self._known.get(request.lora_name)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"LoRA adapter name {request.lora_name!r} already names {known.lora_path!r}, "
                f"not {request.lora_path!r}: one name, one adapter"
            )
        self._get(request)
        self._known[request.lora_name] = request

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._loaded.get(request.lora_name)
        if adapter is None:
            adapter = load_adapter(request, self.shapes, max_rank=self.max_lora_rank, model_name=self.model_name)
            self.num_loads += 1
            self._loaded[request.lora_name] = adapter
            self._evict(keep=request.lora_name)
        else:
            self._loaded.move_to_end(request.lora_name)
        return adapter

    def _evict(self, keep: str) -> None:
        """Drop the least recently used adapters past ``max_cpu_loras``, never ``keep`` or one in use."""
        excess = len(self._loaded) - self.max_cpu_loras
        if excess <= 0:
            return
        pinned = set(self.in_use()) if self.in_use is not None else set()
        pinned.add(keep)
        for name in [n for n in self._loaded if n not in pinned][:excess]:
            del self._loaded[name]

    def unload(self, name: str) -> None:
        """Free ``name``'s memory now unless a live request uses it (then eviction frees it later).
        The name stays bound to its path (:meth:`add`): cached KV blocks are keyed by the name."""
        pinned = set(self.in_use()) if self.in_use is not None else set()
        if name not in pinned:
            self._loaded.pop(name, None)

    def plan_step(self, names: Sequence[str | None], num_tokens: Sequence[int]) -> LoRAStep | None:
        """Slots for the adapters of a step's sequences (``names``, None = base; ``num_tokens``
        rows each, in batch order); None when no sequence has an adapter."""
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        if not wanted:
            return None
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, max_loras is {self.max_loras}")
        slot_of = {name: i for i, name in enumerate(self._slots) if name is not None}
        keep = {slot_of[n] for n in wanted if n in slot_of}
        free = [s for s in self._slot_order if s not in keep]
        writes = []
        for name in wanted:
            slot = slot_of.get(name)
            if slot is None:
                slot = free.pop(0)
                self._slots[slot] = name
                slot_of[name] = slot
                writes.append((slot, self._get(self._known[name])))
            elif name in self._loaded:
                self._loaded.move_to_end(name)
            self._slot_order.remove(slot)
            self._slot_order.append(slot)
        per_seq = np.fromiter((-1 if n is None else slot_of[n] for n in names), np.int64, len(names))
        token_slots = torch.from_numpy(np.repeat(per_seq, np.asarray(num_tokens, np.int64)))
        return LoRAStep(tuple(writes), LoRAMapping.from_token_slots(token_slots))
