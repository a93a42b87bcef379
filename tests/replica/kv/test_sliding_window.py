"""Sliding-window attention: greedy tokens equal to transformers on random Mistral (every
layer windowed) and Qwen2 (``layer_types``: full and windowed layers) checkpoints with
prompts several windows long, under chunked prefill and prefix hits; the
``sliding_window`` knob; blocks outside the window freed as predicted; vLLM's
sliding-window prefix-hit rule in the KV manager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import hf_greedy, random_prompts, save_random_checkpoint, tiny_config_fields

from prefixserve.replica.kv.manager import NULL_BLOCK, KVCacheManager
from prefixserve.replica.sampling_params import SamplingParams

WINDOW = 48
BS = 16


def windowed_checkpoint(path, *, arch: str = "mistral", window: int | None = WINDOW, seed: int = 0, **extra):
    """A random Mistral / Qwen2 checkpoint directory (SmolLM2's tokenizer beside it)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = tiny_config_fields(max_pos=2048, sliding_window=window, **extra)
    if arch == "mistral":
        cfg, cls = MistralConfig(head_dim=16, **common), MistralForCausalLM
    else:
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    return save_random_checkpoint(cls, cfg, path, seed)


def hf_windowed(path, window: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    if window is not None:
        cfg.sliding_window = window
    return AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()


def long_prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = random_prompts(rng, 1, 3 * WINDOW, 3 * WINDOW)[0]  # three windows long
    return random_prompts(rng, n, 5, 2 * WINDOW, shared_prefix=shared)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return str(windowed_checkpoint(tmp_path_factory.mktemp("swa") / "mistral"))


def _greedy(llm, prompts, max_tokens=20):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize(
    "knobs",
    [
        dict(max_num_batched_tokens=40),  # chunked prefill: chunks smaller than the window
        dict(max_num_batched_tokens=1024, attention_backend="torch"),
        dict(max_num_batched_tokens=40, enable_prefix_caching=False, kv_cache_dtype="auto"),
    ],
    ids=["chunked-cpu", "torch", "no-caching"],
)
def test_mistral_greedy_matches_transformers(mistral, knobs):
    from prefixserve.replica.entrypoints.llm import LLM

    prompts = long_prompts(1)
    hf = hf_windowed(mistral)
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    llm = LLM(mistral, num_kv_blocks=96, block_size=BS, max_model_len=1024, **knobs)
    assert llm.engine.model_config.kv_window == WINDOW and llm.engine.max_model_len == 1024 > WINDOW
    got, _ = _greedy(llm, prompts)
    assert got == expected
    # Again: prefix hits (vLLM's window rule), same tokens.
    again, outs = _greedy(llm, prompts)
    assert again == expected
    if knobs.get("enable_prefix_caching", True):
        assert all(o.num_cached_tokens >= 2 * WINDOW for o in outs)
    stats = llm.engine.kv_manager.stats
    assert stats.num_window_freed_blocks > 0 and stats.num_used_blocks == 0
    llm.engine.kv_manager.check_invariants()


def test_hits_need_only_the_blocks_inside_the_window(mistral):
    """A prompt whose early blocks were evicted still hits on its recent, cached ones."""
    from prefixserve.replica.entrypoints.llm import LLM

    prompt = long_prompts(2, n=1)[0]
    hf = hf_windowed(mistral)
    llm = LLM(mistral, num_kv_blocks=24, block_size=BS, max_num_batched_tokens=64)
    assert _greedy(llm, [prompt])[0] == [hf_greedy(hf, prompt, 20)]
    # Other traffic evicts the blocks the window freed first (the prompt's earliest).
    other = random_prompts(np.random.default_rng(9), 1, 14 * BS, 14 * BS)[0]
    _greedy(llm, [other], 1)
    kv = llm.engine.kv_manager
    assert kv.hasher.hash_blocks(prompt, BS, None, stop=1)[0] not in kv.pool.hash_to_block
    got, outs = _greedy(llm, [prompt])
    assert got == [hf_greedy(hf, prompt, 20)]
    assert outs[0].num_cached_tokens == (len(prompt) - 1) // BS * BS  # a hit despite the missing blocks


def test_sliding_window_knob_on_a_full_attention_checkpoint(tmp_path):
    from prefixserve.replica.entrypoints.llm import LLM

    path = windowed_checkpoint(tmp_path / "full", window=None, seed=4)
    prompts = long_prompts(3, n=2)
    hf = hf_windowed(path, window=32)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(str(path), num_kv_blocks=96, block_size=BS, max_num_batched_tokens=40, sliding_window=32)
    assert llm.engine.model_config.kv_window == 32
    assert _greedy(llm, prompts, 16)[0] == expected
    assert LLM(str(path), num_kv_blocks=16).engine.model_config.kv_window is None


def test_qwen2_layer_types_full_and_windowed_layers(tmp_path):
    """Qwen2's max_window_layers: layer 0 full, layer 1 windowed (layer_types); no block is freed."""
    from prefixserve.replica.entrypoints.llm import LLM

    path = windowed_checkpoint(tmp_path / "qwen2", arch="qwen2", seed=5, use_sliding_window=True, max_window_layers=1)
    hf = hf_windowed(path)
    assert list(hf.config.layer_types) == ["full_attention", "sliding_attention"]
    prompts = long_prompts(4, n=2)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(str(path), num_kv_blocks=96, block_size=BS, max_num_batched_tokens=40)
    cfg = llm.engine.model_config
    assert [cfg.window_of(i) for i in range(2)] == [None, WINDOW] and cfg.kv_window is None
    assert _greedy(llm, prompts, 16)[0] == expected
    assert llm.engine.kv_manager.stats.num_window_freed_blocks == 0


def test_blocks_freed_as_predicted_while_decoding(mistral):
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.core import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=mistral, num_kv_blocks=64, block_size=BS, max_num_batched_tokens=512, enable_prefix_caching=False
        )
    )
    prompt = long_prompts(5, n=1)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    kv = engine.kv_manager
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.requests["r"].seqs[0] if "r" in engine.requests else None
        if seq is None or not kv.has_request(seq.seq_id):
            continue
        table = kv.block_table(seq.seq_id)
        # Each allocation first frees the blocks wholly before the window of the first token
        # it allocates for: position 0 for the prefill (one chunk here), then num_computed - 1.
        start = 0 if seq.num_computed_tokens == len(prompt) else seq.num_computed_tokens - 1
        first_needed = max(0, start - WINDOW + 1) // BS
        assert table[:first_needed] == [NULL_BLOCK] * first_needed
        assert NULL_BLOCK not in table[first_needed:]
        assert kv.stats.num_used_blocks == len(table) - first_needed
        kv.check_invariants()
    total = len(prompt) + 40
    # Freed over the run: every block before the window of the last computed token (position total - 2).
    assert kv.stats.num_window_freed_blocks == max(0, total - 2 - WINDOW + 1) // BS


