"""Bad LoRA input is a clear ValueError and changes nothing: the engine keeps serving, with the
same adapters loaded and the same load count."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from lora_helpers import ALL_MODULES, make_adapter

from prefixserve import LLM, EngineConfig, LoRARequest, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = list(range(40, 70))


@pytest.fixture(scope="module")
def good(ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_adapter(ckpt, tmp_path_factory.mktemp("lora") / "good", targets=ALL_MODULES, rank=8, seed=5)


@pytest.fixture(scope="module")
def llm(ckpt: str, good: str) -> LLM:
    """max_lora_rank 8, with the good adapter loaded once."""
    engine = LLM(ckpt, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    engine.generate([PROMPT], GREEDY, lora_request=LoRARequest("good", 1, good))
    return engine


def _copy(good: str, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _corrupt_weights(path: Path) -> None:
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


BAD_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing config": (lambda p: (p / "adapter_config.json").unlink(), "missing adapter_config.json"),
    "missing weights": (lambda p: (p / "adapter_model.safetensors").unlink(), "missing adapter_model.safetensors"),
    "corrupt config": (lambda p: (p / "adapter_config.json").write_text("{r: 8"), "unreadable adapter_config.json"),
    "corrupt weights": (_corrupt_weights, "unreadable adapter_model.safetensors"),
    "rank above max_lora_rank": (lambda p: _edit_config(p, r=16), "exceeds max_lora_rank=8"),
    "target the model lacks": (
        lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]),
        r"target modules \['c_attn'\]",
    ),
    "DoRA": (lambda p: _edit_config(p, use_dora=True), "DoRA is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_adapter_is_refused_and_changes_nothing(llm: LLM, good: str, tmp_path: Path, case: str) -> None:
    spoil, message = BAD_CASES[case]
    path = _copy(good, tmp_path, "bad")
    spoil(path)
    _refused(llm, good, LoRARequest("bad", 2, str(path)), message)


def test_missing_directory_is_refused(llm: LLM, good: str, tmp_path: Path) -> None:
    _refused(llm, good, LoRARequest("ghost", 2, str(tmp_path / "nowhere")), "no such directory")


def test_adapter_of_another_base_model_is_refused(
    llm: LLM, good: str, tiny_ckpts: Callable[..., str], tmp_path: Path
) -> None:
    """Shapes are checked strictly: an adapter trained on a model with another MLP width."""
    other = make_adapter(tiny_ckpts(intermediate=96), tmp_path / "other", targets=ALL_MODULES, rank=8)
    _refused(llm, good, LoRARequest("other", 2, other), "do not fit the model's projection")


def test_target_module_outside_the_projections_is_refused(llm: LLM, good: str, ckpt: str, tmp_path: Path) -> None:
    """An adapter on the LM head, which the engine does not adapt."""
    head = make_adapter(ckpt, tmp_path / "head", targets=["q_proj", "lm_head"], rank=8)
    _refused(llm, good, LoRARequest("head", 2, head), "lm_head")


def test_one_name_names_one_adapter(llm: LLM, tmp_path: Path, good: str) -> None:
    copy = _copy(good, tmp_path, "copy")
    _refused(llm, good, LoRARequest("good", 1, str(copy)), "already names")


def test_lora_request_without_enable_lora_is_refused(ckpt: str, good: str) -> None:
    plain = LLM(ckpt, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([PROMPT], GREEDY, lora_request=LoRARequest("good", 1, good))
    assert not plain.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"max_loras": 0}, "max_loras must be at least 1"),
        ({"max_lora_rank": 0}, "max_lora_rank must be at least 1"),
        ({"max_loras": 3, "max_cpu_loras": 2}, "max_cpu_loras"),
    ],
)
def test_lora_knobs_are_checked(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**knobs)


@pytest.mark.parametrize(("args", "message"), [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id")])
def test_lora_request_fields_are_checked(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def _refused(llm: LLM, good: str, request: LoRARequest, message: str) -> None:
    manager = llm.engine.runner.lora
    assert manager is not None
    before = (manager.num_loads, manager.loaded, manager.resident)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT], GREEDY, lora_request=request)
    assert (manager.num_loads, manager.loaded, manager.resident) == before
    assert not llm.engine.has_unfinished_requests()
    # Still serving, base and adapter alike.
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("good", 1, good))[0].outputs
    assert manager.num_loads == before[0]
