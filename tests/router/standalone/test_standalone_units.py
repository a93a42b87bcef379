"""The standalone router's pure parts: replica health transitions, load reports, the decision and its retries."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from prefixserve.router.cli import main
from prefixserve.router.policies import KIND_FALLBACK, KIND_NO_KEY, KIND_OWNER, ReplicaLoad, make_policy
from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import prefix_hash
from prefixserve.router.standalone.config import StandaloneRouterConfig, replica_name
from prefixserve.router.standalone.load_report import parse_load
from prefixserve.router.standalone.replica_set import ADMITTED, EJECTED, ReplicaSet, corrected_load
from prefixserve.router.standalone.routing import StandaloneRouting
from prefixserve.router.standalone.usage import JSON_BODY_BYTES, SSE_TAIL_BYTES, AnswerTail, Usage, usage_of

URLS = {"a:1": "http://a:1", "b:2": "http://b:2", "c:3": "http://c:3"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- health -----------------------------------------------------------------------------------------


def test_ejected_after_n_failed_probes_in_a_row_and_admitted_after_m_good_ones() -> None:
    rs = ReplicaSet(URLS, unhealthy_after=3, healthy_after=2)
    assert [rs.probe("a:1", False), rs.probe("a:1", False)] == [None, None]
    assert rs.probe("a:1", True) is None  # a good probe resets the failures
    assert [rs.probe("a:1", False) for _ in range(2)] == [None, None]
    assert rs.probe("a:1", False) == EJECTED
    assert "a:1" not in rs.admitted()
    assert [c.name for c in rs.candidates()] == ["b:2", "c:3"]
    assert rs.probe("a:1", True) is None
    assert rs.probe("a:1", False) is None  # a failure resets the good count
    assert rs.probe("a:1", True) is None
    assert rs.probe("a:1", True) == ADMITTED
    assert rs.admitted() == ["a:1", "b:2", "c:3"]


def test_a_replica_that_died_under_a_request_is_ejected_at_once() -> None:
    rs = ReplicaSet(URLS, unhealthy_after=3, healthy_after=1)
    rs.report_load("b:2", ReplicaLoad(num_running=4))
    assert rs.died("b:2") == EJECTED
    assert rs.died("b:2") is None  # already out
    assert rs.load("b:2") is None  # its old report is dropped with it
    assert [c.name for c in rs.candidates()] == ["a:1", "c:3"]
    assert rs.probe("b:2", True) == ADMITTED


def test_every_replica_is_a_candidate_while_none_is_admitted() -> None:
    rs = ReplicaSet(URLS, unhealthy_after=1)
    for name in URLS:
        rs.died(name)
    assert [c.name for c in rs.candidates()] == list(URLS)
    assert [c.name for c in rs.candidates(["c:3"])] == ["c:3"]


# -- load -------------------------------------------------------------------------------------------

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
vllm:num_requests_running_total 1000
"""


def test_vllm_gauges_parse_summed_over_label_sets() -> None:
    assert parse_load(VLLM_TEXT) == ReplicaLoad(num_waiting=7, num_running=5, kv_usage=0.25)


def test_sglang_gauges_parse() -> None:
    text = (
        'sglang:num_running_reqs{model_name="x"} 4\nsglang:num_queue_reqs{model_name="x"} 1\nsglang:token_usage 0.5\n'
    )
    assert parse_load(text) == ReplicaLoad(num_waiting=1, num_running=4, kv_usage=0.5)


def test_the_adapters_a_replica_holds_are_read_from_prefixserve_and_vllm_info_series() -> None:
    text = (
        'vllm:num_requests_running{model_name="x"} 1\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
        'prefixserve:lora_adapters_loaded_info{loaded_lora_adapters="d,a"} 1.0\n'
        'vllm:other_info{running_lora_adapters="not-this"} 1\n'
    )
    assert parse_load(text) == ReplicaLoad(num_running=1, adapters=frozenset("abcd"), adapter_capacity=2)
    ours = text.replace('loaded_lora_adapters="d,a"', 'loaded_lora_adapters="d,a",max_cpu_loras="6"')
    assert parse_load(ours) == ReplicaLoad(num_running=1, adapters=frozenset("abcd"), adapter_capacity=6)
    empty = (
        "vllm:num_requests_running 0\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1\n'
    )
    assert parse_load(empty) == ReplicaLoad(adapter_capacity=2)


