"""The layer benchmark: its cases, the tensors both sides build, and a short run of our kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixserve.loadtest import bench_layers as BL
from prefixserve.loadtest.peers import vllm_layer_ops as peer


def small_config(tmp_path, **extra) -> BL.LayersConfig:
    settings = dict(
        decode_batches=(1, 2),
        prefill_chunks=(8,),
        contexts=(32,),
        samples=1,
        min_sample_ms=0.05,
        copies=2,
        out=str(tmp_path / "layers.json"),
    )
    return BL.LayersConfig(**{**settings, **extra})


def test_every_case_has_its_own_id_and_the_lm_head_runs_only_at_decode_batches(tmp_path):
    config = small_config(tmp_path)
    cases = BL.cases(config, BL.model_shape())
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids))
    assert {c["m"] for c in cases if c["op"] == "linear" and c["name"] == "lm_head"} == {1, 2}
    assert {c["m"] for c in cases if c["op"] == "linear" and c["name"] == "qkv"} == {1, 2, 8}
    assert {c["op"] for c in cases} == {"linear", "attention", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul"}
    prefill = [c for c in cases if c["op"] == "attention" and c["query_len"] > 1]
    assert [(c["query_len"], c["context"]) for c in prefill] == [(8, 8 + BL.PREFILL_CACHED)]


def test_the_peer_loads_the_same_case_code_by_its_path():
    """vLLM's side (peers/vllm_layer_ops.py) imports nothing of ours: it loads harness/layer_cases.py
    by path, and must find the very code the benchmark uses."""
    from prefixserve.loadtest.harness import layer_cases

    loaded = peer.load_cases()
    assert Path(loaded.__file__).resolve() == Path(layer_cases.__file__).resolve()
    model = BL.model_shape()
    case = {"id": "x", "op": "attention", "seqs": 2, "query_len": 1, "context": 8}
    ours, theirs = BL.case_tensors(torch, case, model, 3), loaded.case_tensors(torch, case, model, 3)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_rotating_calls_each_copy_in_turn():
    calls = []
    rotate = BL.rotating([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(4):
        rotate()
    assert calls == [0, 1, 2, 0]


def test_a_short_run_of_our_kernels_times_every_case_and_adds_up_a_decode_step(tmp_path):
    config = small_config(tmp_path)
    assert BL.main([*cli(config)]) == 0
    report = json.loads((tmp_path / "layers.json").read_text())
    cases = report["cases"]
    assert len(cases) == len(BL.cases(config, BL.model_shape()))
    for case in cases:
        assert case["engine_s"] > 0 and case["best_s"] <= case["engine_s"]
        assert case["engine"].startswith("engine")
        assert "vllm_s" not in case
    steps = report["decode_steps"]
    assert [(s["batch"], s["context"]) for s in steps] == [(1, 32), (2, 32)]
    by_id = {c["id"]: c for c in cases}
    layer = sum(
        by_id[i]["engine_s"]
        for i in (
            "linear qkv m=1",
            "linear o m=1",
            "linear gate_up m=1",
            "linear down m=1",
            "add_rms_norm m=1",
            "add_rms_norm m=1",
            "rotary m=1",
            "silu_and_mul m=1",
            "attention decode 1x32",
        )
    )
    once = by_id["add_rms_norm m=1"]["engine_s"] + by_id["linear lm_head m=1"]["engine_s"]
    assert steps[0]["engine_s"] == pytest.approx(30 * layer + once)
    assert steps[0]["vllm_s"] is None


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="positive"):
        small_config(tmp_path, contexts=())
    with pytest.raises(ValueError, match="powers of two"):
        small_config(tmp_path, block_size=24)
    with pytest.raises(SystemExit):
        BL.main(["--copies", "0"])


def cli(config: BL.LayersConfig) -> list[str]:
    return [
        "--decode-batches",
        *map(str, config.decode_batches),
        "--prefill-chunks",
        *map(str, config.prefill_chunks),
        "--contexts",
        *map(str, config.contexts),
        "--samples",
        str(config.samples),
        "--min-sample-ms",
        str(config.min_sample_ms),
        "--copies",
        str(config.copies),
        "--out",
        config.out,
    ]
