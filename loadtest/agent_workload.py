"""An agent workload: tenants with a long system prompt and tool definitions, multi-turn tool calls.

Job: the requests an agent framework sends, in arrival order, as OpenAI chat
bodies. Each tenant has a ~``system_prompt_len``-token system prompt and
``tools_per_tenant`` tool definitions (seeded names, descriptions and
parameter schemas). Each of its ``sessions_per_tenant`` sessions asks one
question and runs ``turns`` agent steps: every step after the first resends the
whole history, with the previous step's assistant tool call and the tool's
result appended (a replayed trace: the workload scripts the calls, so every
engine sees the same prompts whatever its model writes). Requests go out one
wave per step: all sessions' step k, then step k + 1, as agents wait for their
tool results.

What a prefix cache can reuse: the system prompt and tools across a tenant's
sessions (the routing key's static prefix, Contract 1), and each session's
history across its steps.

Beside workloads.py's ``agent`` (one app, the tool definitions as system-prompt text and
the calls and results as plain turns, so that any chat template and any server take it:
the router benchmarks' version), this one sends OpenAI's own ``tools``, ``tool_calls`` and
``tool`` messages for tenants in waves, which the engine renders through its tool template
(bench_engine's agents). Both keep their seeded byte streams: the figures in
docs/benchmarks/agents.md and routing_conversations.md (bench_cluster) were measured on them.

Pure Python: the tokenizer (for exact system-prompt lengths) is optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixserve.loadtest.workloads import Tokenizer, _rng, words_text

PARAM_TYPES = ("string", "integer", "number", "boolean")


@dataclass(frozen=True)
class AgentConfig:
    """The agent workload's size (see the module docstring)."""

    num_tenants: int = 4
    system_prompt_len: int = 2000
    tools_per_tenant: int = 6
    sessions_per_tenant: int = 3
    turns: int = 3
    question_len: int = 30
    tool_result_len: int = 60
    output_len: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_tenants", "tools_per_tenant", "sessions_per_tenant", "turns", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class AgentRequest:
    """One agent step: its tenant, session, step (0-based) and chat body (messages, tools)."""

    tenant: int
    session: int
    step: int
    body: dict[str, Any]


def tenant_tools(config: AgentConfig, tenant: int) -> list[dict[str, Any]]:
    """A tenant's tool definitions: seeded function names, descriptions and object schemas."""
    rng = _rng(config.seed, "tools", tenant)
    tools = []
    for i in range(config.tools_per_tenant):
        props = {
            f"arg_{j}": {"type": rng.choice(PARAM_TYPES), "description": words_text(rng, 8)}
            for j in range(rng.randint(2, 5))
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"t{tenant}_tool_{i}",
                    "description": words_text(rng, 24),
                    "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
                },
            }
        )
    return tools


def agent_requests(config: AgentConfig, tokenizer: Tokenizer | None = None) -> list[list[AgentRequest]]:
    """The workload's waves: wave k holds every session's step k."""
    systems = [
        words_text(_rng(config.seed, "system", t), config.system_prompt_len, tokenizer)
        for t in range(config.num_tenants)
    ]
    tools = [tenant_tools(config, t) for t in range(config.num_tenants)]
    histories: dict[tuple[int, int], list[dict[str, Any]]] = {}
    waves: list[list[AgentRequest]] = []
    for step in range(config.turns):
        wave = []
        for s in range(config.sessions_per_tenant):
            for t in range(config.num_tenants):
                rng = _rng(config.seed, "session", t, s, step)
                history = histories.setdefault(
                    (t, s),
                    [
                        {"role": "system", "content": systems[t]},
                        {"role": "user", "content": words_text(rng, config.question_len)},
                    ],
                )
                if step > 0:
                    tool = rng.choice(tools[t])["function"]
                    call_id = f"call_{t}_{s}_{step}"
                    args = {k: words_text(rng, 2) for k in list(tool["parameters"]["properties"])[:2]}
                    history += [
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": call_id,
                                    "type": "function",
                                    "function": {"name": tool["name"], "arguments": json.dumps(args)},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": call_id, "content": words_text(rng, config.tool_result_len)},
                    ]
                body = {
                    "messages": [dict(m) for m in history],
                    "tools": tools[t],
                    "tool_choice": "auto",
                    "max_tokens": config.output_len,
                    "temperature": 0,
                }
                wave.append(AgentRequest(t, s, step, body))
        waves.append(wave)
    return waves
