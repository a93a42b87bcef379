"""The C token-bitmask kernel (kernels/cpu/token_bitmask.py) against xgrammar's own
``apply_token_bitmask_inplace`` on random bitmasks: random words, words that allow all or
none of their 32 tokens, vocabularies that end inside a word, logits wider than the
vocabulary, strided logits rows, row subsets; the backend routes CPU float32 to it; bad
arguments are refused."""

from __future__ import annotations

import pytest
import torch

from prefixserve.kernels.cpu import library as cpu_library
from prefixserve.kernels.cpu.token_bitmask import apply_token_bitmask, supports

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(
    not cpu_library.available()[0], reason=f"C kernels unavailable: {cpu_library.available()[1]}"
)


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Random int32 words, with runs of all-zero and all-one words (what grammars produce)."""
    bits = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)
    kind = torch.randint(0, 4, (rows, words), generator=gen)
    bits[kind == 0] = 0
    bits[kind == 1] = -1
    return bits


@pytest.mark.parametrize(
    ("num_rows", "vocab", "width", "rows"),
    [
        (64, 49152, 49152, None),  # SmolLM2: the whole batch constrained
        (7, 1000, 1000, [0, 3, 6]),  # the vocabulary ends inside a word; some rows unconstrained
        (5, 333, 400, [4, 1]),  # logits wider than the vocabulary (padding left alone), unordered rows
        (3, 31, 31, [2]),  # less than one word
        (4, 64, 64, []),  # nothing to apply
    ],
)
def test_equals_xgrammar_on_random_bitmasks(num_rows: int, vocab: int, width: int, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + vocab)
    indices = list(range(num_rows)) if rows is None else rows
    for trial in range(3):
        bitmask = random_bitmask(num_rows, (vocab + 31) // 32, gen)
        logits = torch.randn(num_rows, width, generator=gen)
        logits[0, 0] = float("nan")  # a NaN logit is overwritten or kept exactly as xgrammar does
        expected, ours = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=indices)
        apply_token_bitmask(ours, bitmask, vocab, indices)
        assert torch.equal(ours.isnan(), expected.isnan()), trial
        assert torch.equal(ours.nan_to_num(0.0), expected.nan_to_num(0.0)), trial


def test_strided_logits_rows_and_bitmask_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 4100
    wide = torch.randn(6, vocab + 60, generator=gen)
    logits = wide[:, 10 : 10 + vocab]  # rows 4,160 floats apart
    bitmask = random_bitmask(12, (vocab + 31) // 32 + 3, gen)[::2]  # rows every other one, extra words
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask.contiguous(), vocab_size=vocab, indices=[1, 2, 5])
    before = wide.clone()
    apply_token_bitmask(logits, bitmask, vocab, [1, 2, 5])
    assert torch.equal(logits, expected)
    # Nothing outside the view's rows and columns was written.
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 10 + vocab :], before[:, 10 + vocab :])


def test_refuses_what_it_cannot_take() -> None:
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="row indices"):
        apply_token_bitmask(logits, bitmask, 64, [2])
    with pytest.raises(ValueError, match="row indices"):
        apply_token_bitmask(logits, bitmask, 64, [-1])
    with pytest.raises(ValueError, match="vocab_size"):
        apply_token_bitmask(logits, bitmask, 65, [0])
    with pytest.raises(ValueError, match="float32"):
        apply_token_bitmask(logits.half(), bitmask, 64, [0])
    assert not supports(logits.half(), bitmask) and not supports(logits.t(), bitmask) and supports(logits, bitmask)
    assert torch.equal(logits, torch.zeros(2, 64))


def test_backend_apply_equals_xgrammar_on_grammar_bitmasks() -> None:
    """The xgrammar backend on CPU float32 (the C kernel) masks a batch of real JSON-schema
    bitmasks, filled at several positions of a grammar, exactly as xgrammar's apply does."""
    from model_helpers import VOCAB, _tokenizer_dir
    from transformers import AutoTokenizer

    from prefixserve.replica.structured_output.params import StructuredOutputsParams
    from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
    backend = XGrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["ab", "cd"]}}}
    grammar = backend.compile(StructuredOutputsParams(json=schema))
    prefixes = ["", "{", '{"n": 1', '{"n": 12, "s": "a', '{"n": 1, "s": "cd"']
    matchers = []
    for text in prefixes:
        matcher = grammar.matcher()
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), text
        matchers.append(matcher)
    rows = [0, 2, 3, 5, 6]  # rows 1 and 4 unconstrained
    bitmask = backend.allocate_bitmask(7)
    backend.fill_bitmasks(matchers, bitmask, rows)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(5))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=VOCAB, indices=rows)
    backend.apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    allowed = (logits != float("-inf")).sum(dim=1).tolist()
    assert allowed[1] == allowed[4] == VOCAB and all(0 < allowed[r] < VOCAB // 2 for r in rows)
