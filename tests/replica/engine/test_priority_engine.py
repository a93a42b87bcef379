"""The engine under --scheduling-policy priority: the same tokens as fcfs for requests of one
priority, and the priorities each policy refuses (vLLM's message under fcfs)."""

from __future__ import annotations

import argparse
import random

import pytest

from prefixserve import LLM, EngineConfig, SamplingParams
from prefixserve.replica.contract.request import PRIORITY_MAX
from prefixserve.replica.errors import RequestRejected

# Few blocks for 8 requests of up to 30 tokens: the engine preempts.
KNOBS = {"block_size": 4, "num_kv_blocks": 14, "max_num_seqs": 4, "max_num_batched_tokens": 64}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 200) for _ in range(6)]
    return [shared + [rng.randrange(3, 200) for _ in range(rng.randrange(2, 14))] for _ in range(8)]


def run(llm: LLM, priority: list[int] | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), params, priority=priority)]


@pytest.fixture(scope="module")
def fcfs_llm(ckpt):
    with LLM(ckpt, **KNOBS) as llm:
        yield llm


@pytest.fixture(scope="module")
def priority_llm(ckpt):
    with LLM(ckpt, scheduling_policy="priority", **KNOBS) as llm:
        yield llm


def test_one_priority_gives_fcfs_tokens(fcfs_llm, priority_llm):
    expected = run(fcfs_llm)
    assert fcfs_llm.engine.scheduler.num_preemptions > 0  # the runs below go through preemption too
    assert run(priority_llm) == expected
    assert run(priority_llm, [7] * 8) == expected


def test_fcfs_refuses_a_priority_other_than_0_in_vllm_words(fcfs_llm):
    with pytest.raises(RequestRejected, match=r"^Got priority 1 but Priority scheduling is not enabled\.$"):
        run(fcfs_llm, [0] * 7 + [1])
    assert not fcfs_llm.engine.has_unfinished_requests()


def test_a_priority_out_of_range_is_refused(priority_llm):
    with pytest.raises(RequestRejected, match=r"priority must be an integer in \[-2147483648, 2147483647\]"):
        run(priority_llm, [PRIORITY_MAX + 1] + [0] * 7)
    assert run(priority_llm, [PRIORITY_MAX] + [-(2**31)] * 7) == run(priority_llm)


def test_the_knob_is_vllms_flag_and_refuses_other_policies():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).scheduling_policy == "fcfs"
    args = parser.parse_args(["--scheduling-policy", "priority"])
    assert EngineConfig.from_cli_args(args).scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
