"""Seeded, deterministic workload generators: OpenAI chat request bodies.

Five shapes, one config dataclass each:

- ``shared_prefix``: groups x prompts per group, one system prompt per group and a
  distinct question per prompt (SGLang's ``generated-shared-prefix`` benchmark).
- ``zipf_tenants``: tenants whose popularity follows a Zipf law, plus one hot
  tenant that takes a fixed share of the traffic.
- ``prefix_repetition``: a few prefixes, each repeated with random suffixes
  (vLLM's ``prefix_repetition`` benchmark dataset).
- ``multi_turn``: users x rounds, each round resending the whole history.
- ``volatile_system_prompt``: the hit-rate killers of the prefix-cache article
  (a timestamp, a user id, a version string, shuffled few-shots) interpolated into
  the system prompt; ``fixed=True`` gives the article's fix of the same traffic
  (static system prompt, the dynamic context moved to the user message).

Lengths "in tokens": text is drawn from ``WORDS``, a list of common English words
each of which is exactly one token, with or without a leading space, for
SmolLM2's tokenizer (GPT-2 style pre-tokenization splits on spaces, so a text of
n such words is n tokens). For other tokenizers ``TOKENS_PER_WORD`` (1.0) is an
approximation (common words are single tokens in Llama 3, Qwen2 and Mistral
vocabularies too). Pass ``tokenizer`` (anything with ``encode``) to a generator to
hit exact counts with that tokenizer. Lengths count the message content only,
not the chat template's tokens.

Invariants: the same config (seed included) gives the same requests, byte for
byte, in any process (``random.Random`` seeded by strings derived from the seed);
bodies hold only OpenAI fields, the tenant travels beside them.

Pure Python: no torch, no HTTP, no locust.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime as _dt
import json
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Each word is one token for SmolLM2's tokenizer (checked when the list was made).
WORDS: tuple[str, ...] = tuple(
    """the of and to in is for that on with as it are be this by from at or an have
    not which can more was all has will one about also their other they new use time
    data when some these system first would what than into only like used its any
    most may over make such each many very well how just should work need two people
    where part must same between through after before good high under both those
    while state number because day year way case place point group world form value
    model line order area level power process user service result change report type
    life team water hand example support section sense access control design market
    rule class plan range source field base reason test focus table light note final
    basic major local simple common clear early human public social small large great
    short long full real open whole strong main right left wrong free total single
    private heavy central modern recent general special direct natural similar legal
    current future physical political financial""".split()
)
TOKENS_PER_WORD = 1.0

DEFAULT_MODEL = "smollm2"


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: the OpenAI body to send and what the load tools need beside it.

    ``body`` holds only OpenAI chat fields, so it can be posted as is; ``tenant``
    names whose traffic it is (the group, tenant or user).
    """

    body: dict[str, Any]
    tenant: str
    workload: str

    def to_json(self) -> dict[str, Any]:
        """The JSONL form: the body plus a ``metadata`` object (dropped before sending)."""
        return {**self.body, "metadata": {"tenant": self.tenant, "workload": self.workload}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> WorkloadRequest:
        body = dict(obj)
        meta = body.pop("metadata", None) or {}
        return cls(body=body, tenant=str(meta.get("tenant", "")), workload=str(meta.get("workload", "")))


# --------------------------------------------------------------------------- text


def _rng(seed: int, *parts: object) -> random.Random:
    # String seeds go through SHA-512 in CPython: stable across processes and
    # independent of PYTHONHASHSEED, unlike hash() of a tuple.
    return random.Random(":".join([str(seed), *map(str, parts)]))


def words_text(rng: random.Random, num_tokens: int, tokenizer: Tokenizer | None = None) -> str:
    """A text of ``num_tokens`` tokens: exact for SmolLM2's tokenizer without ``tokenizer``.

    With ``tokenizer`` the text is the longest run of whole words that has at
    most ``num_tokens`` tokens and cannot take one more word of ``WORDS``
    (exact whenever some word is one token, as with any subword tokenizer).
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    words = [rng.choice(WORDS) for _ in range(round(num_tokens / TOKENS_PER_WORD))]
    if tokenizer is None or num_tokens == 0:
        return " ".join(words)

    def count(ws: list[str]) -> int:
        return len(_encode(tokenizer, " ".join(ws)))

    # Rescale the word count by the measured tokens per word, then trim and fill.
    for _ in range(4):
        got = count(words)
        if got == num_tokens or not words:
            break
        want = max(1, round(len(words) * num_tokens / got))
        if want == len(words):
            break
        words = words[:want] if want < len(words) else words + [rng.choice(WORDS) for _ in range(want - len(words))]
    while words and count(words) > num_tokens:
        words.pop()
    got = count(words)
    while got < num_tokens:
        # The first word (in a seeded order) that still fits; stop when none does.
        for w in rng.sample(WORDS, len(WORDS)):
            n = count(words + [w])
            if n <= num_tokens:
                words.append(w)
                got = n
                break
        else:
            break
    return " ".join(words)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _request(config: Any, messages: list[dict[str, str]], tenant: str, workload: str) -> WorkloadRequest:
    """One greedy chat request of ``config``'s model, output length and streaming."""
    body = {
        "model": config.model,
        "messages": messages,
        "max_tokens": config.output_len,
        "temperature": 0,
        "stream": config.stream,
    }
    return WorkloadRequest(body, tenant, workload)


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be >= 1, got {value}")


def _check_non_negative(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 0:
            raise ValueError(f"{type(config).__name__}.{name} must be >= 0, got {value}")


# ------------------------------------------------------------------ shared_prefix


@dataclass(frozen=True)
class SharedPrefixConfig:
    """SGLang's generated-shared-prefix shape: every group shares one system prompt."""

    num_groups: int = 8
    prompts_per_group: int = 16
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 32
    shuffle: bool = True  # interleave groups (False: all of group 0, then group 1, ...)
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_groups", "prompts_per_group", "output_len")
        _check_non_negative(self, "system_prompt_len", "question_len")


def shared_prefix(config: SharedPrefixConfig, tokenizer: Tokenizer | None = None) -> list[WorkloadRequest]:
    out = []
    for g in range(config.num_groups):
        system = words_text(_rng(config.seed, "system", g), config.system_prompt_len, tokenizer)
        for p in range(config.prompts_per_group):
            question = words_text(_rng(config.seed, "question", g, p), config.question_len, tokenizer)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            out.append(_request(config, messages, f"group-{g}", "shared_prefix"))
    if config.shuffle:
        _rng(config.seed, "order").shuffle(out)
    return out


# ------------------------------------------------------------------ zipf_tenants


@dataclass(frozen=True)
class ZipfTenantsConfig:
    """Tenant popularity ~ 1 / rank**zipf_s; tenant-0 also takes ``hot_share`` of all requests."""

    num_tenants: int = 100
    num_requests: int = 1000
    zipf_s: float = 1.1
    hot_share: float = 0.2
    system_prompt_len: int = 256
    question_len: int = 32
    output_len: int = 32
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_tenants", "num_requests", "output_len")
        _check_non_negative(self, "system_prompt_len", "question_len", "zipf_s")
        if not 0.0 <= self.hot_share < 1.0:
            raise ValueError(f"ZipfTenantsConfig.hot_share must be in [0, 1), got {self.hot_share}")


def zipf_tenant_sequence(num_tenants: int, num_requests: int, zipf_s: float, hot_share: float, seed: int) -> list[int]:
    """Tenant index of each request: tenant 0 is hot, the others Zipf by index.

    Shared with the simulator so that it replays the same traffic as the locust run.
    """
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(num_tenants)]
    cum = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)
    rng = _rng(seed, "zipf")
    seq = []
    for _ in range(num_requests):
        if rng.random() < hot_share:
            seq.append(0)
        else:
            seq.append(min(bisect.bisect_left(cum, rng.random() * total), num_tenants - 1))
    return seq


