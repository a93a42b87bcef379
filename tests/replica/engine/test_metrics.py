"""The engine's Prometheus series: vLLM V1's names, types, labels and request accounting.

A real engine on a tiny random checkpoint serves a few requests; the test reads
its registry as Prometheus would (the text exposition, parsed back).
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.engine.metrics import build_1_2_5_buckets
from prefixserve.replica.sampling_params import SamplingParams

# vLLM V1's families (vllm/v1/metrics/loggers.py) and their types, as a scraper sees them.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:gpu_prefix_cache_hit_rate": "gauge",
    "prefixserve:engine_restarts": "counter",
}


@pytest.fixture(scope="module")
def engine(ckpt):
    return LLMEngine(
        EngineConfig(model=ckpt, served_model_name="tiny", num_kv_blocks=64, block_size=16, max_model_len=256)
    )


def _families(engine: LLMEngine) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(engine.metrics.registry).decode())}


def _value(engine: LLMEngine, name: str, **labels: str) -> float:
    value = engine.metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
    assert value is not None, f"{name} {labels} missing"
    return value


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_series_names_types_and_labels(engine):
    shared = list(range(100, 148))  # three full blocks
    engine.add_request("a", shared + [7, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    _run(engine)
    engine.add_request("b", shared + [9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    _run(engine)
    families = _families(engine)
    for name, kind in VLLM_FAMILIES.items():
        assert name in families, f"{name} is not exported"
        assert families[name].type == kind, f"{name} is a {families[name].type}, vLLM's is a {kind}"
        for sample in families[name].samples:
            assert sample.labels.get("engine") == "0", (name, sample.labels)
            if name != "vllm:cache_config_info":
                assert sample.labels.get("model_name") == "tiny", (name, sample.labels)
    # The second request found the shared blocks: hits over queries in [0, 1] and positive.
    assert 0 < _value(engine, "vllm:prefix_cache_hits_total") <= _value(engine, "vllm:prefix_cache_queries_total")
    assert _value(engine, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(engine, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(engine, "vllm:request_generation_tokens_sum") == 8
    assert _value(engine, "vllm:request_prompt_tokens_sum") == 50 + 49
    assert _value(engine, "vllm:generation_tokens_total") == 8
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _value(engine, f"vllm:request_{phase}_time_seconds_count") == 2
        assert _value(engine, f"vllm:request_{phase}_time_seconds_sum") >= 0
    # Every model step is one observation, and its tokens add up to what was computed.
    iterations = _value(engine, "vllm:iteration_tokens_total_count")
    assert iterations >= 8  # at least one step per generated token
    assert _value(engine, "vllm:iteration_tokens_total_sum") == (
        _value(engine, "vllm:prompt_tokens_total") + _value(engine, "vllm:generation_tokens_total")
    )
    info = [s for s in families["vllm:cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "64"
    assert info[0].labels["enable_prefix_caching"] == "True"


def test_aborted_requests_count_as_abort(engine):
    before = _value(engine, "vllm:request_success_total", finished_reason="abort")
    finished_before = _value(engine, "vllm:e2e_request_latency_seconds_count")
    engine.add_request("gone", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort_request("gone")
    assert _value(engine, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert _value(engine, "vllm:e2e_request_latency_seconds_count") == finished_before


def test_token_buckets_follow_vllm():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
