"""Incremental detokenization for streaming: text deltas that never split a character.

Decoding tokens one at a time breaks multi-byte characters and loses the spacing some
tokenizers attach to neighbours. The classic two-offset scheme (vLLM, TGI) decodes a
short window twice, ``tokens[prefix:read]`` and ``tokens[prefix:]``, and emits the
difference only when it does not end in U+FFFD (an incomplete UTF-8 sequence).

Pure Python over any Hugging Face tokenizer; no torch.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded as left context of the first output token.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_tail: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_tail[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' when it is held back)."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            # Keep the window short: text before prefix_offset is final.
            return full[len(prefix):]
        return ""