def zipf_tenants(config: ZipfTenantsConfig, tokenizer: Tokenizer | None = None) -> list[WorkloadRequest]:
    tenants = zipf_tenant_sequence(
        config.num_tenants, config.num_requests, config.zipf_s, config.hot_share, config.seed
    )
    systems: dict[int, str] = {}
    out = []
    for i, t in enumerate(tenants):
        if t not in systems:
            systems[t] = words_text(_rng(config.seed, "system", t), config.system_prompt_len, tokenizer)
        question = words_text(_rng(config.seed, "question", i), config.question_len, tokenizer)
        messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": question}]
        out.append(_request(config, messages, f"tenant-{t}", "zipf_tenants"))
    return out


# ------------------------------------------------------------- prefix_repetition


@dataclass(frozen=True)
class PrefixRepetitionConfig:
    """vLLM's prefix-repetition shape: ``num_prefixes`` prefixes, each repeated with random suffixes.

    ``prefix_role="system"`` sends the prefix as the system message (so routers see
    it as the static prefix); ``"user"`` concatenates prefix and suffix in one user
    message, exactly vLLM's prompt.
    """

    num_prefixes: int = 10
    num_requests: int = 200
    prefix_len: int = 256
    suffix_len: int = 256
    output_len: int = 128
    prefix_role: str = "system"
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_prefixes", "num_requests", "output_len")
        _check_non_negative(self, "prefix_len", "suffix_len")
        if self.prefix_role not in ("system", "user"):
            raise ValueError(f"PrefixRepetitionConfig.prefix_role must be 'system' or 'user', got {self.prefix_role!r}")


