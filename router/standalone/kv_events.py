"""The standalone router's reading of its replicas' KV events: which replica holds a prompt's blocks.

Job: turn ``--kv-events REPLICA_URL=ENDPOINT[,REPLAY_ENDPOINT]`` into the subscriber's
sources (router/kv_index/), and per request turn the prompt's token ids
(prompt_tokens.py) into the block hashes the replicas publish: our Contract-2 hashes
(replica/kv/hashing.py) for prefixserve replicas, vLLM's ``sha256_cbor`` for vLLM
servers. ``KVEventHints.held`` then asks the index which replicas hold the longest
prefix of those blocks, and routing.py's ``StandaloneRouting.learn`` hands it to
``placed`` as the Ray router's event intake (router/serve/event_intake.py) does: the
blocks a replica holds count for this request beside the history index (so ``placed``
sends it to the replica holding the longest cached prefix) and whether it holds the
key's static prefix goes to ``set_cached``.

The history index also keeps what the router sent each replica, so when events are
missing, late or gapped (the subscriber then forgets that replica's view) the router
still routes on its own record. Events never widen the candidates: a replica the
health checks ejected is not a candidate, whatever the index says of it.

Pure: no sockets (the subscriber is router/kv_index/subscriber.py), no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefixserve.replica.contract.prompt_blocks import PromptBlocks
from prefixserve.replica.kv.hashing import DEFAULT_HASH_ALGO, DEFAULT_HASH_SEED, BlockHasher
from prefixserve.router.kv_index import EventSource, KVEventIndex, vllm_block_hashes
from prefixserve.router.standalone.config import HASH_SCHEMES, StandaloneRouterConfig
from prefixserve.router.standalone.prompt_tokens import PromptTokens


def event_sources(config: StandaloneRouterConfig) -> list[EventSource]:
    """The subscriber's sources for ``config``'s ``--kv-events`` (each named by its replica's ring name)."""
    return [EventSource(s.replica, s.endpoint, replay_endpoint=s.replay_endpoint) for s in config.kv_event_specs]


def block_hasher(scheme: str, block_size: int, seed: str | None = None) -> Callable[[Sequence[int]], list[bytes]]:
    """The hashes of every full block of a token sequence as replicas of ``scheme`` publish them."""
    if scheme == "vllm":
        vllm_seed = seed if seed is not None else "vllm-none-hash"
        return lambda ids: vllm_block_hashes(ids, block_size, seed=vllm_seed)
    if scheme not in HASH_SCHEMES:
        raise ValueError(f"unknown KV event hash scheme {scheme!r}; choose one of {', '.join(HASH_SCHEMES)}")
    algo = {"prefixserve-sha256": "sha256", "prefixserve-xxh3_128": "xxh3_128"}.get(scheme, DEFAULT_HASH_ALGO)
    hasher = BlockHasher(algo, seed or DEFAULT_HASH_SEED)
    return lambda ids: hasher.hash_blocks(ids, block_size)


class KVEventHints:
    """Prompt -> token-block hashes -> the index's longest prefixes -> ``placed``'s inputs."""

    def __init__(
        self,
        tokens_of: Callable[[Any], PromptTokens | None],
        hash_blocks: Callable[[Sequence[int]], list[bytes]],
        block_size: int,
        index: KVEventIndex,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.tokens_of = tokens_of
        self.hash_blocks = hash_blocks
        self.block_size = block_size
        self.index = index

    def blocks(self, body: Any) -> PromptBlocks | None:
        """The request's token-block hashes and how many cover its static prefix (None: unreadable).

        CPU work (tokenizing, hashing): call it off the event loop.
        """
        tokens = self.tokens_of(body)
        if tokens is None:
            return None
        return PromptBlocks(self.hash_blocks(tokens.ids), tokens.static_tokens // self.block_size)

    def held(self, blocks: PromptBlocks) -> dict[str, int]:
        """Per replica, the leading blocks of the prompt the events say it holds (any medium)."""
        return self.index.longest_prefix(blocks.hashes)

    def sources(self) -> list[str]:
        """The replicas the index holds blocks of."""
        return self.index.replicas


def build_hints(config: StandaloneRouterConfig) -> KVEventHints | None:
    """The hints ``config`` asks for (None without ``--kv-events``); loads the tokenizer folder."""
    if not config.kv_events or config.tokenizer is None:
        return None
    from prefixserve.router.standalone.prompt_tokens import PromptTokenizer

    tokenizer = PromptTokenizer(config.tokenizer)
    size = config.kv_events_block_size
    return KVEventHints(
        tokenizer.of_body,
        block_hasher(config.kv_events_hash, size, config.kv_events_seed),
        size,
        KVEventIndex(config.kv_events_max_entries),
    )
