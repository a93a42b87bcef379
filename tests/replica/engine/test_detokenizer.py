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


def test_the_stream_emits_what_the_python_scheme_does():
    """DecodeStream (Rust) against the two-decode Python scheme, on SmolLM2's byte-level
    tokenizer: multi-byte characters split over tokens, special tokens kept and skipped,
    prompt tails that end inside a character (those take the Python scheme)."""
    import random

    from model_helpers import _tokenizer_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir())
    rng = random.Random(1)
    pieces = tok.encode("日本語のテキスト 🎉🎉 émoji naïve — «quotes» \n\t def f(x): return x**2")
    streamed = 0
    for _ in range(300):
        ids = [
            rng.choice(pieces) if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))
        ]
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(17))  # a special token
        source = pieces if rng.random() < 0.5 else range(len(tok))
        prompt = [rng.choice(source) for _ in range(rng.randrange(0, 9))]
        for kwargs in ({}, {"skip_special_tokens": False}):
            fast = IncrementalDetokenizer(tok, prompt, **kwargs)
            slow = IncrementalDetokenizer(tok, prompt, **kwargs)
            slow.stream = None
            streamed += fast.stream is not None
            assert [fast.add(t) for t in ids] == [slow.add(t) for t in ids], (ids, prompt, kwargs)
    assert streamed > 300  # most requests take the stream
    clean = tok.encode("Hello there, friend")
    assert IncrementalDetokenizer(tok, clean).stream is not None
    assert IncrementalDetokenizer(tok, clean + tok.encode("🎉")[:1]).stream is None