def prefix_repetition(config: PrefixRepetitionConfig, tokenizer: Tokenizer | None = None) -> list[WorkloadRequest]:
    prefixes = [
        words_text(_rng(config.seed, "prefix", k), config.prefix_len, tokenizer) for k in range(config.num_prefixes)
    ]
    out = []
    for i in range(config.num_requests):
        # Like vLLM: requests go to the prefixes in turn, then the whole list is shuffled.
        k = i % config.num_prefixes
        suffix = words_text(_rng(config.seed, "suffix", i), config.suffix_len, tokenizer)
        if config.prefix_role == "system":
            messages = [{"role": "system", "content": prefixes[k]}, {"role": "user", "content": suffix}]
        else:
            messages = [{"role": "user", "content": f"{prefixes[k]} {suffix}".strip()}]
        out.append(_request(config, messages, f"prefix-{k}", "prefix_repetition"))
    _rng(config.seed, "order").shuffle(out)
    return out


# -------------------------------------------------------------------- multi_turn


@dataclass(frozen=True)
class MultiTurnConfig:
    """Users x rounds; round r resends the system prompt and the r-1 earlier exchanges.

    Assistant turns are synthetic text of ``assistant_turn_len`` tokens standing in
    for the model's answers. Rounds are sent in order; within a round users are
    shuffled. ``shared_system_prompt`` gives every user the same system prompt.
    """

    num_users: int = 16
    num_rounds: int = 4
    system_prompt_len: int = 256
    user_turn_len: int = 32
    assistant_turn_len: int = 64
    output_len: int = 32
    shared_system_prompt: bool = False
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_users", "num_rounds", "output_len")
        _check_non_negative(self, "system_prompt_len", "user_turn_len", "assistant_turn_len")


def multi_turn(config: MultiTurnConfig, tokenizer: Tokenizer | None = None) -> list[WorkloadRequest]:
    histories: list[list[dict[str, str]]] = []
    for u in range(config.num_users):
        key = "shared" if config.shared_system_prompt else u
        system = words_text(_rng(config.seed, "system", key), config.system_prompt_len, tokenizer)
        histories.append([{"role": "system", "content": system}])
    out = []
    for r in range(config.num_rounds):
        users = list(range(config.num_users))
        _rng(config.seed, "round-order", r).shuffle(users)
        for u in users:
            history = histories[u]
            if r > 0:
                answer = words_text(_rng(config.seed, "assistant", u, r - 1), config.assistant_turn_len, tokenizer)
                history.append({"role": "assistant", "content": answer})
            question = words_text(_rng(config.seed, "user", u, r), config.user_turn_len, tokenizer)
            history.append({"role": "user", "content": question})
            messages = [dict(m) for m in history]
            out.append(_request(config, messages, f"user-{u}", "multi_turn"))
    return out


# ------------------------------------------------------------------------ agent


@dataclass(frozen=True)
class AgentConfig:
    """Agent sessions x steps over one app: a system prompt and long tool definitions shared by every user.

    Step 0 sends the user's task; every later step resends the history with the
    model's previous step (a synthetic tool call of ``tool_call_len`` tokens) and
    the tool's result (``tool_result_len`` tokens, sent as a user message so
    that any chat template takes it). Steps are sent in order; within a step
    users are shuffled. The same traffic with OpenAI's ``tools`` / ``tool_calls``
    fields, for tenants in waves, is loadtest/agent_workload.py's.
    """

    num_users: int = 8
    num_steps: int = 4
    system_prompt_len: int = 128
    tools_len: int = 512
    task_len: int = 48
    tool_call_len: int = 24
    tool_result_len: int = 160
    output_len: int = 16
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_users", "num_steps", "output_len")
        _check_non_negative(self, "system_prompt_len", "tools_len", "task_len", "tool_call_len", "tool_result_len")