def test_the_kv_capacity_is_read_from_the_cache_settings() -> None:
    text = (
        "vllm:num_requests_running 0\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'num_gpu_blocks="119",swap_space="4.0"} 1.0\n'
    )
    assert parse_load(text) == ReplicaLoad(kv_capacity_tokens=119 * 16)
    unknown = text.replace('num_gpu_blocks="119"', 'num_gpu_blocks="None"')
    assert parse_load(unknown) == ReplicaLoad()


def test_text_without_request_gauges_reports_no_load() -> None:
    assert parse_load("# nothing\nprocess_cpu_seconds_total 12\nvllm:num_requests_running NaN\n") is None
    assert parse_load("") is None


def test_a_report_is_corrected_by_the_routers_own_change_and_ages_out() -> None:
    clock = Clock()
    rs = ReplicaSet(URLS, load_max_age_s=5.0, clock=clock)
    rs.started("a:1")
    rs.report_load("a:1", ReplicaLoad(num_waiting=1, num_running=2))
    rs.started("a:1")  # one more sent since the report: it waits there
    assert rs.load("a:1") == ReplicaLoad(num_waiting=2, num_running=2)
    rs.ended("a:1")
    rs.ended("a:1")  # two ended since: off waiting first, then running
    assert rs.load("a:1") == ReplicaLoad(num_waiting=0, num_running=2)
    assert corrected_load(ReplicaLoad(num_waiting=0, num_running=1), 3, 0) == ReplicaLoad()
    clock.now = 5.5
    assert rs.load("a:1") is None


# -- the decision -----------------------------------------------------------------------------------


def chat(system: str | None, user: str = "hi") -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": "m", "messages": messages}


def test_same_system_prompt_same_replica_with_placed() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet(URLS))
    firsts = set()
    for i in range(6):
        plan = routing.plan(chat("You are a pirate.", f"question {i}"), {})
        assert plan.key == prefix_hash("You are a pirate.")
        assert sorted(plan.ranking) == sorted(URLS)
        firsts.add(plan.first)
        assert routing.landed(plan, plan.first) in (KIND_OWNER, "placed", "new_conversation")
        routing.finished(plan)
    assert len(firsts) == 1


def test_an_answers_usage_tells_placed_the_tokens_of_its_keys_static_prefix() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet(URLS))
    system = "You are a pirate. " * 20
    plan = routing.plan(chat(system, "what is the time?"), {})
    assert plan.blocks is not None and 0 < plan.blocks.static_blocks < len(plan.blocks.hashes)
    share = plan.blocks.static_blocks / len(plan.blocks.hashes)
    routing.observe(plan, prompt_tokens=200, cached_tokens=0)
    routing.finished(plan)
    placed = routing.placed
    assert placed is not None and plan.key is not None
    assert placed.table.snapshot(0.0)["keys"][plan.key]["foot"] == round(200 * share)


def test_each_decision_is_logged_at_debug_with_its_key_kind_and_loads(caplog) -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet(URLS))
    routing.plan(chat("You are a pirate.", "question 0"), {})  # not logged at the default level
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="prefixserve.router.standalone.routing"):
        plan = routing.plan(chat("You are a pirate.", "question 1"), {})
    (record,) = caplog.records
    message = record.getMessage()
    assert plan.key is not None and f"key {plan.key}: new_conversation, ranking {plan.ranking}" in message
    assert "(the key's 2)" in message  # the first request has not finished and f"placement ['{plan.first}']" in message


