"""LoRA adapters in the engine, offline: tokens equal transformers + peft, adapters mixed with the
base model in one batch, their own prefix-cache blocks, residency and loading."""

import numpy as np
import pytest
from lora_helpers import ALL_MODULES, make_adapter, peft_greedy
from model_helpers import random_prompts

from prefixserve import LLM, LoRARequest, SamplingParams
from prefixserve.replica.kv.hashing import BlockKeys, hash_blocks

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    """Three adapters of the shared checkpoint: every projection (rank 8), attention q/v only
    (rank 4), the MLP only (rank 8, rsLoRA scaling)."""
    root = tmp_path_factory.mktemp("loras")
    paths = {
        "all": make_adapter(ckpt, root / "all", targets=ALL_MODULES, rank=8, seed=1),
        "qv": make_adapter(ckpt, root / "qv", targets=["q_proj", "v_proj"], rank=4, alpha=8, seed=2),
        "mlp": make_adapter(
            ckpt, root / "mlp", targets=["gate_proj", "up_proj", "down_proj"], rank=8, seed=3, use_rslora=True
        ),
    }
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def _engine(ckpt: str, **knobs) -> LLM:
    return LLM(ckpt, enable_lora=True, max_lora_rank=8, num_kv_blocks=256, **knobs)


def _prompts(seed: int, n: int, lo: int = 20) -> list[list[int]]:
    return random_prompts(np.random.default_rng(seed), n, lo, 44)


def test_mixed_batch_equals_peft_with_prefix_hits_and_chunked_prefill(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int
) -> None:
    """Base, three adapters, each twice, in one generate call; then prompts sharing each first
    prompt's first 32 tokens, which hit the two blocks the first call left, with chunked prefill."""
    names = [None, "all", "qv", "mlp"]
    first = _prompts(seed, 2 * len(names), lo=36)
    second = [first[i][:32] + p[:10] for i, p in enumerate(_prompts(seed + 1, len(names)))]
    loras = [None if n is None else adapters[n] for n in names]
    llm = _engine(ckpt, max_loras=4, max_num_batched_tokens=24)
    out1 = llm.generate(first, GREEDY, lora_request=loras * 2)
    out2 = llm.generate(second, GREEDY, lora_request=loras)
    for i, name in enumerate(names):
        path = None if name is None else adapters[name].lora_path
        expected = peft_greedy(ckpt, path, [first[i], first[i + len(names)], second[i]], MAX_TOKENS)
        got = [out1[i], out1[i + len(names)], out2[i]]
        assert [o.outputs[0].token_ids for o in got] == expected, name
    # The second call's prompts hit their own adapter's blocks: two full blocks of 16.
    assert [o.num_cached_tokens for o in out2] == [32] * len(names)
    # Each adapter changes the tokens: the comparison above could not pass by ignoring adapters.
    base = out1[0].outputs[0].token_ids
    assert all(out1[i].outputs[0].token_ids != base for i in range(1, len(names)))


@pytest.mark.parametrize("size", [2, 4])  # 4: one query head a rank, the 2 KV heads replicated
def test_tensor_parallel_ranks_hold_their_shard_of_each_adapter_and_the_tokens_equal_peft(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int, size: int
) -> None:
    """Base and three adapters mixed in one batch, over 2 and 4 ranks, with prefix hits and chunked
    prefill: each rank's slots hold its cut of every adapter (column-parallel B rows, row-parallel A
    columns), and the tokens are peft's."""
    names = [None, "all", "qv", "mlp"]
    first = _prompts(seed, len(names), lo=36)
    second = [first[i][:32] + p[:10] for i, p in enumerate(_prompts(seed + 1, len(names)))]
    loras = [None if n is None else adapters[n] for n in names]
    with _engine(ckpt, max_loras=4, max_num_batched_tokens=24, tensor_parallel_size=size) as llm:
        out1 = llm.generate(first, GREEDY, lora_request=loras)
        out2 = llm.generate(second, GREEDY, lora_request=loras)
    for i, name in enumerate(names):
        path = None if name is None else adapters[name].lora_path
        expected = peft_greedy(ckpt, path, [first[i], second[i]], MAX_TOKENS)
        assert [out1[i].outputs[0].token_ids, out2[i].outputs[0].token_ids] == expected, name
    assert [o.num_cached_tokens for o in out2] == [32] * len(names)


