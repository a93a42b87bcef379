"""The xgrammar backend (docs/engine.md "Structured output" says why xgrammar).

Compiles each constraint kind with xgrammar's ``GrammarCompiler`` (its own cache off: ours
in ``compile.py`` is keyed by the request's spec and bounded in entries), fills one
step's bitmasks with ``BatchGrammarMatcher`` and applies them with our C kernel on CPUs
(``kernels/cpu/token_bitmask.py``) and xgrammar's ``apply_token_bitmask_inplace`` elsewhere
(Triton/CUDA on GPUs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prefixserve.replica.structured_output.backend import GrammarError, Matcher
from prefixserve.replica.structured_output.params import MAX_JSON_WHITESPACE, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# xgrammar prefixes its C++ errors with a timestamp and a source position: not the client's business.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text) or type(exc).__name__


def _choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string literals are EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarGrammar:
    """A compiled xgrammar grammar."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        matcher: Matcher = xgr.GrammarMatcher(self.compiled)
        return matcher


class XGrammarBackend:
    """xgrammar over one tokenizer; ``vocab_size`` is the logits' width (the model's vocabulary).

    ``stop_token_ids``: the tokens that end a completed output (the engine's EOS ids).
    ``max_threads``: xgrammar's threads for compiling and for filling a batch's bitmasks.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *, max_threads: int = 1) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._bitmask: torch.Tensor | None = None

    def compile(self, params: StructuredOutputsParams) -> XGrammarGrammar:
        kind = params.kind
        whitespace: dict[str, Any] = (
            {"any_whitespace": False, "separators": (",", ":")}
            if params.disable_any_whitespace
            else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        )
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(params.spec, **whitespace)
            elif kind == "json_object":
                # OpenAI: "the message the model generates is valid JSON" and an object.
                compiled = self.compiler.compile_json_schema('{"type": "object"}', **whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(params.spec)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_grammar(params.choice or ()))
            elif kind == "grammar":
                compiled = self.compiler.compile_grammar(params.spec)
            else:
                compiled = self.compiler.compile_structural_tag(params.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {_clean(exc)}") from None
        return XGrammarGrammar(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        # One buffer, grown on demand: filling a row overwrites all of it and only filled rows are
        # applied, so nothing needs clearing between steps (the engine thread is its only user).
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask[:rows]

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        from prefixserve.kernels.cpu import token_bitmask

        # On CPUs the C kernel: xgrammar's CPU apply tests bit by bit (about 14 ms a step at
        # 64 rows x 49,152 tokens on 2 cores, against well under 1 ms); the result is the same.
        if token_bitmask.supports(logits, bitmask):
            token_bitmask.apply_token_bitmask(logits, bitmask, self.vocab_size, rows)
            return
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
