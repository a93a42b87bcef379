"""The simulator's conversation workloads (loadtest/conversations.py): sessions, accounting, history routing."""

from __future__ import annotations

import pytest

from prefixserve.loadtest import simulate as S
from prefixserve.loadtest.conversations import ConversationTraffic, preset

# The seed article's loaded cost model: prefill dominates a request's time, as the conversation
# workloads' long histories make it (these settings and the bounds below were set under it).
CONV = S.SimConfig(
    profile="seed-article",
    num_replicas=4,
    num_requests=600,
    blocks_per_replica=1024,
    max_num_seqs=8,
    utilization=0.7,
    seed=7,
    workload="multi_turn",
)


@pytest.fixture(scope="module", params=["multi_turn", "agent"])
def setup(request):
    config = S.SimConfig(**{**CONV.__dict__, "workload": request.param})
    return config, S.make_traffic(config)


@pytest.mark.parametrize("workload", ["multi_turn", "agent"])
def test_each_turn_resends_its_sessions_history_and_the_previous_answer(workload):
    conv = ConversationTraffic(preset(workload), 300, seed=3)
    assert len(conv) == 300
    followed = 0
    for i, nxt in enumerate(conv.next_turn):
        if nxt < 0:
            continue
        followed += 1
        assert conv.sessions[nxt] == conv.sessions[i] and conv.apps[nxt] == conv.apps[i]
        assert conv.prompt(nxt)[: conv.prompt_lens[i]] == conv.prompt(i)
        assert conv.prompt(nxt)[conv.prompt_lens[i] : conv.prompt_lens[i] + conv.output_lens[i]] == conv.output(i)
        assert conv.prompt_lens[nxt] <= preset(workload).max_context
    assert followed > 100  # most requests continue a session
    first = {conv.apps[f] for _, f in conv.starts}
    static = {a: conv.static_tokens[a] for a in first}
    assert all(conv.prompt(f)[: len(static[conv.apps[f]])] == static[conv.apps[f]] for _, f in conv.starts)


@pytest.mark.parametrize(
    "policy", ["placed", "placed_static", "round_robin", "sglang_tree", "ray_prefix", "llmd", "dynamo"]
)
def test_accounting_balances_and_the_oracle_bounds_every_policy(policy, setup):
    config, traffic = setup
    r = S.simulate(config, policy, traffic, check_invariants=True)
    assert r.finished == r.num_requests == len(traffic.conv)
    assert r.prompt_tokens == sum(traffic.conv.prompt_lens)
    assert (r.kv_query_tokens, r.kv_hit_tokens) == (r.prompt_tokens, r.hit_tokens)
    assert r.oracle_violations == 0 and r.leaked_blocks == 0
    assert r.first_touch_miss_tokens + r.evicted_miss_tokens == sum(traffic.oracle_hits) - r.hit_tokens


# Enough cache and replicas that routing, not overload, decides the hits: the agent's 2-4k-token
# tool prefixes on 8 replicas at utilization 0.7 queue for tens of seconds (TTFT p99 30-60 s), where
# which sessions overlap decides the hit rate more than the policy does.
ROOMY = {
    "agent": {
        "num_replicas": 32,
        "num_requests": 4000,
        "blocks_per_replica": 4096,
        "max_num_seqs": 64,
        "utilization": 0.6,
    },
}


@pytest.mark.parametrize("workload", ["multi_turn", "agent"])
def test_history_matching_beats_the_static_key_alone(workload):
    config = S.SimConfig(
        **{**CONV.__dict__, "workload": workload, "num_replicas": 8, "num_requests": 2000, "blocks_per_replica": 2048}
    )
    traffic = S.make_traffic(config)
    history = S.simulate(config, "placed", traffic)
    static = S.simulate(config, "placed_static", traffic)
    assert history.hit_rate > static.hit_rate


def test_recent_counts_even_the_requests_per_replica_without_giving_up_hits():
    # A conversation stays where it starts, so choosing new ones by in-flight alone leaves
    # replicas with more sessions (requests) than others.
    config = S.SimConfig(**{**CONV.__dict__, "workload": "agent", **ROOMY["agent"]})
    traffic = S.make_traffic(config)
    in_flight = S.simulate(config, "placed", traffic)
    recent = S.simulate(
        S.SimConfig(**{**config.__dict__, "placed_options": (("recent_tau_s", 300.0),)}), "placed", traffic
    )
    assert recent.load_max_over_mean < in_flight.load_max_over_mean - 0.15
    assert recent.hit_rate > in_flight.hit_rate - 0.01


def test_a_bad_placed_option_is_a_clear_cli_error(capsys):
    for bad in ("recent_tau_s", "recent_tau_s=-1", "no_such_option=1", "recent_tau_s=abc"):
        with pytest.raises(SystemExit) as exc:
            S.main(["--placed-option", bad, "--requests", "10", "--sweep-replicas", "", "--sweep-epsilons", ""])
        assert exc.value.code == 2
        assert "error" in capsys.readouterr().err
