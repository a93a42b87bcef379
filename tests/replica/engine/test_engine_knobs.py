"""Engine knobs: vLLM's hash-algorithm spellings (config, dict, CLI, LLM)."""

from __future__ import annotations

import argparse

import pytest

from prefixserve.replica.config import HASH_ALGO_ALIASES, HASH_ALGOS, EngineConfig


@pytest.mark.parametrize(
    "vllm_value, ours",
    [
        ("sha256", "sha256"),
        ("sha256_cbor", "sha256"),
        ("sha256_cbor_64bit", "sha256"),
        ("xxhash", "xxh3_128"),
        ("xxhash_cbor", "xxh3_128"),
        ("builtin", "xxh3_128"),
        ("xxh3_128", "xxh3_128"),
    ],
)
def test_vllm_hash_algo_spellings_map_onto_ours(vllm_value, ours):
    assert EngineConfig(prefix_caching_hash_algo=vllm_value).prefix_hash_algo == ours
    assert EngineConfig(prefix_hash_algo=vllm_value).prefix_hash_algo == ours
    assert EngineConfig.from_dict({"prefix_caching_hash_algo": vllm_value}).prefix_hash_algo == ours


def test_every_alias_targets_a_real_algorithm():
    assert set(HASH_ALGO_ALIASES.values()) == set(HASH_ALGOS)


@pytest.mark.parametrize("knob", ["prefix_hash_algo", "prefix_caching_hash_algo"])
@pytest.mark.parametrize("value", ["md5", "SHA256", "xxhash64", ""])
def test_unknown_hash_algo_is_refused_naming_the_choices(knob, value):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{knob: value})
    msg = str(info.value)
    assert knob in msg and "xxh3_128" in msg and "sha256_cbor" in msg and repr(value) in msg


def test_conflicting_hash_knobs_are_refused():
    # Refused when ours is not the default (sha256): a default value cannot tell "unset" from "set".
    with pytest.raises(ValueError, match="different algorithms"):
        EngineConfig(prefix_hash_algo="xxh3_128", prefix_caching_hash_algo="sha256_cbor")
    assert EngineConfig(prefix_caching_hash_algo="xxhash").prefix_hash_algo == "xxh3_128"
    cfg = EngineConfig(prefix_hash_algo="sha256", prefix_caching_hash_algo="sha256_cbor")
    assert cfg.prefix_hash_algo == "sha256"
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_hash_alias_on_the_cli():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    cfg = EngineConfig.from_cli_args(parser.parse_args(["--prefix-caching-hash-algo", "sha256_cbor"]))
    assert cfg.prefix_hash_algo == "sha256"
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching-hash-algo", "md5"])


# --- evict_generated_first ---------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, headers, expected",
    [
        ([{"role": "user", "content": "hi"}], {}, False),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
            ],
            {},
            True,
        ),
        ([{"role": "user", "content": "hi"}], {"x-session-id": "s1"}, True),
        (None, {"X-Session-Id": "s1"}, True),
        (None, {"X-Session-Id": ""}, False),
    ],
)
def test_a_conversation_turn_is_a_chat_with_an_answer_in_it_or_a_session_id(messages, headers, expected):
    from prefixserve.replica.engine.request_runner import is_conversation_turn

    assert is_conversation_turn(messages, headers) is expected


