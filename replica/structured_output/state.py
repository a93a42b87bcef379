"""One sequence's grammar state and the step's batched bitmask (what the sampler calls).

Each sequence of a constrained request owns a ``SequenceGrammar`` (``n > 1``: one per
child). It advances with every token the engine appends; ``sync`` replays the output
tokens into a fresh matcher whenever the matcher and the sequence disagree on how many
tokens were accepted, so a sequence whose progress is rebuilt stays exact. A swapped-out
or recompute-preempted sequence keeps its output tokens, and so its matcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.replica.structured_output.backend import Backend, Grammar, Matcher

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class SequenceGrammar:
    """A sequence's matcher over its request's compiled grammar."""

    grammar: Grammar
    backend: Backend
    matcher: Matcher
    num_accepted: int = 0

    @classmethod
    def start(cls, grammar: Grammar, backend: Backend) -> SequenceGrammar:
        return cls(grammar, backend, grammar.matcher())

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token; raises RuntimeError if the grammar does not allow it."""
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar does not allow the sampled token {token_id}")
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        """The output is complete (the grammar ended and its stop token was accepted)."""
        return self.matcher.is_terminated()

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher stand after exactly ``output_token_ids`` (replayed into a fresh one if not)."""
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher = self.grammar.matcher()
        self.num_accepted = 0
        for token in output_token_ids:
            self.accept(token)


def apply_grammar_bitmasks(
    logits: torch.Tensor, rows: list[int], states: list[SequenceGrammar], errors: dict[int, Exception]
) -> None:
    """Mask every token row ``rows[i]`` of ``logits`` may not take next under ``states[i]``.

    One batched bitmask fill and one in-place apply per backend for the whole step; a
    failure of the batch is retried row by row so that only the failing rows are marked
    in ``errors`` (their logits zeroed, their token discarded by the engine).
    """
    by_backend: dict[int, tuple[Backend, list[int], list[SequenceGrammar]]] = {}
    for row, state in zip(rows, states, strict=True):
        by_backend.setdefault(id(state.backend), (state.backend, [], []))
        by_backend[id(state.backend)][1].append(row)
        by_backend[id(state.backend)][2].append(state)
    for backend, group_rows, group_states in by_backend.values():
        bitmask = backend.allocate_bitmask(logits.shape[0])
        matchers = [s.matcher for s in group_states]
        try:
            backend.fill_bitmasks(matchers, bitmask, group_rows)
        except Exception:  # noqa: BLE001 - find the failing rows
            ok = []
            for row, matcher in zip(group_rows, matchers, strict=True):
                try:
                    backend.fill_bitmasks([matcher], bitmask, [row])
                    ok.append(row)
                except Exception as exc:  # noqa: BLE001 - reported on the row
                    errors[row] = exc
                    logits[row] = 0.0
            group_rows = ok
        if group_rows:
            backend.apply_bitmask(logits, bitmask, group_rows)
