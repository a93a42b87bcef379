"""Workload generators: deterministic per seed, shaped as configured, exportable as JSONL."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import pytest

from prefixserve.loadtest import workloads as W
from prefixserve.router.routing_key import routing_key


def _params(name: str) -> dict:
    """Small configs, one per workload."""
    return {
        "shared_prefix": dict(num_groups=4, prompts_per_group=5, system_prompt_len=40, question_len=8, output_len=7),
        "zipf_tenants": dict(num_tenants=30, num_requests=400, system_prompt_len=20, question_len=6),
        "prefix_repetition": dict(num_prefixes=3, num_requests=30, prefix_len=24, suffix_len=10, output_len=5),
        "multi_turn": dict(num_users=3, num_rounds=4, system_prompt_len=16, user_turn_len=5, assistant_turn_len=9),
        "agent": dict(num_users=3, num_steps=3, system_prompt_len=12, tools_len=30, tool_result_len=20),
        "volatile_system_prompt": dict(num_requests=40, num_users=5, system_prompt_len=30, deploy_every=10),
    }[name]


def _dump(reqs: list[W.WorkloadRequest]) -> list[str]:
    return [json.dumps(r.to_json(), sort_keys=True) for r in reqs]


@pytest.mark.parametrize("name", sorted(W.WORKLOADS))
def test_same_seed_same_requests_other_seed_other(name: str) -> None:
    seed = random.Random(name).randrange(1000)
    a = W.generate(name, {**_params(name), "seed": seed})
    b = W.generate(name, {**_params(name), "seed": seed})
    c = W.generate(name, {**_params(name), "seed": seed + 1})
    assert _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)


@pytest.mark.parametrize("name", sorted(W.WORKLOADS))
def test_bodies_are_openai_chat_bodies(name: str) -> None:
    for req in W.generate(name, _params(name)):
        assert set(req.body) == {"model", "messages", "max_tokens", "temperature", "stream"}
        assert req.body["temperature"] == 0 and req.body["stream"] is True
        assert req.tenant and req.workload == name
        for m in req.body["messages"]:
            assert m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
        assert req.body["messages"][-1]["role"] == "user"


def _ntok(text: str) -> int:
    return len(text.split())  # every word of WORDS is one token for SmolLM2


def test_shared_prefix_shape() -> None:
    p = _params("shared_prefix")
    reqs = W.shared_prefix(W.SharedPrefixConfig(**p, seed=3))
    assert len(reqs) == p["num_groups"] * p["prompts_per_group"]
    by_group: dict[str, set[str]] = {}
    questions = set()
    for r in reqs:
        system, user = r.body["messages"]
        assert _ntok(system["content"]) == p["system_prompt_len"]
        assert _ntok(user["content"]) == p["question_len"]
        assert r.body["max_tokens"] == p["output_len"]
        by_group.setdefault(r.tenant, set()).add(system["content"])
        questions.add(user["content"])
    assert len(by_group) == p["num_groups"]
    assert all(len(s) == 1 for s in by_group.values())  # one system prompt per group
    assert len({next(iter(s)) for s in by_group.values()}) == p["num_groups"]
    assert len(questions) == len(reqs)
    assert Counter(r.tenant for r in reqs) == {f"group-{g}": p["prompts_per_group"] for g in range(p["num_groups"])}
    # shuffled: not grouped in order
    grouped = W.shared_prefix(W.SharedPrefixConfig(**p, seed=3, shuffle=False))
    assert [r.tenant for r in grouped] == sorted((r.tenant for r in grouped), key=lambda t: int(t.split("-")[1]))
    assert [r.tenant for r in reqs] != [r.tenant for r in grouped]


def test_zipf_tenants_popularity_and_hot_tenant() -> None:
    cfg = W.ZipfTenantsConfig(
        num_tenants=50, num_requests=4000, zipf_s=1.2, hot_share=0.3, system_prompt_len=8, question_len=4, seed=11
    )
    reqs = W.zipf_tenants(cfg)
    counts = Counter(r.tenant for r in reqs)
    # tenant 0 gets hot_share plus its Zipf share
    zipf0 = 1 / sum(1 / (k + 1) ** 1.2 for k in range(50))
    expected0 = 0.3 + 0.7 * zipf0
    assert abs(counts["tenant-0"] / 4000 - expected0) < 0.03
    assert counts["tenant-1"] > counts.get("tenant-10", 0) > counts.get("tenant-45", 0) - 10
    systems: dict[str, set[str]] = {}
    for r in reqs:
        systems.setdefault(r.tenant, set()).add(r.body["messages"][0]["content"])
    assert all(len(s) == 1 for s in systems.values())
    # each tenant's key is stable and distinct: one routing key per tenant
    keys = {r.tenant: routing_key(r.body) for r in reqs}
    assert len(set(keys.values())) == len(keys)


def test_prefix_repetition_shape() -> None:
    p = _params("prefix_repetition")
    reqs = W.prefix_repetition(W.PrefixRepetitionConfig(**p, seed=5))
    assert len(reqs) == p["num_requests"]
    assert Counter(r.tenant for r in reqs) == {f"prefix-{k}": 10 for k in range(3)}
    prefixes = {r.body["messages"][0]["content"] for r in reqs}
    assert len(prefixes) == 3 and all(_ntok(x) == p["prefix_len"] for x in prefixes)
    user_only = W.prefix_repetition(W.PrefixRepetitionConfig(**p, seed=5, prefix_role="user"))
    for a, b in zip(reqs, user_only):
        (msg,) = b.body["messages"]
        assert msg["content"] == a.body["messages"][0]["content"] + " " + a.body["messages"][1]["content"]
        assert routing_key(b.body) is None  # no static prefix: vLLM's exact prompt shape


def test_multi_turn_history_grows() -> None:
    p = _params("multi_turn")
    reqs = W.multi_turn(W.MultiTurnConfig(**p, seed=2))
    assert len(reqs) == p["num_users"] * p["num_rounds"]
    last: dict[str, list] = {}
    for r in reqs:
        msgs = r.body["messages"]
        prev = last.get(r.tenant)
        if prev is None:
            assert [m["role"] for m in msgs] == ["system", "user"]
        else:
            # each round resends the previous request whole, then an answer and a new question
            assert msgs[: len(prev)] == prev
            assert [m["role"] for m in msgs[len(prev) :]] == ["assistant", "user"]
            assert _ntok(msgs[-2]["content"]) == p["assistant_turn_len"]
        last[r.tenant] = msgs
    assert all(len(m) == 1 + 2 * p["num_rounds"] - 1 for m in last.values())
    # rounds are sent in order: round r of every user before round r+1 of any
    sizes = [len(r.body["messages"]) for r in reqs]
    assert sizes == sorted(sizes)
    shared = W.multi_turn(W.MultiTurnConfig(**p, seed=2, shared_system_prompt=True))
    assert len({r.body["messages"][0]["content"] for r in shared}) == 1
    assert len({r.body["messages"][0]["content"] for r in reqs}) == p["num_users"]


def test_volatile_system_prompt_patterns_and_fix() -> None:
    cfg = W.VolatileSystemPromptConfig(
        num_requests=60, num_users=6, system_prompt_len=20, deploy_every=25, fewshot_len=4, seed=9
    )
    reqs = W.volatile_system_prompt(cfg)
    systems = [r.body["messages"][0]["content"] for r in reqs]
    assert all(s.startswith("Current date: 2026-") for s in systems)
    assert all("User ID: u-0000" in s for s in systems)
    assert {s.split("[v")[1].split("]")[0] for s in systems} == {"2.0.0", "2.1.7", "2.2.4"}
    shot_orders = {tuple(line for line in s.splitlines() if line.startswith("Q:")) for s in systems}
    assert len(shot_orders) > 1 and len({frozenset(o) for o in shot_orders}) == 1  # same shots, reordered
    assert len(set(systems)) == len(systems)

    fixed = W.volatile_system_prompt(W.VolatileSystemPromptConfig(**{**cfg.__dict__, "fixed": True}))
    assert len({r.body["messages"][0]["content"] for r in fixed}) == 1
    assert all(r.body["messages"][1]["content"].startswith("Current date: ") for r in fixed)

    only_ts = W.volatile_system_prompt(
        W.VolatileSystemPromptConfig(num_requests=5, patterns=("timestamp",), system_prompt_len=10, seed=9)
    )
    assert all(
        "User ID" not in r.body["messages"][0]["content"] and "Examples" not in r.body["messages"][0]["content"]
        for r in only_ts
    )
    with pytest.raises(ValueError, match="unknown volatile patterns"):
        W.VolatileSystemPromptConfig(patterns=("weather",))


def test_exact_lengths_with_a_tokenizer() -> None:
    class CharTokenizer:  # one token per character: words are several tokens each
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    rng = random.Random(4)
    shortest = min(len(" " + w) for w in W.WORDS)
    for n in (3, 17, 60, 133):
        text = W.words_text(random.Random(rng.random()), n, CharTokenizer())
        assert n - shortest < len(text) <= n  # as close as whole words allow

    class PairTokenizer:  # every word is two tokens, except "the" (one): exact counts are reachable
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [t for w in text.split() for t in ((1,) if w == "the" else (1, 2))]

    for n in (1, 2, 9, 40):
        assert len(PairTokenizer().encode(W.words_text(random.Random(n), n, PairTokenizer()))) == n


def test_params_from_strings_and_errors() -> None:
    cfg = W.make_config("volatile_system_prompt", W.parse_params("num_requests=7,fixed=yes,patterns=timestamp+version"))
    assert cfg.num_requests == 7 and cfg.fixed is True and cfg.patterns == ("timestamp", "version")
    assert W.parse_params('{"num_groups": 3}') == {"num_groups": 3}
    with pytest.raises(ValueError, match="unknown workload"):
        W.generate("nope")
    with pytest.raises(ValueError, match="has no parameter 'bogus'"):
        W.make_config("shared_prefix", {"bogus": 1})
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        W.SharedPrefixConfig(num_groups=0)
    with pytest.raises(ValueError, match="name=value"):
        W.parse_params("num_groups")


def test_jsonl_roundtrip_and_cli(tmp_path) -> None:
    reqs = W.generate("multi_turn", _params("multi_turn"))
    path = tmp_path / "mt.jsonl"
    assert W.write_jsonl(reqs, path) == len(reqs)
    assert W.read_jsonl(path) == reqs
    out = tmp_path / "cli.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixserve.loadtest.workloads",
            "multi_turn",
            "--out",
            str(out),
            *[f"--{k.replace('_', '-')}={v}" for k, v in _params("multi_turn").items()],
        ],
        check=True,
        capture_output=True,
    )
    assert out.read_text() == path.read_text()


def test_agent_sessions_share_the_tool_prefix_and_grow_by_tool_results() -> None:
    reqs = W.agent(W.AgentConfig(**_params("agent"), seed=4))
    assert len(reqs) == 9
    assert len({r.body["messages"][0]["content"] for r in reqs}) == 1  # one app: system + tools shared
    by_user: dict[str, list[list[dict]]] = {}
    for r in reqs:
        by_user.setdefault(r.tenant, []).append(r.body["messages"])
    for turns in by_user.values():
        assert [len(m) for m in turns] == [2, 4, 6]
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier
        assert turns[1][-1]["content"].startswith("Tool result:")
