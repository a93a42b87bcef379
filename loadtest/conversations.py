"""Conversation and agent traffic for the simulator, as token ids (no tokenizer).

Job: the sessions ``loadtest/simulate.py`` replays beside its tenant workload.
A session belongs to an app drawn by Zipf (``zipf_s``) from ``num_apps``; every
session of an app starts with the app's static prefix (its system prompt and, for
agent apps, a long tool-definition block), so popular apps share one prefix over
many users. Each turn resends the whole history and appends new tokens:

* ``multi_turn``: a user message, then the assistant's answer (the previous
  turn's output) before the next user message; think time between turns
  (exponential, ``think_s``).
* ``agent``: a task, then tool results of a few hundred tokens after each model
  step (the previous output, a tool call); short think time (tool execution).

A session ends after its drawn number of turns or when its next prompt would
exceed ``max_context`` tokens. Turn k+1 arrives ``think`` seconds after turn k
finished (closed loop per session; the simulator schedules it), sessions start
as a Poisson process whose rate the simulator sets from its utilization.

Requests are numbered session by session, in session start order, turns in
order: an app's first request comes first, which keeps the simulator's oracle
(replaying requests in this order) an upper bound on any replica's hits.

Tokens are drawn per session from a seeded generator on demand (nothing the size
of the whole run is held): ``prompt(i)`` and ``output(i)``.

Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CONVERSATION_WORKLOADS = ("multi_turn", "agent")
VOCAB = 49152


@dataclass(frozen=True)
class ConversationConfig:
    """Shape of a conversation workload (token counts are drawn uniformly in [lo, hi])."""

    workload: str = "multi_turn"
    num_apps: int = 200
    zipf_s: float = 1.0
    system_len: tuple[int, int] = (200, 1000)
    tools_len: tuple[int, int] = (0, 0)  # agent apps: tool definitions after the system prompt
    first_len: tuple[int, int] = (20, 120)  # the first user message (agent: the task)
    turn_len: tuple[int, int] = (20, 120)  # later user messages (agent: tool results)
    output_len: tuple[int, int] = (50, 300)
    mean_turns: float = 6.0
    think_s: float = 15.0
    max_context: int = 12_000

    def __post_init__(self) -> None:
        if self.workload not in CONVERSATION_WORKLOADS:
            raise ValueError(f"workload must be one of {CONVERSATION_WORKLOADS}, got {self.workload!r}")
        for name in ("system_len", "tools_len", "first_len", "turn_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be 0 <= lo <= hi, got {(lo, hi)}")
        if self.num_apps < 1 or self.mean_turns < 1 or self.think_s < 0 or self.max_context < 2:
            raise ValueError("num_apps, mean_turns >= 1, think_s >= 0 and max_context >= 2 are required")


def preset(workload: str) -> ConversationConfig:
    """The simulator's two conversation workloads."""
    if workload == "agent":
        return ConversationConfig(
            workload="agent",
            num_apps=50,
            system_len=(300, 600),
            tools_len=(2000, 4000),
            first_len=(50, 200),
            turn_len=(200, 600),
            output_len=(30, 150),
            mean_turns=8.0,
            think_s=1.5,
        )
    return ConversationConfig(workload=workload)


class ConversationTraffic:
    """The requests of one conversation run (see the module docstring).

    Per request i: ``apps[i]`` (the tenant, routing key index), ``sessions[i]``,
    ``prompt_lens[i]``, ``output_lens[i]``, ``think[i]`` (seconds after the previous
    turn finished; the first turn: 0), ``next_turn[i]`` (the session's next request
    or -1). ``starts``: per session its unit-rate start time and its first request.
    """

    def __init__(self, config: ConversationConfig, num_requests: int, seed: int) -> None:
        self.config = config
        rng = np.random.default_rng([seed, 11])
        ranks = np.arange(1, config.num_apps + 1, dtype=np.float64)
        weights = ranks**-config.zipf_s
        weights /= weights.sum()
        self.static_tokens: list[list[int]] = []
        for a in range(config.num_apps):
            r = np.random.default_rng([seed, 12, a])
            n = int(r.integers(config.system_len[0], config.system_len[1] + 1))
            n += int(r.integers(config.tools_len[0], config.tools_len[1] + 1))
            self.static_tokens.append(r.integers(0, VOCAB, n).tolist())
        self.seed = seed
        self.apps: list[int] = []
        self.sessions: list[int] = []
        self.prompt_lens: list[int] = []
        self.output_lens: list[int] = []
        self.think: list[float] = []
        self.next_turn: list[int] = []
        self.starts: list[tuple[float, int]] = []
        self._session_app: list[int] = []
        self._session_len: list[int] = []  # tokens of the session's stream after the static prefix
        t = 0.0
        s = 0
        while len(self.apps) < num_requests:
            app = int(rng.choice(config.num_apps, p=weights))
            t += float(rng.exponential(1.0))
            turns = int(rng.geometric(1.0 / config.mean_turns))  # mean mean_turns, at least 1
            static = len(self.static_tokens[app])
            pos = 0
            first = len(self.apps)
            prev = -1
            for k in range(turns):
                lo, hi = config.first_len if k == 0 else config.turn_len
                new = int(rng.integers(lo, hi + 1))
                out = int(rng.integers(config.output_len[0], config.output_len[1] + 1))
                if k > 0 and static + pos + new + out > config.max_context:
                    break
                i = len(self.apps)
                self.apps.append(app)
                self.sessions.append(s)
                self.prompt_lens.append(static + pos + new)
                self.output_lens.append(out)
                self.think.append(float(rng.exponential(config.think_s)) if k > 0 else 0.0)
                self.next_turn.append(-1)
                if prev >= 0:
                    self.next_turn[prev] = i
                prev = i
                pos += new + out
                if len(self.apps) >= num_requests:
                    break
            self.starts.append((t, first))
            self._session_app.append(app)
            self._session_len.append(pos)
            s += 1
        self._stream = lru_cache(maxsize=4096)(self._make_stream)

    def __len__(self) -> int:
        return len(self.apps)

    def _make_stream(self, session: int) -> tuple[int, ...]:
        r = np.random.default_rng([self.seed, 13, session])
        return tuple(r.integers(0, VOCAB, self._session_len[session]).tolist())

    def static_len(self, i: int) -> int:
        return len(self.static_tokens[self.apps[i]])

    def prompt(self, i: int) -> list[int]:
        """The whole prompt of request i: the app's static prefix, then the session's history and new turn."""
        static = self.static_tokens[self.apps[i]]
        return static + list(self._stream(self.sessions[i])[: self.prompt_lens[i] - len(static)])

    def output(self, i: int) -> list[int]:
        """The tokens request i generates (the next turn's prompt carries them)."""
        start = self.prompt_lens[i] - len(self.static_tokens[self.apps[i]])
        return list(self._stream(self.sessions[i])[start : start + self.output_lens[i]])

    def new_tokens(self, i: int, previous: int) -> int:
        """Tokens of request i not in its session's previous request's prompt and output (all on turn one)."""
        if previous < 0:
            return self.prompt_lens[i]
        return self.prompt_lens[i] - self.prompt_lens[previous] - self.output_lens[previous]
