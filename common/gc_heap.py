"""Freezing the garbage collector's heap once a server process has loaded its model.

Job: one call, :func:`freeze_gc_heap`, for the processes that host one engine for their
whole life (``prefixserve replica``, a Ray Serve engine replica), and for ``prefixserve
router``, whose modules, tokenizer and tables live as long as it does. A full collection
(generation 2) walks every object the collector tracks: with SmolLM2's engine loaded, about
220,000 objects and 110-120 ms on a 2-core VM, a pause of whichever thread triggers it, the
engine's step or the event loop, so a stream sees a gap of that size (or several under
load) between two tokens. Objects alive once the model is loaded live as long as the process:
frozen, the collector never walks them again. vLLM freezes its heap after its engine starts
for the same reason (``vllm.utils.gc_utils.freeze_gc_heap``).

Not for a process that builds and drops many engines (a test session): a frozen object in a
reference cycle is never collected.
"""

from __future__ import annotations

import gc


def freeze_gc_heap() -> None:
    """Collect what is garbage now, then move every object still alive out of the collector's reach."""
    gc.collect()
    gc.freeze()
