"""The most prefix-cache hits any routing can give a workload: one unbounded cache replaying it.

Job: per request, the tokens an engine could take from its cache if a single replica
with unlimited KV memory had served every earlier request: the longest run of leading
whole blocks that some earlier prompt also started with. The last prompt token is
always computed (the engine needs its logits), so a prompt never hits all of its
blocks when its length is a multiple of the block size.

Only prompts count: what an engine generates differs from the synthetic assistant turns
a replayed conversation sends back, so no later prompt can reuse it. No cluster, router
or eviction order does better; requests of one prefix sent together can do worse (both
miss where this counts the second as a hit).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_chain(prompt: Sequence[int], block_size: int) -> list[bytes]:
    """One digest per whole block of ``prompt``, each over its tokens and every block before it."""
    parent = b""
    chain = []
    # A block's identity is its tokens and everything before it, as the engine's chained hashes.
    for start in range(0, len(prompt) - len(prompt) % block_size, block_size):
        parent = hashlib.sha256(parent + array("q", prompt[start : start + block_size]).tobytes()).digest()
        chain.append(parent)
    return chain


def replay_hits(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Cached tokens per prompt (a multiple of ``block_size``), replaying ``prompts`` in order."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[bytes] = set()
    hits = []
    for prompt in prompts:
        limit = max(0, (len(prompt) - 1) // block_size)
        chain = block_chain(prompt, block_size)
        n = 0
        while n < limit and chain[n] in seen:
            n += 1
        hits.append(n * block_size)
        seen.update(chain)
    return hits


def distinct_blocks(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Whole blocks the unbounded cache holds after the replay: a conversation workload's working set."""
    return len({h for prompt in prompts for h in block_chain(prompt, block_size)})


def replay_bound(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """:func:`replay_hits` summed over the prompts' tokens: the workload's hit-rate bound (0 for no tokens)."""
    total = sum(len(p) for p in prompts)
    return sum(replay_hits(prompts, block_size)) / total if total else 0.0
