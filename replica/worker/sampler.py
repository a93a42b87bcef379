"""The sampler: one call per step over the logits of every sequence that samples (torch).

One logits pipeline in vLLM v1's order (masks, logit_bias, penalties, grammar bitmasks,
temperature, min_p, top-k/p, seeds) and the prompt logprobs, reading each row's
SamplingParams (replica/sampling_params.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefixserve.replica.errors import RequestRejected
from prefixserve.replica.sampling_params import GREEDY_TEMPERATURE, LOGPROBS_MODES, SamplingParams
from prefixserve.replica.structured_output.state import SequenceGrammar, apply_grammar_bitmasks

# torch is imported inside the functions: importing this module stays cheap.
if TYPE_CHECKING:
    import torch


# Penalized logits are bounded so that dividing by the smallest temperature stays finite
# (a repetition_penalty near 0 scales logits past float32's range).
_PENALIZED_LOGIT_BOUND = 3.0e38 * GREEDY_TEMPERATURE


@dataclass
class SampleSpec:
    """What the sampler needs for one logits row."""

    params: SamplingParams
    # Per-sequence generator (seeded requests); None = the engine's shared generator.
    generator: torch.Generator | None
    # Token ids that must not be sampled now (EOS/stop ids before min_tokens is reached).
    banned_ids: tuple[int, ...] = ()
    # The sequence's tokens so far, prompt first (read by penalties and bad_words only).
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    # ``params.bad_words`` as token ids (the engine tokenizes them once per request).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The sequence's grammar state when its request is constrained (structured output).
    grammar: SequenceGrammar | None = None

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def masks_row(self) -> bool:
        """Whether this row has per-row mask or bias work (the first stage of ``process_logits``)."""
        p = self.params
        return bool(self.banned_ids or p.logit_bias or p.allowed_token_ids is not None or self.bad_words_token_ids)


@dataclass
class SampleResult:
    token_id: int
    # {token_id: logprob} of the top ``params.logprobs`` tokens plus the sampled one.
    logprobs: dict[int, float] | None = None
    # Set when this row's own work (bias, ban mask, its generator, its logprobs) raised:
    # the row's request fails alone and ``token_id`` means nothing.
    error: Exception | None = None


class NoTokenLeftError(RequestRejected):
    """Every token of a row is masked (allowed_token_ids, bad_words and min_tokens exclude all)."""


def process_logits(logits: torch.Tensor, specs: list[SampleSpec]) -> dict[int, Exception]:
    """The temperature-independent stages, in place, in vLLM v1's order; per-row errors.

    1. Masks and bias, per row: ``allowed_token_ids``, ``bad_words``, ``logit_bias``,
       then the min_tokens ban (a ban wins over any bias).
    2. Penalties, batched over the rows that set one: repetition (prompt and output
       tokens), then frequency and presence (output tokens).
    3. The grammar bitmasks of structured output, batched over the constrained rows:
       after penalties, before temperature.

    A row with no work in a stage is not touched by it; a batch with none costs
    nothing. A row whose own work fails is zeroed and reported. A row left with no
    token at all is ``sample``'s to report (its top logit is -inf).
    """
    errors: dict[int, Exception] = {}
    masked = [i for i, spec in enumerate(specs) if spec.masks_row]
    for i in masked:
        try:
            _mask_row(logits, i, specs[i])
        except Exception as exc:  # noqa: BLE001 - reported on the row
            errors[i] = exc
            logits[i] = 0.0  # keeps the batched math finite; the row's token is discarded
    penalized = [i for i, spec in enumerate(specs) if spec.params.has_penalties and i not in errors]
    if penalized:
        _apply_penalties(logits, penalized, specs)
    constrained = [i for i, s in enumerate(specs) if s.grammar is not None and i not in errors]
    if constrained:
        apply_grammar_bitmasks(logits, constrained, [specs[i].grammar for i in constrained], errors)
    return errors


def sample(
    logits: torch.Tensor, specs: list[SampleSpec], shared: torch.Generator, logprobs_mode: str = "raw_logprobs"
) -> list[SampleResult]:
    """Pick one token per row of ``logits`` ([N, vocab], float32); see ``sample_tokens``."""
    return sample_tokens(logits, specs, shared, logprobs_mode)[0]


def sample_tokens(
    logits: torch.Tensor, specs: list[SampleSpec], shared: torch.Generator, logprobs_mode: str = "raw_logprobs"
) -> tuple[list[SampleResult], torch.Tensor]:
    """Pick one token per row of ``logits`` ([N, vocab], float32): the results, and the
    sampled ids as an int64 tensor on the logits' device (a row that failed holds a valid id
    that means nothing), which asynchronous scheduling feeds to the next step's inputs.

    Each row depends only on its own logits and generator, never on the rest of the
    batch, so a seeded request samples the same tokens whatever it is batched with.
    ``process_logits`` runs first (masks, bias, penalties, then constrained rows'
    grammar bitmasks in one batched fill; none when no row is constrained) for greedy
    and random rows alike; logprobs are read there. Greedy rows then take the argmax;
    random rows are divided by their temperature, then ``min_p``, ``top_k`` and
    ``top_p`` drop tokens (the top token always stays), and the exponential race
    (argmax of p / Exp(1)), which equals sampling from p, picks one with one generator
    call per row.

    ``logprobs_mode`` (``LOGPROBS_MODES``, vLLM's): what the rows that ask for logprobs
    report. ``raw_*`` reads the logits as they came in, before any stage; ``processed_*``
    the logits the token was picked from: after ``process_logits`` for a greedy row,
    also after temperature, min_p and top-k/top-p for a random one (vLLM's order).

    Work done for one row alone runs under its own ``try``: a failure there marks that
    row's result (``SampleResult.error``) instead of failing the whole batch. Only a
    failure of the batched tensor work raises.
    """
    import torch

    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode {logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    want = [i for i, s in enumerate(specs) if s.params.logprobs is not None]
    # Read before any stage touches the logits (raw), or filled below where each row's are final.
    reported: torch.Tensor | None = None
    if want and logprobs_mode.startswith("raw_"):
        reported = logits[want].clone()
    elif want:
        reported = torch.empty((len(want), logits.shape[1]), dtype=logits.dtype, device=logits.device)
    errors = process_logits(logits, specs)
    if reported is not None and logprobs_mode.startswith("processed_"):
        reported.copy_(logits[want])  # a random row's are overwritten below, after its sampling stages
    tokens, top = greedy_tokens(logits)
    # Rows whose masks exclude every token: found with the tokens' own transfer, no extra sync.
    dead = top == float("-inf") if any(s.masks_row or s.grammar is not None for s in specs) else None
    random_rows = [i for i, s in enumerate(specs) if not s.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, rows)
        params = [specs[i].params for i in random_rows]
        temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
        sub = _top_k_top_p(_min_p(sub / temps.unsqueeze(1), params), params)
        if reported is not None and logprobs_mode.startswith("processed_"):
            position = {i: j for j, i in enumerate(want)}
            for j, i in enumerate(random_rows):
                if i in position:
                    reported[position[i]] = sub[j]
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
                generator=shared
            )
        tokens[rows] = (probs / noise).argmax(dim=-1)
    sampled = tokens
    if dead is not None:
        tokens = tokens.masked_fill(dead, -1)
    token_list = tokens.tolist()
    for i, t in enumerate(token_list):
        if t < 0 and i not in errors:
            errors[i] = NoTokenLeftError(
                "no token can be sampled: allowed_token_ids, bad_words, logit_bias and min_tokens exclude every token"
            )
            token_list[i] = 0
    results = [SampleResult(t) for t in token_list]
    if reported is not None:
        logprobs = torch.log_softmax(reported, dim=-1) if logprobs_mode.endswith("_logprobs") else reported
        for j, i in enumerate(want):
            try:
                results[i].logprobs = _row_logprobs(logprobs[j], specs[i].params.logprobs or 0, token_list[i])
            except Exception as exc:  # noqa: BLE001 - reported on the row
                errors[i] = exc
    for i, error in errors.items():
        results[i].error = error
    return results, sampled


def advance_generator(generator: torch.Generator, draws: int, width: int) -> None:
    """Move a seeded sequence's generator past ``draws`` sampled tokens of rows ``width`` logits wide.

    ``sample_tokens`` takes one exponential draw of the row's width per token of a random row, so a
    stream continued on another replica (replica/contract/continuation.py) draws next what the first
    replica would have drawn.
    """
    import torch

    row = torch.empty(width, dtype=torch.float32, device=generator.device)
    for _ in range(draws):
        row.exponential_(generator=generator)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum (argmax's tie rule) and its value, as tensors on the logits' device.

    On CPU through numpy: its argmax is SIMD-vectorized, where torch's index-returning
    reductions are not (7x faster over [64, 49,152] float32 on a 2-core x86 VM), and the
    rows' values are then one gather.
    """
    import torch

    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        best = logits.max(dim=-1)
        return best.indices, best.values
    rows = logits.detach().contiguous().numpy()
    indices = rows.argmax(axis=1)
    values = rows[np.arange(rows.shape[0]), indices]
    return torch.from_numpy(indices.astype(np.int64, copy=False)), torch.from_numpy(values)


def _mask_row(logits: torch.Tensor, i: int, spec: SampleSpec) -> None:
    """Row ``i``'s masks and bias: allowed_token_ids, bad_words, logit_bias, then banned ids."""
    import torch

    row = logits[i]
    p = spec.params
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)] = True
        row.masked_fill_(~keep, float("-inf"))
    if spec.bad_words_token_ids:
        banned = bad_word_bans(spec.bad_words_token_ids, spec.output_token_ids)
        if banned:
            row[list(banned)] = float("-inf")
    bias = p.logit_bias
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device))
    if spec.banned_ids:
        row[list(spec.banned_ids)] = float("-inf")