def test_adapter_name_enters_block_hashes(ckpt: str, adapters: dict[str, LoRARequest], seed: int) -> None:
    """Same prompt, different adapters: no hit across them (their KV differs); same adapter: a hit."""
    prompt = _prompts(seed, 1)[0][:20] + list(range(100, 120))
    llm = _engine(ckpt, max_loras=2)

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate([prompt], GREEDY, lora_request=lora)[0].num_cached_tokens

    assert cached(adapters["all"]) == 0
    assert cached(adapters["qv"]) == 0
    assert cached(None) == 0
    assert cached(adapters["all"]) == 32
    assert cached(adapters["qv"]) == 32
    assert cached(None) == 32


def test_block_keys_are_contract_two_extra_keys() -> None:
    tokens = list(range(40))
    keyed = hash_blocks(tokens, 16, BlockKeys("salt", ("adapter",)))
    assert keyed == hash_blocks(tokens, 16, "salt", extra_keys=["adapter"])
    assert keyed != hash_blocks(tokens, 16, "salt")
    assert hash_blocks(tokens, 16, BlockKeys()) == hash_blocks(tokens, 16)


def test_more_adapters_than_slots_wait_their_turn(ckpt: str, adapters: dict[str, LoRARequest], seed: int) -> None:
    """max_loras=1: the three adapters' requests run one adapter at a time, with the base beside."""
    names = ["all", None, "qv", "mlp", "all"]
    prompts = _prompts(seed, len(names))
    loras = [None if n is None else adapters[n] for n in names]
    llm = _engine(ckpt, max_loras=1, max_cpu_loras=3)
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        path = None if name is None else adapters[name].lora_path
        assert out.outputs[0].token_ids == peft_greedy(ckpt, path, [prompt], MAX_TOKENS)[0], name


def test_cpu_residency_is_lru_and_loads_are_counted(ckpt: str, adapters: dict[str, LoRARequest], seed: int) -> None:
    llm = _engine(ckpt, max_loras=1, max_cpu_loras=2)
    manager = llm.engine.runner.lora
    assert manager is not None
    prompt = _prompts(seed, 1)
    expected = {}
    for name, loads, loaded in [
        ("all", 1, ["all"]),
        ("qv", 2, ["all", "qv"]),
        ("all", 2, ["qv", "all"]),  # in memory: used again, no load
        ("mlp", 3, ["all", "mlp"]),  # evicts the least recently used, qv
        ("qv", 4, ["mlp", "qv"]),  # loaded again from its path
    ]:
        out = llm.generate(prompt, GREEDY, lora_request=adapters[name])[0].outputs[0].token_ids
        assert (manager.num_loads, manager.loaded) == (loads, loaded), name
        assert expected.setdefault(name, out) == out  # a reloaded adapter gives the same tokens


def test_lora_knob_without_adapters_changes_no_token(ckpt: str, seed: int) -> None:
    prompts = _prompts(seed, 3)
    with_lora = _engine(ckpt, max_loras=2).generate(prompts, GREEDY)
    without = LLM(ckpt, num_kv_blocks=256).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in with_lora] == [o.outputs[0].token_ids for o in without]


def test_lora_request_per_prompt_count_is_checked(ckpt: str, adapters: dict[str, LoRARequest]) -> None:
    llm = _engine(ckpt)
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate(_prompts(0, 3), GREEDY, lora_request=[adapters["all"], None])


@pytest.mark.parametrize("knobs", [{"async_scheduling": True}, {"enforce_eager": False}])
def test_async_scheduling_and_static_decode_path_keep_the_tokens(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int, knobs: dict
) -> None:
    """Slots reassigned while a step is in flight (async_scheduling, two slots for three adapters),
    and the static decode path beside eager adapter steps: the synchronous eager engine's tokens."""
    names = ["all", None, "qv", "mlp", None, "qv", "all"]
    prompts = _prompts(seed, len(names))
    loras = [None if n is None else adapters[n] for n in names]
    expected = _engine(ckpt, max_loras=2).generate(prompts, GREEDY, lora_request=loras)
    got = _engine(ckpt, max_loras=2, **knobs).generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_preempted_adapter_requests_keep_their_tokens(ckpt: str, adapters: dict[str, LoRARequest], seed: int) -> None:
    """Too few blocks for the batch: sequences are preempted and recomputed, re-admitted through
    their adapter's block hashes, with the tokens of an engine that had room."""
    names = ["all", "qv", None, "mlp", "all", "qv"]
    prompts = _prompts(seed, len(names), lo=36)
    loras = [None if n is None else adapters[n] for n in names]
    roomy = _engine(ckpt, max_loras=3).generate(prompts, GREEDY, lora_request=loras)
    tight = LLM(ckpt, enable_lora=True, max_lora_rank=8, max_loras=3, num_kv_blocks=10)
    got = tight.generate(prompts, GREEDY, lora_request=loras)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]


