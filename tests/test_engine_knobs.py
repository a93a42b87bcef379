"""Engine knobs of issue 16: vLLM's hash-algorithm spellings (config, dict, CLI, LLM)."""

from __future__ import annotations

import argparse

import pytest

from prefixserve.replica.config import HASH_ALGO_ALIASES, HASH_ALGOS, EngineConfig


@pytest.mark.parametrize("vllm_value, ours", [
    ("sha256", "sha256"), ("sha256_cbor", "sha256"), ("sha256_cbor_64bit", "sha256"),
    ("xxhash", "xxh3_128"), ("xxhash_cbor", "xxh3_128"), ("builtin", "xxh3_128"),
    ("xxh3_128", "xxh3_128"),
])
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
    with pytest.raises(ValueError, match="different algorithms"):
        EngineConfig(prefix_hash_algo="sha256", prefix_caching_hash_algo="xxhash")
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
