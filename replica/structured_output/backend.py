"""The grammar backend interface: what the engine needs of a constrained-decoding library.

One backend (``xgrammar_backend.py``) implements it; another library (llguidance) would be
a second module with the same three classes. The engine sees only these protocols:
compile a constraint into a ``Grammar`` once (cached, off the engine loop), give each
sequence its own ``Matcher``, and fill the bitmasks of one step's constrained rows in
one batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prefixserve.replica.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A constraint the backend cannot compile (invalid or unsupported); the message names the problem."""


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token accepted: the output is finished."""

    def reset(self) -> None:
        """Back to the grammar's start (no token accepted)."""


class Grammar(Protocol):
    """A compiled constraint: immutable, shared by every sequence that uses it."""

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class Backend(Protocol):
    """A constrained-decoding library bound to one tokenizer and vocabulary."""

    name: str

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """Compile ``params``' constraint; raises GrammarError naming what is wrong. Blocking: CPU work."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask tensor (on CPU) for ``rows`` logits rows; it may be reused from step to step
        (only rows filled in this step are applied)."""

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` with the tokens ``matchers[i]`` allows next, in one batch."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of disallowed tokens to -inf in place, on rows ``rows`` only."""