def _surviving_answer_block(ckpt: str, *, evict_generated_first: bool, conversation: bool) -> bool:
    """Request C finishes, then A (whose 4 generated tokens fill one block); then a third
    request needs one cached block evicted. True when A's answer block survived it."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    with LLM(
        ckpt, block_size=4, num_kv_blocks=7, eviction_policy="lru", evict_generated_first=evict_generated_first
    ) as llm:
        c_prompt, a_prompt = ([base + i for i in range(8)] for base in (300, 500))
        d_prompt = [700 + i for i in range(12)]
        llm.generate([c_prompt], SamplingParams(temperature=0.0, max_tokens=1))
        (a,) = llm.generate(
            [a_prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), conversation=conversation
        )
        kv = llm.engine.kv_manager
        answer = a_prompt + list(a.outputs[0].token_ids)
        (answer_hash,) = kv.hasher.hash_blocks(answer, 4, None, stop=3)[2:]
        assert answer_hash in kv.pool.hash_to_block
        # C holds 2 cached blocks, A 3; 2 were never cached: D's 3 prompt blocks evict exactly one.
        llm.generate([d_prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return answer_hash in kv.pool.hash_to_block


def test_a_one_shot_answer_is_evicted_before_older_prompts_but_a_conversation_answer_is_kept(ckpt):
    assert not _surviving_answer_block(ckpt, evict_generated_first=True, conversation=False)
    assert _surviving_answer_block(ckpt, evict_generated_first=True, conversation=True)
    assert _surviving_answer_block(ckpt, evict_generated_first=False, conversation=False)  # vLLM's LRU order


# --- protect_static_prefix ---------------------------------------------------------------

_SYSTEM = "You are the support assistant of a bakery. Answer in one short sentence, politely."


def test_the_static_prefix_is_the_system_part_of_the_templated_prompt(ckpt):
    from prefixserve.replica.entrypoints.llm import LLM

    with LLM(ckpt, block_size=4, num_kv_blocks=32) as llm:
        engine = llm.engine
        chat = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "Do you sell rye bread?"}]
        ids = engine.input_processor.encode_chat(chat)
        alone = engine.input_processor.encode_chat(chat[:1], add_generation_prompt=False)
        n = engine.input_processor.static_prefix_tokens(chat, ids)
        assert 0 < n == len(alone) < len(ids) and ids[:n] == alone
        assert engine.input_processor.static_prefix_tokens(chat, ids) == n  # memoized: the same answer
        # Two leading static messages count together; a user-only chat has none.
        two = [chat[0], {"role": "developer", "content": "Never mention prices."}, chat[1]]
        two_ids = engine.input_processor.encode_chat(two)
        assert n < engine.input_processor.static_prefix_tokens(two, two_ids) < len(two_ids)
        assert engine.input_processor.static_prefix_tokens(chat[1:], engine.input_processor.encode_chat(chat[1:])) == 0
        # Another prompt than the one the messages render to: only the common run counts.
        assert engine.input_processor.static_prefix_tokens(chat, ids[:3] + [0] * 20) == 3


def _static_prefix_survives(ckpt: str, protect: bool) -> bool:
    """Chat A (system prompt + question), then one-shot B (no system prompt), both finished;
    then D needs every free block but A's static-prefix ones. True when they all survive."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(
        ckpt,
        block_size=4,
        num_kv_blocks=64,
        eviction_policy="slru",
        protect_static_prefix=protect,
    ) as llm:
        engine, kv = llm.engine, llm.engine.kv_manager
        chat = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "Do you sell rye bread?"}]
        ids = engine.input_processor.encode_chat(chat)
        prefix_blocks = engine.input_processor.static_prefix_tokens(chat, ids) // 4
        prefix_hashes = kv.hasher.hash_blocks(ids, 4, None, stop=prefix_blocks)
        llm.chat(chat, greedy)
        llm.generate([[300 + i for i in range(4 * prefix_blocks + 4)]], greedy)  # B: younger than A
        assert all(h in kv.pool.hash_to_block for h in prefix_hashes)
        need = kv.pool.num_free - prefix_blocks
        llm.generate([[700 + i for i in range(4 * need - 3)]], greedy)  # D: one token free in its last block
        return all(h in kv.pool.hash_to_block for h in prefix_hashes)


def test_a_system_prompt_outlives_younger_one_shot_blocks_only_when_protected(ckpt):
    assert _static_prefix_survives(ckpt, protect=True)
    # slru without the hint: A's prefix entered probation before B's blocks, so it goes first.
    assert not _static_prefix_survives(ckpt, protect=False)


def test_the_request_runner_hands_the_static_prefix_to_the_engine(ckpt):
    """A chat through RequestRunner (what every engine host runs): after one request its
    system prompt's full blocks are protected, its question's are in probation."""
    import asyncio

    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.contract.request import EngineRequest
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.engine.request_runner import RequestRunner
    from prefixserve.replica.sampling_params import SamplingParams

    engine = AsyncEngine(
        EngineConfig.from_dict(
            {
                "model": ckpt,
                "num_kv_blocks": 64,
                "block_size": 4,
                "max_model_len": 256,
            }
        )
    )
    chat = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "Do you sell rye bread today?"}]

    async def ask() -> None:
        request = EngineRequest(messages=chat, sampling=SamplingParams(max_tokens=2, temperature=0))
        async for _ in RequestRunner(engine).generate(request):
            pass

    try:
        asyncio.run(ask())
        llm = engine.engine
        ids = llm.input_processor.encode_chat(chat)
        static = llm.input_processor.static_prefix_tokens(chat, ids) // 4
        pool = llm.kv_manager.pool
        where = [pool._where[pool.hash_to_block[h]] for h in llm.kv_manager.hasher.hash_blocks(ids, 4, None)]
        assert 0 < static < len(where)
        assert where[:static] == [pool._PROTECTED] * static
        assert set(where[static:]) == {pool._PROBATION}
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.parametrize(
    "knob",
    [
        "enable_prefix_caching",
        "calculate_kv_scales",
        "evict_generated_first",
        "protect_static_prefix",
        "enforce_eager",
        "enable_chunked_prefill",
    ],
)
@pytest.mark.parametrize("value", ["maybe", "false", 1, 0.0])
def test_a_switch_that_is_not_a_boolean_is_refused_naming_it(knob, value):
    with pytest.raises(ValueError, match=f"{knob} must be true or false"):
        EngineConfig.from_dict({knob: value})
    assert EngineConfig.from_dict({knob: False}).to_dict()[knob] is False
