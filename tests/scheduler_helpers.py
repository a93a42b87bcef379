"""The scheduler without a model: sequences, the engine's step after the model, random workloads,
and a fake device that carries real block contents through every KV move."""

from __future__ import annotations

import random
from collections.abc import Iterator

from prefixserve.replica.core.request import PreparedRequest, Request, Sequence
from prefixserve.replica.core.sched_output import SchedulerOutput
from prefixserve.replica.core.scheduler import Scheduler
from prefixserve.replica.kv.manager import KVCacheManager
from prefixserve.replica.sampling_params import SamplingParams


def make_seq(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    n: int = 1,
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    retention_owner: str | None = None,
) -> Sequence:
    """A greedy request's first sequence, not yet added to a scheduler (``retention_owner``: it asked
    for prompt_cache_retention 24h, pinning for that owner)."""
    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens)
    prepared = PreparedRequest(
        rid, tuple(prompt), params, None, arrival_time, priority=priority, retention_owner=retention_owner
    )
    req = Request(prepared)
    seq = Sequence(rid, req, 0, list(prompt), len(prompt))
    req.seqs.append(seq)
    return seq


def fake_step(sched: Scheduler, out, first_token: int = 1000) -> list[Sequence]:
    """What the engine does after the model: sampling sequences get a token (``first_token`` plus
    their output count, so it tells outputs apart from prompts); done ones finish."""
    finished = []
    for s in out.scheduled:
        if s.samples:
            seq = s.seq
            seq.token_ids.append(first_token + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    return finished


def random_sequences(
    rng: random.Random,
    count: int,
    *,
    num_prefixes: int,
    prefix_len: tuple[int, int],
    suffix_len: tuple[int, int],
    max_tokens: tuple[int, int],
) -> list[Sequence]:
    """``count`` sequences ``r0``.. whose prompts are one of ``num_prefixes`` shared prefixes plus a
    suffix of their own; lengths and max_tokens drawn from the ``randrange`` bounds given."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(*prefix_len))] for _ in range(num_prefixes)]
    return [
        make_seq(
            f"r{i}",
            rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(*suffix_len))],
            max_tokens=rng.randrange(*max_tokens),
        )
        for i in range(count)
    ]


def random_steps(
    rng: random.Random, sched: Scheduler, pending: list[Sequence], max_steps: int, max_new: int
) -> Iterator[SchedulerOutput]:
    """The plans of a run that adds up to ``max_new - 1`` of ``pending`` (from its end) before each
    step, until nothing is pending or unfinished, or ``max_steps`` steps; the caller runs each plan."""
    for _ in range(max_steps):
        if not (pending or sched.has_unfinished()):
            return
        for _ in range(rng.randrange(0, max_new)):
            if pending:
                sched.add(pending.pop())
        yield sched.schedule()


class FakeDevice:
    """Block contents (the token id at each slot) moved as the engine moves KV: swap-outs
    (offloads included), then swap-ins (copy-backs included), then copy-on-write copies,
    then the step's writes. Every position already computed must hold its own token."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.bs = kv.block_size
        self.device: list[list[int | None]] = [[None] * self.bs for _ in range(kv.num_blocks)]
        self.host: list[list[int | None]] = [[None] * self.bs for _ in range(kv.num_host_blocks)]

    def step(self, out) -> None:
        slots = [slot for _, slot in out.swap_out]
        assert len(slots) == len(set(slots)), "a host slot written twice in one step"
        for dev, slot in out.swap_out:
            self.host[slot] = list(self.device[dev])
        for slot, dev in out.swap_in:
            self.device[dev] = list(self.host[slot])
        for src, dst in out.copy_ops:
            self.device[dst] = list(self.device[src])
        for s in out.scheduled:
            toks, table = s.seq.token_ids, s.block_table
            for pos in range(s.start):
                if table[pos // self.bs] < 0:  # a block freed by a sliding window
                    continue
                assert self.device[table[pos // self.bs]][pos % self.bs] == toks[pos], (
                    f"{s.seq.seq_id}: position {pos} lost its KV"
                )
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.device[table[pos // self.bs]][pos % self.bs] = toks[pos]
