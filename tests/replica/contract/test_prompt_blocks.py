"""replica/contract/prompt_blocks.py: the router's chained text-block hashes of a request's prompt."""

from __future__ import annotations

import pytest

from prefixserve.replica.contract.prompt_blocks import PromptHasher, UnhashablePrompt
from prefixserve.replica.contract.request import EngineRequest

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}  # several blocks


def turns(n: int) -> list[dict[str, str]]:
    out = [SYSTEM]
    for t in range(n):
        out.append({"role": "user", "content": f"question {t} " * 30})
        out.append({"role": "assistant", "content": f"answer {t} " * 30})
    return out


def test_an_appended_turn_keeps_every_earlier_block_and_the_static_count():
    hasher = PromptHasher(block_chars=64)
    short, long = hasher.message_blocks(turns(2)), hasher.message_blocks(turns(3))
    assert long.hashes[: len(short.hashes)] == short.hashes
    assert len(long.hashes) > len(short.hashes)
    assert short.static_blocks == long.static_blocks > 0
    assert short.static_blocks == len(hasher.message_blocks([SYSTEM]).hashes)


def test_the_previous_turns_messages_come_from_the_cache():
    hasher = PromptHasher(block_chars=64)
    hasher.message_blocks(turns(3))
    misses = hasher.cache_misses
    again = hasher.message_blocks(turns(4))
    assert hasher.cache_misses == misses + 2  # only the new user and assistant messages were hashed
    assert again.hashes == PromptHasher(block_chars=64, cache_messages=0).message_blocks(turns(4)).hashes


def test_the_cache_is_bounded():
    hasher = PromptHasher(block_chars=64, cache_messages=3)
    hasher.message_blocks(turns(5))
    assert len(hasher._cache) == 3


def test_a_different_system_prompt_shares_no_block():
    hasher = PromptHasher(block_chars=64)
    a = hasher.message_blocks(turns(1))
    b = hasher.message_blocks([{"role": "system", "content": "other"}, *turns(1)[1:]])
    assert not set(a.hashes) & set(b.hashes)


def test_completions_prompts_text_and_token_ids():
    hasher = PromptHasher(block_chars=64)
    text = hasher.blocks(EngineRequest(prompt="x" * 200))
    assert len(text.hashes) == 4 and text.static_blocks == 0
    ids = hasher.blocks(EngineRequest(prompt=list(range(40))))
    assert len(ids.hashes) == 3  # 16 ids a block


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"content": "no role"}],
        ["not a message"],
        [],
    ],
)
def test_unreadable_prompts_are_refused_with_a_clear_error(messages):
    with pytest.raises(UnhashablePrompt):
        PromptHasher().message_blocks(messages)
