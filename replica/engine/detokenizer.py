"""Incremental detokenization for streaming: text deltas that never split a character.

Decoding tokens one at a time breaks multi-byte characters and loses the spacing some
tokenizers attach to neighbours. The classic two-offset scheme (vLLM, TGI) decodes a
short window twice, ``tokens[prefix:read]`` and ``tokens[prefix:]``, and emits the
difference only when it does not end in U+FFFD (an incomplete UTF-8 sequence).

``skip_special_tokens`` and ``spaces_between_special_tokens`` are vLLM's: the second
matters only when special tokens are kept; off, added tokens are spelled raw, with no
space a decoder would put around them.

Pure Python over any Hugging Face tokenizer; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded as left context of the first output token.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_tail: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Added tokens spelled raw: only when special tokens are kept without spaces.
        self.raw_added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self.raw_added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.tokens: list[int] = list(prompt_tail[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` under this request's special-token settings."""
        if self.raw_added is None:
            return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            raw = self.raw_added.get(t)
            if raw is None:
                run.append(t)
                continue
            if run:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            parts.append(raw)
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' when it is held back)."""
        self.tokens.append(token_id)
        prefix = self.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            # Keep the window short: text before prefix_offset is final.
            return full[len(prefix) :]
        return ""