def agent(config: AgentConfig, tokenizer: Tokenizer | None = None) -> list[WorkloadRequest]:
    system = words_text(_rng(config.seed, "agent-system"), config.system_prompt_len, tokenizer)
    tools = words_text(_rng(config.seed, "agent-tools"), config.tools_len, tokenizer)
    static = f"{system}\n\n# Tools\n{tools}"
    histories = [[{"role": "system", "content": static}] for _ in range(config.num_users)]
    out = []
    for step in range(config.num_steps):
        users = list(range(config.num_users))
        _rng(config.seed, "agent-order", step).shuffle(users)
        for u in users:
            history = histories[u]
            if step == 0:
                history.append(
                    {"role": "user", "content": words_text(_rng(config.seed, "task", u), config.task_len, tokenizer)}
                )
            else:
                call = words_text(_rng(config.seed, "call", u, step), config.tool_call_len, tokenizer)
                result = words_text(_rng(config.seed, "result", u, step), config.tool_result_len, tokenizer)
                history.append({"role": "assistant", "content": f"call_tool({call})"})
                history.append({"role": "user", "content": f"Tool result:\n{result}"})
            messages = [dict(m) for m in history]
            out.append(_request(config, messages, f"user-{u}", "agent"))
    return out


# -------------------------------------------------------- volatile_system_prompt

VOLATILE_PATTERNS = ("timestamp", "user_id", "version", "fewshots")


@dataclass(frozen=True)
class VolatileSystemPromptConfig:
    """The article's anti-patterns: volatile content at the head of the system prompt.

    ``patterns`` chooses which of ``VOLATILE_PATTERNS`` each request carries.
    ``fixed=True`` renders the same traffic the article's way: the system prompt is
    static (few-shots in a fixed order) and the date, user id and version move to
    the user message.
    """

    num_requests: int = 200
    num_users: int = 20
    patterns: tuple[str, ...] = VOLATILE_PATTERNS
    fixed: bool = False
    system_prompt_len: int = 256
    question_len: int = 32
    output_len: int = 32
    num_fewshots: int = 3
    fewshot_pool: int = 3  # > num_fewshots: random subsets too, as random.sample(pool, k)
    fewshot_len: int = 16
    deploy_every: int = 50  # requests between version bumps
    start_time: str = "2026-06-05T04:00:00"
    seed: int = 0
    model: str = DEFAULT_MODEL
    stream: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, "num_requests", "num_users", "output_len", "fewshot_pool", "deploy_every")
        _check_non_negative(self, "system_prompt_len", "question_len", "num_fewshots", "fewshot_len")
        unknown = set(self.patterns) - set(VOLATILE_PATTERNS)
        if unknown:
            raise ValueError(f"unknown volatile patterns {sorted(unknown)}; choose from {VOLATILE_PATTERNS}")
        if self.num_fewshots > self.fewshot_pool:
            raise ValueError(f"num_fewshots ({self.num_fewshots}) must be <= fewshot_pool ({self.fewshot_pool})")
        _dt.datetime.fromisoformat(self.start_time)


def volatile_system_prompt(
    config: VolatileSystemPromptConfig, tokenizer: Tokenizer | None = None
) -> list[WorkloadRequest]:
    base = words_text(_rng(config.seed, "system"), config.system_prompt_len, tokenizer)
    pool = [
        (
            words_text(_rng(config.seed, "shot-q", k), config.fewshot_len, tokenizer),
            words_text(_rng(config.seed, "shot-a", k), config.fewshot_len, tokenizer),
        )
        for k in range(config.fewshot_pool)
    ]
    rng = _rng(config.seed, "requests")
    clock = _dt.datetime.fromisoformat(config.start_time)
    patterns = set(config.patterns)
    out = []
    for i in range(config.num_requests):
        clock += _dt.timedelta(seconds=rng.randint(1, 90))
        user = f"u-{rng.randrange(config.num_users):05d}"
        version = f"2.{i // config.deploy_every}.{(i // config.deploy_every * 7) % 10}"
        shots = rng.sample(range(config.fewshot_pool), config.num_fewshots)
        question = words_text(_rng(config.seed, "question", i), config.question_len, tokenizer)
        dynamic, static = [], []
        if "timestamp" in patterns:
            dynamic.append(f"Current date: {clock.strftime('%Y-%m-%d %H:%M')}.")
        if "user_id" in patterns:
            dynamic.append(f"User ID: {user}.")
        if "version" in patterns:
            dynamic.append(f"[v{version}]")
        # The article's fix: the same examples, always in the same order.
        order = list(range(config.num_fewshots)) if config.fixed else shots
        if "fewshots" in patterns:
            examples = "\n".join(f"Q: {pool[k][0]}\nA: {pool[k][1]}" for k in order)
            static.append(f"Examples:\n{examples}")
        if config.fixed:
            system = "\n\n".join([*static, base])
            user_text = " ".join([*dynamic, question]) if dynamic else question
        else:
            system = "\n\n".join([" ".join(dynamic), *static, base]) if dynamic else "\n\n".join([*static, base])
            user_text = question
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user_text}]
        out.append(_request(config, messages, user, "volatile_system_prompt"))
    return out


