"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step gets a token budget (``max_num_batched_tokens``). Running sequences come
first, in admission order: a decoding sequence takes one token, a sequence still
prefilling takes as much of its remaining prompt as the budget allows (chunked
prefill). Then waiting sequences are admitted in arrival order while the budget,
``max_num_seqs`` and the KV blocks allow, each starting after the longest cached
prefix of its tokens (``KVCacheManager.get_computed_blocks``).

When a running sequence cannot get a block, the most recently admitted running
sequence is preempted and goes back to the front of the waiting queue.

The ``priority`` scheduling policy (vLLM's ``--scheduling-policy priority``) orders both
lists by ``(priority, arrival_time, arrival order)``, lowest first
(replica/core/request_queue.py): the waiting queue is a heap, and the running list is kept
in that order, so the sequence preempted is the running one of the highest priority value
and, among equals, the latest arrival, the one vLLM's priority scheduler picks. A preempted
sequence re-enters the waiting queue at its key's place. As in vLLM, a waiting sequence never
preempts a running one, whatever their priorities: it waits for room. Under ``fcfs``
(default) both orders are admission order, as above.

A preempted sequence resumes by recompute
(``preemption_mode="recompute"``): its blocks are freed and its progress reset (its
full blocks usually remain cached, so it resumes with prefix hits). By swap
(``"swap"``): ``KVCacheManager.swap_out`` keeps its KV (blocks copied to the host
pool, blocks shared with running sequences kept by reference) and its progress; when
it is admitted again ``swap_in`` restores the same table and it continues where it
stopped, recomputing nothing. A swap that cannot happen (host pool full) is a
recompute, and so is a swapped sequence that cannot be swapped in even with nothing
running. No waiting sequence is admitted (or swapped in) in a step that
preempted: the blocks just freed go to the sequences already running, and no step
both swaps out and swaps in.

A waiting sequence that does not fit while nothing runs (every seat, block and token
of the budget free) can never be admitted: it leaves the queue as ``rejected`` so it
never blocks the requests behind it. The engine validates requests so that this
does not happen; the scheduler does not rely on it.

Invariants: a sequence is in exactly one of waiting / running / (finished, in
neither); for a running sequence ``kv.num_tokens(seq_id) == num_computed_tokens``
between steps; a scheduled sequence's ``num_computed_tokens`` is advanced when it is
scheduled (the step computes those tokens before the next schedule).

Asynchronous scheduling (replica/engine/step_pipeline.py) schedules a step while the one
before it still runs: a sequence that step samples has a placeholder
(``Sequence.num_placeholders``) for the token it will get, and is scheduled for that one
token (its KV). A placeholder that must end the sequence (``max_tokens``,
``max_model_len``) is not scheduled. The engine asks ``may_preempt`` first and schedules
synchronously when it says yes: a preemption never meets a step in flight. A sequence
finished while a step in flight still holds it keeps its blocks until that step is done
(``finish(..., free_blocks=False)``, then ``free``).

Pure Python: no torch. The engine applies the model; tests drive it with a fake step.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from prefixserve.replica.contract.retention import RETENTION_PINNED, RETENTION_UNPINNED
from prefixserve.replica.core.request import SeqStatus, Sequence
from prefixserve.replica.core.request_queue import SCHEDULING_POLICIES, make_waiting_queue, priority_key
from prefixserve.replica.core.sched_output import ScheduledSeq, SchedulerOutput
from prefixserve.replica.kv.manager import KVCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap" (needs a KV manager with host blocks)
    # Free a finished sequence's generated blocks to the cold end, unless its request is a
    # conversation turn (EngineConfig.evict_generated_first).
    evict_generated_first: bool = False
    # Free a sequence's static-prefix blocks as reused ones (Request.static_prefix_tokens;
    # EngineConfig.protect_static_prefix).
    protect_static_prefix: bool = False
    # A sequence ends at this many tokens (the engine's max_model_len): a placeholder that
    # reaches it is not scheduled. None = no bound here.
    max_model_len: int | None = None
    # "fcfs" or "priority" (EngineConfig.scheduling_policy; replica/core/request_queue.py).
    scheduling_policy: str = "fcfs"
    # LoRA adapters the running sequences may use at once (EngineConfig.max_loras: the model's
    # slots); a sequence of another adapter waits. None = no LoRA.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = make_waiting_queue(config.scheduling_policy)
        # Admission order under fcfs, priority_key order under priority: the last is the victim.
        self.running: list[Sequence] = []
        self._by_priority = config.scheduling_policy == "priority"
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        # By how they happened: swapped out, or recomputed (incl. swaps the host pool refused).
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        # Swapped sequences resumed by recompute (they could not be swapped in with nothing running).
        self.num_swap_in_fallbacks = 0
        # Requests that asked for retention and were served unpinned: the pin budget could not hold them.
        self.num_pin_refusals = 0

    # --- queue changes -----------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ValueError if its request needs more seats than max_num_seqs."""
        width = seq.request.params.n if seq.awaits_fork else 1
        if width > self.config.max_num_seqs:
            raise ValueError(
                f"the request needs {width} sequences at once but max_num_seqs is {self.config.max_num_seqs}"
            )
        seq.status = SeqStatus.WAITING
        seq.request.arrival_order = next(self._arrivals)
        self.waiting.push(seq)

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Place forked children right after their (running) parent: same admission age."""
        at = self.running.index(parent) + 1
        for c in children:
            c.status = SeqStatus.RUNNING
        self.running[at:at] = children

    def finish(self, seq: Sequence, *, free_blocks: bool = True) -> None:
        """Remove a sequence for good and free its blocks (with ``free_blocks=False`` the caller
        calls ``free`` later: a step in flight still reads and writes them)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if free_blocks:
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks, pinning them first when its request was admitted pinned."""
        request = seq.request
        if request.cache_retention == RETENTION_PINNED and request.retention_owner is not None:
            self.kv.pin(seq.seq_id, request.retention_owner)
        cold = self.config.evict_generated_first and not seq.request.conversation
        self.kv.free(seq.seq_id, generated_cold=cold, static_prefix_tokens=self._static_prefix(seq))

    def _static_prefix(self, seq: Sequence) -> int:
        """The static-prefix tokens whose blocks ``kv.free`` releases as reused (0: none)."""
        return seq.request.static_prefix_tokens if self.config.protect_static_prefix else 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step plan -----------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        kv.expire_pins()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_placeholders and self._ends_at_placeholder(seq):
                i += 1  # the token in flight finishes it: nothing to compute
                continue
            remaining = seq.num_scheduled_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                i += 1
                continue
            while (table := kv.allocate_slots(seq.seq_id, seq.token_ids, n)) is None:
                # Out of blocks: retention pins give way first (to the host tier, when there is one).
                if kv.release_pins(kv.num_blocks_needed(seq.seq_id, n) - kv.num_free_blocks):
                    continue
                # Then preempt the last running sequence (maybe seq itself): the youngest
                # under fcfs, the lowest priority under priority.
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or table is None:  # seq itself was preempted
                break
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, table))
            seq.num_computed_tokens += n
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        out.copy_ops = kv.take_copy_ops()
        out.swap_out, out.swap_in = kv.take_swap_ops()
        return out

    def _ends_at_placeholder(self, seq: Sequence) -> bool:
        """Whether the tokens in flight reach the sequence's max_tokens or max_model_len."""
        total = seq.num_scheduled_tokens
        limit = self.config.max_model_len
        return total - seq.num_prompt_tokens >= seq.request.params.max_tokens or (limit is not None and total >= limit)

    def may_preempt(self) -> bool:
        """Whether ``schedule`` now could preempt: the blocks every running sequence's remaining
        tokens need exceed the free ones (an upper bound of what it allocates; admission never
        preempts)."""
        kv, need = self.kv, 0
        for seq in self.running:
            remaining = seq.num_scheduled_tokens - seq.num_computed_tokens
            if remaining > 0:
                need += kv.num_blocks_needed(seq.seq_id, remaining)
        return need > kv.num_free_blocks

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if self.config.preemption_mode == "swap" and self.kv.swap_out(seq.seq_id):
            self.num_swap_preemptions += 1  # progress kept: it resumes where it stopped
        else:
            self.kv.free(seq.seq_id, static_prefix_tokens=self._static_prefix(seq))
            seq.num_computed_tokens = 0
            self.num_recompute_preemptions += 1
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.push_preempted(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            # The parent of an n > 1 request brings its children after the prefill.
            width = seq.request.params.n if seq.awaits_fork else 1
            if not self._adapter_fits(seq):
                break  # its adapter waits for a slot (max_loras): a running adapter's sequences must end
            if kv.is_swapped(seq.seq_id):
                if self._swap_in(seq, out, budget, width):
                    budget -= out.scheduled[-1].num_new_tokens
                    continue
                if kv.is_swapped(seq.seq_id):
                    break  # it waits for room
            table = None
            if len(self.running) + width <= self.config.max_num_seqs:
                salt = seq.request.block_keys
                # prompt_logprobs need every prompt position's logits: no hit (as vLLM).
                blocks, num_cached = (
                    ([], 0) if seq.request.needs_prompt_logits else kv.get_computed_blocks(seq.token_ids, salt)
                )
                remaining = seq.num_tokens - num_cached
                n = min(remaining, budget)
                if n == remaining or self.config.enable_chunked_prefill:
                    table = kv.allocate_slots(seq.seq_id, seq.token_ids, n, blocks, salt)
                    if table is None and not self.running:
                        # Nothing else will free room: the pins give way (their blocks stay cached).
                        if kv.release_pins(kv.num_blocks_needed(seq.seq_id, n, blocks) - kv.num_free_blocks):
                            table = kv.allocate_slots(seq.seq_id, seq.token_ids, n, blocks, salt)
            if table is None:
                if self.running:
                    break  # it waits for room (first come, first served)
                # Nothing runs, so nothing will free room for it: it can never be admitted.
                self.waiting.pop()
                seq.status = SeqStatus.FINISHED
                out.rejected.append(seq)
                continue
            self.waiting.pop()
            self._start_running(seq)
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = num_cached
            self._decide_retention(seq)
            out.scheduled.append(ScheduledSeq(seq, num_cached, n, table))
            seq.num_computed_tokens = num_cached + n
            budget -= n

    def _decide_retention(self, seq: Sequence) -> None:
        """At a retention request's first admission: pinned if the pin budget holds its prompt's blocks."""
        request = seq.request
        owner = request.retention_owner
        if owner is None or request.cache_retention is not None:
            return
        if self.kv.can_pin(seq.seq_id, owner):
            request.cache_retention = RETENTION_PINNED
        else:
            request.cache_retention = RETENTION_UNPINNED
            self.num_pin_refusals += 1

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether running ``seq`` keeps the running sequences within ``max_loras`` adapters."""
        name, limit = seq.request.lora_name, self.config.max_loras
        if name is None or limit is None:
            return True
        active = {s.request.lora_name for s in self.running} - {None}
        return name in active or len(active) < limit

    def _swap_in(self, seq: Sequence, out: SchedulerOutput, budget: int, width: int) -> bool:
        """Resume a swapped sequence at the front of the queue: True when it runs this step.

        False with the sequence still swapped: no room yet. False with it no longer swapped:
        it cannot fit even with nothing running, so its swapped KV was dropped and it goes
        through ordinary admission (recompute).
        """
        kv = self.kv
        table = None
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        fits = n == remaining or self.config.enable_chunked_prefill
        if len(self.running) + width <= self.config.max_num_seqs and fits:
            table = kv.swap_in(seq.seq_id, seq.token_ids, n)
        if table is None:
            if not self.running:
                self._swap_in_fallback(seq)
            return False
        self.waiting.pop()
        self._start_running(seq)
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, table))
        seq.num_computed_tokens += n
        return True

    def _start_running(self, seq: Sequence) -> None:
        """Put an admitted sequence in the running list: last under fcfs, at its key's place under
        priority (after its equals, so it is preempted before them)."""
        if self._by_priority:
            bisect.insort_right(self.running, seq, key=priority_key)
        else:
            self.running.append(seq)
        seq.status = SeqStatus.RUNNING

    def _swap_in_fallback(self, seq: Sequence) -> None:
        self.kv.discard_swapped(seq.seq_id)
        seq.num_computed_tokens = 0
        self.num_swap_in_fallbacks += 1