def bad_word_bans(bad_words: tuple[tuple[int, ...], ...], output: Sequence[int]) -> set[int]:
    """Tokens ``bad_words`` ban next (vLLM's rule): a word's last token, where the output
    ends in the rest of the word (a one-token word is always banned)."""
    banned = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix :]) == list(word[:prefix]):
            banned.add(word[-1])
    return banned


def _apply_penalties(logits: torch.Tensor, rows_list: list[int], specs: list[SampleSpec]) -> None:
    """vLLM's penalties on ``rows_list``, in place.

    Repetition: a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when not. Then ``frequency_penalty`` times the
    token's count in the output and ``presence_penalty`` once if it occurs there are
    subtracted. Masked tokens stay masked and the rest stay finite.
    """
    import torch

    device = logits.device
    rows = torch.tensor(rows_list, dtype=torch.long, device=device)
    sub = logits.index_select(0, rows)
    num, vocab = sub.shape
    params = [specs[i].params for i in rows_list]
    # One bincount over (row, token) pairs gives every row's output counts.
    flat: list[int] = []
    for j, i in enumerate(rows_list):
        base = j * vocab
        flat += (base + t for t in specs[i].output_token_ids)
    counts = torch.bincount(torch.tensor(flat, dtype=torch.long, device=device), minlength=num * vocab)
    counts = counts.view(num, vocab).to(sub.dtype)
    seen_out = counts > 0
    was_masked = sub == float("-inf")
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = seen_out.clone()
        for j, i in enumerate(rows_list):
            prompt = specs[i].token_ids[: specs[i].num_prompt_tokens]
            if prompt and params[j].repetition_penalty != 1.0:
                seen[j, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        # float32's range: a penalty of 1e-300 or 1e300 is 0 or inf there.
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float64)
        rep = rep.clamp(torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max).to(sub.dtype).to(device)
        factor = torch.where(seen, rep.unsqueeze(1), torch.ones((), dtype=sub.dtype, device=device))
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=device).unsqueeze(1)
    sub = sub - freq * counts - presence * seen_out.to(sub.dtype)
    sub = sub.clamp(-_PENALIZED_LOGIT_BOUND, _PENALIZED_LOGIT_BOUND).masked_fill(was_masked, float("-inf"))
    logits.index_copy_(0, rows, sub)


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


