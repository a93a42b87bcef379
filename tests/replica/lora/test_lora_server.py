"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules`` at start, a request picks an
adapter by ``model``, ``/v1/models`` lists adapters with their ``parent``, and the runtime
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` behind vLLM's opt-in."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import ALL_MODULES, make_adapter, peft_greedy
from server_helpers import InProcessReplica, assert_openai_error

from prefixserve import LLM, LoRARequest, SamplingParams
from prefixserve.replica.entrypoints.openai.lora_endpoints import RUNTIME_LORA_ENV

MAX_TOKENS = 6
PROMPT = [5, 9, 14, 23, 42, 77, 101, 130, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def adapters(ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served-loras")
    return {
        "all": make_adapter(ckpt, root / "all", targets=ALL_MODULES, rank=8, seed=11),
        "qv": make_adapter(ckpt, root / "qv", targets=["q_proj", "v_proj"], rank=4, alpha=8, seed=12),
    }


@pytest.fixture(scope="module")
def replica(ckpt: str, adapters: dict[str, str]):
    r = InProcessReplica(
        ckpt,
        engine_kwargs={
            "enable_lora": True,
            "max_lora_rank": 8,
            "max_loras": 2,
            "lora_modules": [f"all={adapters['all']}"],
        },
        allow_runtime_lora_updating=True,
    )
    yield r
    r.close()


def _complete(replica: InProcessReplica, model: str):
    return replica.request(
        "POST", "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    )


def test_a_request_picks_a_served_adapter_by_model_and_gets_its_tokens(replica, ckpt: str, adapters) -> None:
    base_name = replica.request("GET", "/v1/models").json()["data"][0]["id"]
    with_adapter = _complete(replica, "all")
    base = _complete(replica, base_name)
    assert with_adapter.status_code == base.status_code == 200, (with_adapter.text, base.text)
    assert with_adapter.json()["model"] == "all" and base.json()["model"] == base_name
    # The offline engine's tokens with the adapter equal peft's (test_lora_engine.py); its text here.
    llm = LLM(ckpt, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    offline = llm.generate([PROMPT], greedy, lora_request=LoRARequest("all", 1, adapters["all"]))[0].outputs[0]
    assert offline.token_ids == peft_greedy(ckpt, adapters["all"], [PROMPT], MAX_TOKENS)[0]
    assert with_adapter.json()["choices"][0]["text"] == offline.text
    assert with_adapter.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]


def test_models_lists_adapters_with_their_parent(replica, adapters) -> None:
    data = replica.request("GET", "/v1/models").json()["data"]
    base, *rest = data
    assert base.get("parent") is None
    assert [(c["id"], c["root"], c["parent"]) for c in rest] == [("all", adapters["all"], base["id"])]


def test_an_unknown_model_is_a_404_naming_what_is_served(replica) -> None:
    error = assert_openai_error(_complete(replica, "nope"))
    assert error["code"] == "model_not_found" and "'all'" in error["message"]


def test_runtime_load_and_unload(replica, ckpt: str, adapters, tmp_path: Path) -> None:
    load = replica.request("POST", "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["qv"]})
    assert load.status_code == 200 and "qv" in load.text
    assert _complete(replica, "qv").status_code == 200
    assert [c["id"] for c in replica.request("GET", "/v1/models").json()["data"][1:]] == ["all", "qv"]
    again = replica.request("POST", "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["qv"]})
    assert assert_openai_error(again)["code"] == "invalid_lora_adapter"
    unload = replica.request("POST", "/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert unload.status_code == 200
    assert assert_openai_error(_complete(replica, "qv"))["code"] == "model_not_found"
    missing = replica.request("POST", "/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert missing.status_code == 404
    # The name stays bound to its adapter (the KV cache is keyed by name): the same path loads again.
    other = replica.request("POST", "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["all"]})
    assert other.status_code == 400 and "one name, one adapter" in other.json()["error"]["message"]
    back = replica.request("POST", "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": adapters["qv"]})
    assert back.status_code == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"lora_name": "big", "lora_path": "RANK16"}, "rank"),
        ({"lora_name": "gone", "lora_path": "/no/such/adapter"}, ""),
        ({"lora_name": "all", "lora_path": "SAME"}, "already served"),
        ({"lora_name": "x"}, "lora_path"),
    ],
)
def test_a_bad_load_is_a_400_that_changes_nothing(replica, ckpt: str, adapters, tmp_path: Path, body, fragment) -> None:
    if body.get("lora_path") == "RANK16":
        body = {**body, "lora_path": make_adapter(ckpt, tmp_path / "r16", targets=["q_proj"], rank=16, seed=3)}
    if body.get("lora_path") == "SAME":
        body = {**body, "lora_path": adapters["all"]}
    before = replica.request("GET", "/v1/models").json()["data"]
    error = assert_openai_error(replica.request("POST", "/v1/load_lora_adapter", json=body))
    assert fragment in error["message"]
    after = replica.request("GET", "/v1/models").json()["data"]
    assert [c["id"] for c in after] == [c["id"] for c in before]


def test_the_runtime_endpoints_are_off_without_the_opt_in(ckpt: str, adapters, monkeypatch) -> None:
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    r = InProcessReplica(ckpt, engine_kwargs={"enable_lora": True, "max_lora_rank": 8})
    try:
        body = {"lora_name": "qv", "lora_path": adapters["qv"]}
        assert r.request("POST", "/v1/load_lora_adapter", json=body).status_code == 404
    finally:
        r.close()
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    r = InProcessReplica(ckpt, engine_kwargs={"enable_lora": True, "max_lora_rank": 8})
    try:
        assert r.request("POST", "/v1/load_lora_adapter", json=body).status_code == 200
    finally:
        r.close()


def test_lora_modules_need_enable_lora_and_name_equals_path() -> None:
    from prefixserve.replica.config import EngineConfig

    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(model="m", lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(model="m", enable_lora=True, lora_modules=["just-a-path"])
    with pytest.raises(ValueError, match="twice"):
        EngineConfig(model="m", enable_lora=True, lora_modules=["a=/x", "a=/y"])


def test_metrics_name_the_adapters_in_use_and_held(replica) -> None:
    assert _complete(replica, "all").status_code == 200
    text = replica.request("GET", "/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    loaded = [line for line in text.splitlines() if line.startswith("prefixserve:lora_adapters_loaded{")]
    assert loaded and float(loaded[0].rsplit(" ", 1)[1]) >= 1
    # Which adapters are held, as the standalone router reads them, and the loads counted.
    from prefixserve.router.standalone.load_report import parse_load

    load = parse_load(text)
    assert load is not None and "all" in load.adapters and load.adapter_capacity >= 2, load
    loads = [line for line in text.splitlines() if line.startswith("prefixserve:lora_adapter_loads_total")]
    assert loads and float(loads[0].rsplit(" ", 1)[1]) >= 1, loads


def test_adapters_loaded_at_start_are_counted_and_named_before_any_request(ckpt: str, adapters) -> None:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    llm = LLM(ckpt, enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1, lora_modules=modules)
    registry = llm.engine.metrics.registry
    assert registry.get_sample_value("prefixserve:lora_adapter_loads_total") == 2
    # One held (max_cpu_loras 1): the last loaded, named with the capacity.
    assert registry.get_sample_value(
        "prefixserve:lora_adapters_loaded_info", {"loaded_lora_adapters": "qv", "max_cpu_loras": "1"}
    )
    llm.generate([PROMPT], SamplingParams(max_tokens=2), lora_request=LoRARequest("all", 1, adapters["all"]))
    assert registry.get_sample_value("prefixserve:lora_adapter_loads_total") == 3
