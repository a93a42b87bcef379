"""IncrementalDetokenizer's special-token switches (vLLM's skip_special_tokens and
spaces_between_special_tokens) on a tokenizer whose decoder puts spaces between tokens."""

from __future__ import annotations

import pytest

from prefixserve.replica.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def spaced_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return tok


def stream(tok, ids, **kwargs) -> str:
    detok = IncrementalDetokenizer(tok, [], **kwargs)
    return "".join(detok.add(t) for t in ids)


def test_special_token_switches(spaced_tokenizer):
    tok = spaced_tokenizer
    a, b = tok.convert_tokens_to_ids(["<a>", "<b>"])
    ids = [1, a, b, 2, 3]
    assert stream(tok, ids) == tok.decode(ids, skip_special_tokens=True) == "hello worlds"
    kept = stream(tok, ids, skip_special_tokens=False)
    assert kept == tok.decode(ids, skip_special_tokens=False) == "hello <a> <b> worlds"
    assert stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "hello<a><b>worlds"
    # Without kept special tokens the spacing switch has nothing to act on.
    assert stream(tok, ids, spaces_between_special_tokens=False) == "hello worlds"
