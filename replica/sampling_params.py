"""SamplingParams: what a request asks of the sampler (vLLM's names, defaults and ranges).

Plain data, validated on construction so that every front end (offline LLM, HTTP
server, Ray ingress) refuses the same bad values with the same message. Checks that
need the model (vocabulary size, ``max_num_seqs``, the context length) are the
engine's (``InputProcessor.validate``). The sampler that reads it is
replica/worker/sampler.py. No torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from prefixserve.replica.structured_output.params import StructuredOutputsParams

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
# vLLM's ranges: presence and frequency penalties in [-2, 2] (OpenAI's), repetition_penalty
# above 0 (1.0 is off), min_p in [0, 1], logprobs and prompt_logprobs up to max_logprobs (20).
PENALTY_LIMIT = 2.0
MAX_LOGPROBS = 20
# What a sampled token's ``logprobs`` are read from (vLLM's ``logprobs_mode``, EngineConfig's knob):
# the model's logits as they come ("raw_*", the default: the same numbers whatever the sampling
# parameters), or the ones the token was drawn from ("processed_*": after masks, bias, penalties
# and the grammar bitmask; for a random row also after temperature, min_p, top-k and top-p).
# "*_logprobs" are log-softmaxed, "*_logits" not.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# bad_words are tokenized per request and matched against the output every step: bounded.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


def _is_int(value: Any) -> bool:
    # numbers.Integral admits numpy integers; bool is an int subclass but never a count or id.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float in [lo, hi] ((lo, hi] with ``lo_open``); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name} is out of range, got {value!r}") from None
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

    vLLM's logits processing: ``allowed_token_ids`` (only these may be sampled),
    ``bad_words`` (a word's last token is banned where the output ends in the rest of
    it), ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] over the output
    tokens, ``repetition_penalty`` > 0 over prompt and output tokens (1.0 is off),
    ``min_p`` in [0, 1] (tokens below ``min_p`` times the top probability are
    dropped). ``prompt_logprobs`` in [0, 20]: the logprobs of every prompt token
    (the request then skips prefix-cache hits: it needs every prompt position's
    logits). Output text: ``include_stop_str_in_output``, ``skip_special_tokens``,
    ``spaces_between_special_tokens``. At their defaults none of these costs anything.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        self._check_stops()
        # An empty map is no map: the sampler then skips the bias entirely.
        self.logit_bias = self._checked_logit_bias(self.logit_bias) if self.logit_bias else None
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT
        )
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True
        )
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        self._check_token_lists()
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    def _check_token_lists(self) -> None:
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(
                    f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters, got {word!r:.40}"
                )
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids or omitted")
            if any(not _is_int(t) or t < 0 for t in allowed):
                raise ValueError("allowed_token_ids must be non-negative integers")
            self.allowed_token_ids = [int(t) for t in allowed]

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
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

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler then counts the row's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def child_seed(self, index: int) -> int | None:
        """The seed of sequence ``index`` (None when unseeded); always in [0, 2**64 - 1]."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS
