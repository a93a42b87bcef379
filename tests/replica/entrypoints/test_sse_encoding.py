"""The streamed chunks' fast JSON: byte for byte what the protocol models write.

serving.py encodes text-only chunks from a per-stream template; every string a detokenizer can
produce (quotes, backslashes, control characters, non-ASCII, astral code points, the
line and paragraph separators) must come out exactly as pydantic's ``model_dump_json``.
"""

from __future__ import annotations

import random

import pytest

from prefixserve.replica.contract.finish_reason import FinishReason
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.serving import TextChunks

SPECIAL = ['"', "\\", "/", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f", "\u2028", "\u2029", "é", "中", "😀"]


def _texts() -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x80)] + SPECIAL + [chr(c) for c in (0xA0, 0xFEFF, 0xFFFD, 0x10FFFF)]
    texts = ["", " hello", *SPECIAL, "".join(SPECIAL)]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24))) for _ in range(300)]
    return texts


FINISHES: list[str | None] = [None, FinishReason.STOP, FinishReason.LENGTH, "tool_calls"]


def _assert_chunks_match_the_model(chat: bool, finish: str | None, id_format: str, model: str) -> None:
    """Every text's chunk, encoded from the template, is the protocol model's JSON byte for byte."""
    for k, text in enumerate(_texts()):
        request_id, created, index = id_format.format(k), 1_700_000_000 + k, k % 3
        if chat:
            choice = api.ChatChunkChoice(index=index, delta=api.DeltaMessage(content=text), finish_reason=finish)
            expected = api.ChatCompletionChunk(id=request_id, model=model, created=created, choices=[choice])
        else:
            completion = api.CompletionChoice(index=index, text=text, finish_reason=finish)
            expected = api.CompletionResponse(id=request_id, model=model, created=created, choices=[completion])
        encoded = TextChunks(request_id, model, chat=chat).encode(created, index, text, finish)
        assert encoded == expected.model_dump_json(), repr(text)


@pytest.mark.parametrize("finish", FINISHES)
def test_completion_chunk_matches_the_model(finish: str | None) -> None:
    _assert_chunks_match_the_model(False, finish, 'cmpl-{:x}é"', 'smol"lm\\2')


@pytest.mark.parametrize("finish", FINISHES)
def test_chat_chunk_matches_the_model(finish: str | None) -> None:
    _assert_chunks_match_the_model(True, finish, "chatcmpl-{:x}", "smollm2\n")