def test_triton_backend_applies_adapters_with_the_triton_kernels(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int
) -> None:
    """The Triton backend's model (its attention, layer ops and LoRA kernels, under the interpreter
    here) gives the torch path's tokens, adapters and base mixed."""
    from prefixserve.replica.lora.slots import _torch_op

    names = ["all", None, "mlp"]
    prompts = [p[:12] for p in _prompts(seed, len(names))]
    loras = [None if n is None else adapters[n] for n in names]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    expected = _engine(ckpt, max_loras=2, attention_backend="torch").generate(prompts, params, lora_request=loras)
    triton = _engine(ckpt, max_loras=2, attention_backend="triton")
    slots = triton.engine.runner.shard.lora_slots
    assert slots is not None and slots.shared.op is not _torch_op
    got = triton.generate(prompts, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_an_adapter_a_live_request_uses_is_never_evicted_so_its_files_may_go(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int, tmp_path
) -> None:
    """max_cpu_loras=1 with three adapters' requests in flight and one slot: each waits its turn
    in memory, not on disk. Their files are gone before the first step, and every request still
    gets its adapter's tokens; once they finish, residency shrinks back to max_cpu_loras."""
    import shutil

    copies = {}
    for name, request in adapters.items():
        path = tmp_path / name
        shutil.copytree(request.lora_path, path)
        copies[name] = LoRARequest(f"{name}-copy", request.lora_int_id + 10, str(path))
    llm = _engine(ckpt, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.runner.lora
    assert manager is not None
    names = ["all", "qv", "mlp"]
    prompts = _prompts(seed, len(names))
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        llm.engine.add_request(str(i), prompt, GREEDY, lora_request=copies[name])
    assert sorted(manager.loaded) == sorted(f"{n}-copy" for n in names)  # all in use: none evicted
    for name in names:
        shutil.rmtree(tmp_path / name)
    done = {}
    while llm.engine.has_unfinished_requests():
        for update in llm.engine.step():
            assert update.error is None, update.error
            if update.output is not None:
                done[update.request_id] = update.output.outputs[0].token_ids
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        assert done[str(i)] == peft_greedy(ckpt, adapters[name].lora_path, [prompt], MAX_TOKENS)[0], name
    assert manager.num_loads == 3
    llm.engine.add_request("next", prompts[0], GREEDY, lora_request=adapters["all"])
    assert manager.loaded == ["all"]  # nothing in use any more: back to one


def test_unloading_an_adapter_lets_its_requests_in_flight_finish_with_it(
    ckpt: str, adapters: dict[str, LoRARequest], seed: int, tmp_path
) -> None:
    """Two served adapters take turns in one slot; one is unloaded and its files removed while its
    requests are in flight: they finish with its tokens (held in memory, never read again)."""
    import shutil

    shutil.copytree(adapters["qv"].lora_path, tmp_path / "qv")
    llm = _engine(ckpt, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    qv = engine.load_lora_adapter("qv-served", str(tmp_path / "qv"))
    every = engine.load_lora_adapter("all-served", adapters["all"].lora_path)
    names = ["qv", "all", "qv"]
    prompts = _prompts(seed, len(names))
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, lora_request=qv if name == "qv" else every)
    engine.step()
    engine.unload_lora_adapter("qv-served")
    shutil.rmtree(tmp_path / "qv")
    assert "qv-served" not in engine.lora_adapters
    done = {}
    while engine.has_unfinished_requests():
        for update in engine.step():
            assert update.error is None, update.error
            if update.output is not None:
                done[update.request_id] = update.output.outputs[0].token_ids
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        assert done[str(i)] == peft_greedy(ckpt, adapters[name].lora_path, [prompt], MAX_TOKENS)[0], name
    with pytest.raises(KeyError):
        engine.unload_lora_adapter("qv-served")