def prompt_logprobs(
    logits: torch.Tensor, next_tokens: Sequence[int], k: int
) -> tuple[list[dict[int, float]], list[int]]:
    """{token_id: logprob} per row of raw ``logits`` ([P, vocab]): the top ``k`` plus the
    prompt token that follows the row's position (vLLM's prompt_logprobs, unprocessed logits),
    and that token's rank in its row (1 = the most likely; vLLM's ``rank``)."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    column = logprobs.gather(1, torch.tensor(list(next_tokens), dtype=torch.long, device=logits.device).unsqueeze(1))
    ranks = ((logprobs > column).sum(dim=-1) + 1).tolist()
    actual = column.squeeze(1).tolist()
    out: list[dict[int, float]] = []
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        for ids, values in zip(top.indices.tolist(), top.values.tolist()):
            out.append(dict(zip(ids, values)))
    else:
        out = [{} for _ in next_tokens]
    for entry, token, value in zip(out, next_tokens, actual):
        entry[token] = value
    return out, ranks


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's min_p on temperature-scaled logits: drop tokens whose probability is below
    ``min_p`` times the row's top probability (the top token always stays)."""
    import torch

    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = torch.softmax(logits, dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top_k and top_p nucleus; the top token always stays."""
    import torch

    if all(p.top_k is None and p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    # float32: a top_p of 1e-300 is 0 here, and the rule below alone would then drop every token.
    top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; rank 0 never.
    above = probs.cumsum(dim=-1) - probs
    drop = (above >= top_ps.unsqueeze(1)) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