# ---------------------------------------------------------------------- registry

Generator = Callable[..., list[WorkloadRequest]]

WORKLOADS: dict[str, tuple[type, Generator]] = {
    "shared_prefix": (SharedPrefixConfig, shared_prefix),
    "zipf_tenants": (ZipfTenantsConfig, zipf_tenants),
    "prefix_repetition": (PrefixRepetitionConfig, prefix_repetition),
    "multi_turn": (MultiTurnConfig, multi_turn),
    "agent": (AgentConfig, agent),
    "volatile_system_prompt": (VolatileSystemPromptConfig, volatile_system_prompt),
}


def _lookup(name: str) -> tuple[type, Generator]:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None


def _convert(field_: dataclasses.Field, raw: Any) -> Any:
    kind = field_.type if isinstance(field_.type, str) else getattr(field_.type, "__name__", str(field_.type))
    if not isinstance(raw, str):
        return tuple(raw) if kind.startswith("tuple") else raw
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"{field_.name} expects a boolean, got {raw!r}")
        return lowered in ("1", "true", "yes", "on")
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind.startswith("tuple"):
        return tuple(p for p in (s.strip() for s in raw.replace("+", ",").split(",")) if p)
    return raw


def make_config(name: str, params: dict[str, Any] | None = None) -> Any:
    """Build workload ``name``'s config from ``params`` (values may be strings, as from env vars)."""
    config_cls, _ = _lookup(name)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    kwargs = {}
    for key, raw in (params or {}).items():
        key = key.replace("-", "_")
        if key not in fields:
            raise ValueError(f"workload {name!r} has no parameter {key!r}; it has {sorted(fields)}")
        kwargs[key] = _convert(fields[key], raw)
    return config_cls(**kwargs)


def generate(
    name: str, params: dict[str, Any] | None = None, tokenizer: Tokenizer | None = None
) -> list[WorkloadRequest]:
    """The requests of workload ``name`` with ``params`` overriding its config's defaults."""
    _, gen = _lookup(name)
    return gen(make_config(name, params), tokenizer)


def parse_params(text: str) -> dict[str, str]:
    """Parse ``"a=1,b=x"`` or a JSON object into a dict (the env-var form of params)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError("workload params JSON must be an object")
        return obj
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"workload param {part!r} must look like name=value")
        out[key.strip()] = value.strip()
    return out


def write_jsonl(requests: Iterable[WorkloadRequest], path: str | Path) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for req in requests:
            fh.write(json.dumps(req.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[WorkloadRequest]:
    with open(path, encoding="utf-8") as fh:
        return [WorkloadRequest.from_json(json.loads(line)) for line in fh if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefixserve.loadtest.workloads", description="Write a workload as JSONL."
    )
    sub = parser.add_subparsers(dest="name", required=True)
    for name, (config_cls, _) in WORKLOADS.items():
        p = sub.add_parser(name, help=(config_cls.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--out", required=True, help="JSONL file to write ('-' for stdout)")
        for f in dataclasses.fields(config_cls):
            default = f.default
            shown = ",".join(default) if isinstance(default, tuple) else default
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None, help=f"default: {shown}")
    args = parser.parse_args(argv)
    params = {k: v for k, v in vars(args).items() if k not in ("name", "out") and v is not None}
    try:
        requests = generate(args.name, params)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out == "-":
        for req in requests:
            sys.stdout.write(json.dumps(req.to_json(), ensure_ascii=False) + "\n")
    else:
        n = write_jsonl(requests, args.out)
        print(f"wrote {n} requests of {args.name} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
