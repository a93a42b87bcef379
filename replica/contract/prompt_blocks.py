"""Chained block hashes of a request's prompt as the router sees it: text, not tokens.

Job: the ``history`` argument of ``placed`` (router/policies/placed.py) for a live
request, and the names of the history blocks a replica reports in its KV events
(replica/contract/history_events.py): one definition, so that both sides hash alike.
At decision time the Serve router holds the ingress's EngineRequest:
chat ``messages`` (rendered by the engine's chat template only on the replica)
or a completions ``prompt`` (text or token ids). The ingress loads no tokenizer,
so the router cannot compute Contract 2's token-block hashes; like Ray Serve
LLM's PrefixCacheAffinityRouter it matches characters, in chained blocks:

* chat: each message is ``role 0x00 content`` (content parts' texts joined by
  ``"\\n"``, as router/routing_key.py reads them), cut into blocks of ``block_chars``
  characters; a message's last block may be shorter (blocks never straddle
  messages, so an appended turn leaves every earlier block unchanged);
* completions text: blocks of ``block_chars`` characters; token ids: blocks of
  ``block_chars // 4`` ids (little-endian uint32);
* block i's hash is BLAKE2b-128 of (block i-1's hash || the block's UTF-8
  bytes): a hash names its whole prefix, as Contract 2's do.

``static_blocks`` counts the blocks of the leading system/developer messages
(Contract 1's static prefix). Hashing a long history every turn would cost
O(history) of BLAKE2b per request; a bounded cache keyed by (the previous
block's hash, role, the content's length and Python string hash) returns a
message's blocks when the same message followed the same prefix before, so a
turn that extends the previous one hashes only its new messages (the lookups
cost Python's string hash of the earlier messages, several times cheaper than
BLAKE2b). The cache holds no message text: at most ``cache_messages`` entries of
a few hundred bytes plus 16 bytes per block. A collision of the 64-bit string hash
(with equal length, prefix and role) would give a wrong routing hint, never a
wrong answer.

Pure Python (hashlib): no Ray, no HTTP, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.replica.contract.routing import STATIC_ROLES, content_text

DEFAULT_BLOCK_CHARS = 256  # about 64 tokens of English text
DEFAULT_CACHE_MESSAGES = 65_536
_ROOT = b"\x00" * 16


class UnhashablePrompt(ValueError):
    """The request has no prompt the router can read (it routes by its static key, then load)."""


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's chained block hashes and how many of them the static prefix covers."""

    hashes: list[bytes]
    static_blocks: int


def _message_text(m: Any) -> tuple[str, str]:
    """A chat message's role and content text (UnhashablePrompt when the router cannot read it)."""
    if not isinstance(m, Mapping):
        raise UnhashablePrompt(f"a message must be an object, got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str):
        raise UnhashablePrompt("a message without a string role")
    try:
        text = content_text(m.get("content"))
    except ValueError as exc:
        raise UnhashablePrompt(str(exc)) from None
    return role, text


def _message_bytes(role: str, text: str) -> bytes:
    return role.encode("utf-8") + b"\x00" + text.encode("utf-8")


def _chain(parent: bytes, data: bytes, size: int) -> list[bytes]:
    out = []
    for start in range(0, len(data), size):
        parent = hashlib.blake2b(parent + data[start : start + size], digest_size=16).digest()
        out.append(parent)
    return out


class PromptHasher:
    """Computes PromptBlocks for EngineRequest-like objects, reusing earlier turns' message hashes."""

    def __init__(self, block_chars: int = DEFAULT_BLOCK_CHARS, cache_messages: int = DEFAULT_CACHE_MESSAGES) -> None:
        if block_chars < 4 or cache_messages < 0:
            raise ValueError("block_chars must be >= 4 and cache_messages >= 0")
        self.block_chars = block_chars
        self.cache_messages = cache_messages
        self._cache: OrderedDict[tuple[bytes, str, int, int], tuple[bytes, ...]] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0

    def blocks(self, request: Any) -> PromptBlocks:
        """The request's blocks; UnhashablePrompt when it carries no readable prompt."""
        messages = getattr(request, "messages", None)
        if messages is not None:
            return self.message_blocks(messages)
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, str) and prompt:
            return PromptBlocks(_chain(_ROOT, prompt.encode("utf-8"), self.block_chars), 0)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
            data = struct.pack(f"<{len(prompt)}I", *prompt)
            return PromptBlocks(_chain(_ROOT, data, (self.block_chars // 4) * 4), 0)
        raise UnhashablePrompt(f"no prompt the router can hash: {type(prompt).__name__}")

    def message_blocks(self, messages: Sequence[Any]) -> PromptBlocks:
        """Blocks of a chat request's messages (see the module docstring)."""
        if not isinstance(messages, Sequence) or not messages:
            raise UnhashablePrompt("a chat request without messages")
        hashes: list[bytes] = []
        static_blocks = 0
        leading = True
        parent = _ROOT
        cache = self._cache
        for m in messages:
            role, text = _message_text(m)
            key = (parent, role, len(text), hash(text))
            got = cache.get(key) if self.cache_messages else None
            if got is None:
                self.cache_misses += 1
                got = tuple(_chain(parent, _message_bytes(role, text), self.block_chars))
                if self.cache_messages:
                    cache[key] = got
                    if len(cache) > self.cache_messages:
                        cache.popitem(last=False)
            else:
                self.cache_hits += 1
                cache.move_to_end(key)
            hashes.extend(got)
            if got:
                parent = got[-1]
            if leading and role in STATIC_ROLES:
                static_blocks = len(hashes)
            else:
                leading = False
        return PromptBlocks(hashes, static_blocks)

    def block_ends(self, request: Any) -> list[int]:
        """Where each of ``blocks(request)``'s blocks ends, in bytes of the hashed stream (the
        messages' ``role 0x00 content`` one after another, the prompt's UTF-8, or its uint32 ids).

        The replica places each history block in its token blocks by this
        (replica/contract/history_events.py). UnhashablePrompt as ``blocks``.
        """
        messages = getattr(request, "messages", None)
        if messages is not None:
            if not isinstance(messages, Sequence) or not messages:
                raise UnhashablePrompt("a chat request without messages")
            ends: list[int] = []
            done = 0
            for m in messages:
                n = len(_message_bytes(*_message_text(m)))
                ends.extend(range(done + self.block_chars, done + n, self.block_chars))
                done += n
                ends.append(done)
            return ends
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, str) and prompt:
            n, size = len(prompt.encode("utf-8")), self.block_chars
        elif isinstance(prompt, list) and prompt:
            n, size = 4 * len(prompt), (self.block_chars // 4) * 4
        else:
            raise UnhashablePrompt(f"no prompt the router can hash: {type(prompt).__name__}")
        return [*range(size, n, size), n]