# --- the KV manager's window rules ------------------------------------------------------


def test_manager_frees_outside_the_window_and_hits_by_vllms_rule():
    kv = KVCacheManager(10, block_size=4, sliding_window=6)  # a hit needs the last ceil(5/4) = 2 blocks
    tokens = list(range(100, 126))  # 26 tokens: 6 full blocks + 2
    a = kv.allocate_slots("a", tokens, 26)
    assert NULL_BLOCK not in a  # nothing is freed before the first token is computed
    table = kv.allocate_slots("a", tokens + [7], 1)  # the next token (26) sees 21..26: blocks 0..4 go
    assert table[:5] == [NULL_BLOCK] * 5 and table[5:] == a[5:]
    assert kv.stats.num_window_freed_blocks == 5 and kv.stats.num_used_blocks == 2
    kv.check_invariants()
    # The freed blocks stay cached: a prompt with the same 24 leading tokens hits all 6 full
    # blocks but takes only the 2 inside the window of its first uncomputed token.
    prompt = tokens[:24] + [1, 2, 3]
    blocks, hit = kv.get_computed_blocks(prompt)
    assert hit == 24 and blocks == [NULL_BLOCK] * 4 + a[4:6]
    # Evict a's blocks 4 and 3 (freed first, so at the LRU head after the 3 never-used blocks).
    assert kv.allocate_slots("x", list(range(500, 520)), 20) is not None  # 5 blocks
    cached = [kv.pool.hash_to_block.get(h) for h in kv.hasher.hash_blocks(tokens, 4, None, stop=6)]
    assert cached == a[:3] + [None, None] + a[5:6]
    # The hit ends where the last run of 2 cached blocks ends: blocks 1, 2 (12 tokens).
    blocks, hit = kv.get_computed_blocks(prompt)
    assert hit == 12 and blocks == [NULL_BLOCK] + a[1:3]
    kv.free("x")
    b = kv.allocate_slots("b", prompt, len(prompt) - hit, blocks)
    assert b is not None and b[:3] == [NULL_BLOCK] + a[1:3]
    kv.check_invariants()
    for rid in ("a", "b"):
        kv.free(rid)
    assert kv.usage == 0.0
    kv.check_invariants()


@pytest.mark.parametrize(
    "present, window, expected",
    [
        ("11111", 9, 5),  # need 2: everything
        ("00111", 9, 5),  # the last 2 suffice
        ("11010", 9, 2),  # runs of 1 after the leading run: the hit ends at the leading run
        ("01100", 9, 3),  # a run of 2 ending at block 3
        ("0", 9, 0),
        ("10111", 17, 1),  # need 4: a run of 3 does not suffice; only the leading run hits
        ("01111", 17, 5),  # need 4: the last 4
    ],
)
def test_window_hit_rule(present, window, expected):
    kv = KVCacheManager(8, block_size=4, sliding_window=window)
    cached = [i if c == "1" else None for i, c in enumerate(present)]
    blocks, hit = kv._window_hit(cached)
    assert hit == expected * 4 and len(blocks) == expected
    need = -(-(window - 1) // 4)
    assert blocks[: max(0, expected - need)] == [NULL_BLOCK] * max(0, expected - need)
    assert blocks[max(0, expected - need) :] == list(range(max(0, expected - need), expected))