def test_retries_walk_the_ring_order_of_the_key() -> None:
    routing = StandaloneRouting(make_policy("consistent_hash"), ReplicaSet(URLS))
    plan = routing.plan(chat("tenant 7"), {})
    ring = HashRing([RingServer(n) for n in URLS])
    assert plan.ranking == ring.successors(plan.key, list(URLS))
    assert plan.attempts(2) == plan.ranking[:2]
    assert plan.attempts(10) == plan.ranking
    assert routing.landed(plan, plan.ranking[1]) == KIND_FALLBACK


def test_an_ejected_replica_is_not_ranked() -> None:
    rs = ReplicaSet(URLS, unhealthy_after=1)
    routing = StandaloneRouting(make_policy("placed"), rs)
    owner = routing.plan(chat("tenant 9"), {}).first
    rs.died(owner)
    plan = routing.plan(chat("tenant 9"), {})
    assert owner not in plan.ranking and len(plan.ranking) == 2


@pytest.mark.parametrize("body", [None, ["not", "an", "object"], {"messages": "nope"}, {"model": "m"}])
def test_a_body_without_a_readable_key_is_routed_by_load(body: object) -> None:
    rs = ReplicaSet(URLS)
    for name in ("a:1", "a:1", "c:3"):
        rs.started(name)
    routing = StandaloneRouting(make_policy("placed"), rs)
    plan = routing.plan(body, {})
    assert plan.key is None and plan.first == "b:2" and not plan.counted
    assert routing.landed(plan, "b:2") == KIND_NO_KEY


def test_placed_counts_a_key_once_and_finished_ends_it() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet(URLS))
    placed = routing.placed
    assert placed is not None
    plan = routing.plan(chat("counted"), {})
    assert placed.key_in_flight(plan.key) == 1
    routing.finished(plan)
    assert placed.key_in_flight(plan.key) == 0


def test_a_fallback_landing_records_the_prompt_where_it_landed() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet(URLS))
    body = chat("sys", "a long first question " * 40)
    plan = routing.plan(body, {})
    assert plan.blocks is not None
    other = plan.ranking[1]
    routing.landed(plan, other)
    assert routing.placed is not None and routing.placed.history is not None
    held = routing.placed.history.held(plan.blocks.hashes)
    assert held.get(other) == len(plan.blocks.hashes)
    routing.forget(other)
    assert other not in routing.placed.history.held(plan.blocks.hashes)


def test_the_kv_event_seam_feeds_placed() -> None:
    routing = StandaloneRouting(make_policy("placed", precise=True), ReplicaSet(URLS))
    body = chat("sys", "question " * 80)
    plan = routing.plan(body, {})
    assert plan.blocks is not None
    routing.report_history("c:3", plan.blocks.hashes, [])
    assert routing.placed is not None and routing.placed.history is not None
    assert routing.placed.history.held(plan.blocks.hashes).get("c:3") == len(plan.blocks.hashes)
    routing.set_cached("c:3", plan.key, True)  # accepted by placed's precise table


# -- config and CLI ---------------------------------------------------------------------------------


def test_replica_names_are_host_port() -> None:
    assert replica_name("http://10.0.0.1:8001/") == "10.0.0.1:8001"
    assert replica_name("https://example.com") == "example.com:443"
    assert replica_name("http://[::1]:9") == "[::1]:9"
    for bad in ("10.0.0.1:8001", "ftp://x:1", "http://:80", "http://h:99999"):
        with pytest.raises(ValueError):
            replica_name(bad)


def test_config_refuses_no_replica_duplicates_and_bad_numbers() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        StandaloneRouterConfig()
    with pytest.raises(ValueError, match="distinct"):
        StandaloneRouterConfig(replicas=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="max_attempts"):
        StandaloneRouterConfig(replicas=["http://a:1"], max_attempts=0)
    with pytest.raises(ValueError, match="health_interval_s"):
        StandaloneRouterConfig(replicas=["http://a:1"], health_interval_s=float("inf"))
    config = StandaloneRouterConfig(replicas=["http://a:1/", "http://b:2"])
    assert config.replica_urls == {"a:1": "http://a:1", "b:2": "http://b:2"}


