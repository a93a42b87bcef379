"""SamplingParams (what a request asks of the sampler) and the sampler itself.

SamplingParams is plain data, validated on construction so that every front end
(offline LLM, HTTP server, Ray ingress) refuses the same bad values with the same
message. Checks that need the model (vocabulary size, ``max_num_seqs``, the
context length) are the engine's (``LLMEngine.validate``). The sampler (torch)
lives below it in this module.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixserve.replica.structured_output.params import StructuredOutputsParams
from prefixserve.replica.structured_output.state import SequenceGrammar, apply_grammar_bitmasks

MAX_N = 16
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1e-45 is a float64 but 0 in
# float32, and logits / 0 would turn the row into NaN.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes [0, 2**64 - 1]; child i of an n > 1 request uses
# (seed + i) mod 2**64 so that any accepted seed is valid for every child.
SEED_MODULUS = 2**64
# Stop conditions are checked for every generated token, so their size is bounded. OpenAI
# allows 4 stop strings; 16 of up to 256 characters is generous for real use and keeps the
# per-token search (and the text held back from streams, longest stop - 1) small.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# OpenAI's logit_bias: at most 300 tokens, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0


def _is_int(value: Any) -> bool:
    # numbers.Integral admits numpy integers; bool is an int subclass but never a count or id.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float in [lo, hi] ((lo, hi] with ``lo_open``); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    interval = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
    if not math.isfinite(number) or number > hi or number < lo or (lo_open and number == lo):
        raise ValueError(f"{name} must be in {interval}, got {number}")
    return number


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's names and defaults).

    ``temperature == 0`` is greedy (so is any temperature below 1e-5, which is
    stored as 0). ``top_k`` of None (or -1, as vLLM spells it) keeps every token.
    ``seed`` in [0, 2**64 - 1] makes sampling reproducible per request; with
    ``n > 1`` child ``i`` uses ``(seed + i) mod 2**64`` so that it equals a separate
    request sent with that seed. ``logit_bias`` maps token ids to a bias in
    [-100, 100] added to their logits before sampling (OpenAI's semantics; at most
    300 entries). Stop lists are bounded: at most 16 stop strings of at most 256
    characters each, at most 64 stop token ids. ``structured_outputs`` constrains the
    output to a JSON schema, regex, choice or grammar (grammar-constrained decoding).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = None
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer between 1 and {MAX_N}, got {self.n!r}")
        self.temperature = _check_float("temperature", self.temperature, 0.0, 2.0)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be >= 1 or -1 (disabled), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_MODULUS):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        self._check_stops()
        # An empty map is no map: the sampler then skips the bias entirely.
        self.logit_bias = self._checked_logit_bias(self.logit_bias) if self.logit_bias else None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                                 f"got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, "
                             f"got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @staticmethod
    def _checked_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must map token ids to biases")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        out: dict[int, float] = {}
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            out[int(token)] = _check_float(f"logit_bias[{token}]", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child_seed(self, index: int) -> int | None:
        """The seed of sequence ``index`` (None when unseeded); always in [0, 2**64 - 1]."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS


# --------------------------------------------------------------------------------------
# The sampler: one call per step over the logits of every sequence that samples.

# torch is imported inside the functions: front ends that only validate
# SamplingParams (the router's ingress) must not pay for importing it.
if TYPE_CHECKING:
    import torch


@dataclass
class SampleSpec:
    """What the sampler needs for one logits row."""

    params: SamplingParams
    # Per-sequence generator (seeded requests); None = the engine's shared generator.
    generator: torch.Generator | None
    # Token ids that must not be sampled now (EOS/stop ids before min_tokens is reached).
    banned_ids: tuple[int, ...] = ()
    # The sequence's grammar state when its request is constrained (structured output).
    grammar: SequenceGrammar | None = None


@dataclass
class SampleResult:
    token_id: int
    # {token_id: logprob} of the top ``params.logprobs`` tokens plus the sampled one.
    logprobs: dict[int, float] | None = None
    # Set when this row's own work (bias, ban mask, its generator, its logprobs) raised:
    # the row's request fails alone and ``token_id`` means nothing.
    error: Exception | None = None