def test_policy_options_and_key_settings_reach_the_router() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        StandaloneRouterConfig(replicas=["http://a:1"], epsilon=-1.0)
    with pytest.raises(ValueError, match="key_turns"):
        StandaloneRouterConfig(replicas=["http://a:1"], key_turns=-1)
    config = StandaloneRouterConfig(replicas=["http://a:1"], policy="round_robin", epsilon=0.5)
    assert config.policy_options == {}  # round_robin takes no epsilon
    config = StandaloneRouterConfig(replicas=["http://a:1"], epsilon=0.5, key_turns=1)
    routing = StandaloneRouting(
        make_policy(config.policy, **config.policy_options), ReplicaSet(URLS), config.key_config
    )
    assert routing.placed is not None and routing.placed.epsilon == 0.5
    one, two = routing.plan(chat("sys", "first chat"), {}), routing.plan(chat("sys", "second chat"), {})
    assert one.key != two.key != prefix_hash("sys")


def test_the_limits_are_the_replicas() -> None:
    from prefixserve.replica.entrypoints.openai.server import ServerConfig

    replica = ServerConfig()
    router = StandaloneRouterConfig(replicas=["http://a:1"])
    assert router.max_body_bytes == replica.max_body_bytes
    assert router.client_body_timeout_s == replica.client_body_timeout_s
    assert router.h11_max_incomplete_event_size == replica.h11_max_incomplete_event_size
    assert router.h11_max_header_count == replica.h11_max_header_count


def test_cli_refuses_a_bad_replica_url_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--replica", "localhost:8001"]) == 2
    assert "http://" in capsys.readouterr().err


def test_the_router_loads_no_replica_http_front_end_and_no_ray() -> None:
    code = (
        "import sys, prefixserve.router.standalone.cli, prefixserve.router.standalone.proxy\n"
        "bad = [m for m in sys.modules if m.startswith(('prefixserve.replica.entrypoints', 'ray', 'torch'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- usage ------------------------------------------------------------------------------------------

USAGE = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 40}}


def test_usage_from_a_streams_last_events() -> None:
    stream = (
        b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": USAGE}).encode()
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )
    assert usage_of(stream, sse=True) == Usage(100, 40, USAGE["completion_tokens"])
    assert usage_of(stream[: stream.index(b'data: {"choices": []')], sse=True) is None  # cut before the usage
    assert usage_of(b'data: {"choices": []}\n\ndata: [DONE]\n\n', sse=True) is None
    tail = AnswerTail(sse=True)
    tail.add(b"data: " + b"x" * (SSE_TAIL_BYTES * 2) + b"\n\n")  # a huge event, cut: skipped
    tail.add(stream)
    assert len(tail.data) <= SSE_TAIL_BYTES and tail.usage() == Usage(100, 40, USAGE["completion_tokens"])


def test_usage_from_a_json_answer_kept_whole_only() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 7}}).encode()
    assert usage_of(body, sse=False) == Usage(7, None)
    tail = AnswerTail(sse=False)
    tail.add(body[:10])
    tail.add(body[10:])
    assert tail.usage() == Usage(7, None)
    big = AnswerTail(sse=False)
    big.add(b" " * (JSON_BODY_BYTES + 1))
    big.add(body)
    assert big.usage() is None
    assert usage_of(b"{not json", sse=False) is None
    assert usage_of(b'{"usage": {"prompt_tokens": -1}}', sse=False) is None


def test_a_request_its_replica_refused_leaves_no_key_in_the_placement() -> None:
    routing = StandaloneRouting(make_policy("placed"), ReplicaSet({"a:1": "http://a:1", "b:2": "http://b:2"}))
    body = {"messages": [{"role": "system", "content": "refused"}, {"role": "user", "content": "x"}]}
    plan = routing.plan(body, {})
    routing.refused(plan)
    routing.finished(plan)
    placed = routing.placed
    assert placed is not None and plan.key is not None and plan.key not in placed.table