def sample(logits: torch.Tensor, specs: list[SampleSpec], shared: torch.Generator) -> list[SampleResult]:
    """Pick one token per row of ``logits`` ([N, vocab], float32).

    Each row depends only on its own logits and generator, never on the rest of the
    batch, so a seeded request samples the same tokens whatever it is batched with.
    ``logit_bias`` is added first, then banned ids are masked, then constrained rows'
    grammar bitmasks are applied (one batched fill for the step; none when no row is
    constrained), for greedy and random rows alike, before temperature. Random rows use
    the exponential race (argmax of p / Exp(1)), which equals sampling from p and needs
    one generator call per row.

    Work done for one row alone runs under its own ``try``: a failure there marks that
    row's result (``SampleResult.error``) instead of failing the whole batch. Only a
    failure of the batched tensor work raises.
    """
    import torch

    errors: dict[int, Exception] = {}
    for i, spec in enumerate(specs):
        if spec.banned_ids or spec.params.logit_bias:
            try:
                _adjust_row(logits, i, spec)
            except Exception as exc:  # noqa: BLE001 - reported on the row
                errors[i] = exc
                logits[i] = 0.0  # keeps the batched math finite; the row's token is discarded
    constrained = [i for i, s in enumerate(specs) if s.grammar is not None and i not in errors]
    if constrained:
        apply_grammar_bitmasks(logits, constrained, [specs[i].grammar for i in constrained], errors)
    tokens = logits.max(dim=-1).indices  # the first maximum, like argmax, and ~2x faster on CPU
    random_rows = [i for i, s in enumerate(specs) if not s.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, rows)
        temps = torch.tensor([specs[i].params.temperature for i in random_rows],
                             dtype=sub.dtype, device=sub.device)
        sub = _top_k_top_p(sub / temps.unsqueeze(1), [specs[i].params for i in random_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        shared_rows = []
        for j, i in enumerate(random_rows):
            gen = specs[i].generator
            if gen is None:
                shared_rows.append(j)
            else:
                try:
                    noise[j].exponential_(generator=gen)
                except Exception as exc:  # noqa: BLE001 - reported on the row
                    errors[i] = exc
                    noise[j] = 1.0
        if shared_rows:
            idx = torch.tensor(shared_rows, dtype=torch.long, device=noise.device)
            noise[idx] = torch.empty(len(shared_rows), probs.shape[1], device=noise.device).exponential_(
                generator=shared)
        tokens[rows] = (probs / noise).argmax(dim=-1)
    token_list = tokens.tolist()
    results = [SampleResult(t) for t in token_list]
    want = [i for i, s in enumerate(specs) if s.params.logprobs is not None]
    if want:
        logprobs = torch.log_softmax(logits[want], dim=-1)
        for j, i in enumerate(want):
            try:
                results[i].logprobs = _row_logprobs(logprobs[j], specs[i].params.logprobs or 0, token_list[i])
            except Exception as exc:  # noqa: BLE001 - reported on the row
                errors[i] = exc
    for i, error in errors.items():
        results[i].error = error
    return results


def _adjust_row(logits: torch.Tensor, i: int, spec: SampleSpec) -> None:
    """Add row ``i``'s logit bias, then mask its banned ids (a ban wins over any bias)."""
    import torch

    row = logits[i]
    bias = spec.params.logit_bias
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device))
    if spec.banned_ids:
        row[list(spec.banned_ids)] = float("-inf")


def _row_logprobs(logprobs: torch.Tensor, k: int, token: int) -> dict[int, float]:
    """{token_id: logprob} of the top ``k`` tokens of one row plus the sampled ``token``."""
    import torch

    entry: dict[int, float] = {}
    if k:
        top = torch.topk(logprobs, k)
        # Tokens masked to -inf (a grammar allowing fewer than k) cannot come next: not candidates.
        entry = {t: v for t, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")}
    entry[token] = float(logprobs[token])
    return entry


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top_k and top_p nucleus."""
    import torch

    if all(p.top_k is None and p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    above = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(above >= top_ps.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
