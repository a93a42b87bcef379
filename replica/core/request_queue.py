"""The scheduler's waiting queue, one class per scheduling policy (vLLM's ``--scheduling-policy``).

* ``fcfs``: arrival order; a preempted sequence goes back to the front (it runs next).
* ``priority``: the lowest ``(priority, arrival_time, arrival_order)`` first, on a binary heap
  (O(log n) per insert and pop). A preempted sequence goes back to its place by that key, as in
  vLLM's ``PriorityRequestQueue``: there is no front in a priority queue.

``arrival_order`` (``Request.arrival_order``, set by ``Scheduler.add``) breaks ties of the first
two, so the order is total and the same on every run.

Iterating a queue copies it in one C call before any Python code runs, so another thread may
read it while the engine thread changes it (``LLMEngine.queued_prefill_tokens`` does).

Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the engine config reads SCHEDULING_POLICIES without the request types
    from prefixserve.replica.core.request import Sequence

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """What the priority policy orders by: lower first (vLLM's rule: priority, then arrival)."""
    req = seq.request
    return (req.priority, req.arrival_time, req.arrival_order)


class WaitingQueue(Protocol):
    """The sequences waiting for admission, in the order the scheduler admits them."""

    def push(self, seq: Sequence) -> None:
        """Queue a new sequence."""

    def push_preempted(self, seq: Sequence) -> None:
        """Queue a sequence just preempted."""

    def peek(self) -> Sequence:
        """The next sequence to admit (IndexError when empty)."""

    def pop(self) -> Sequence:
        """Remove and return the next sequence to admit (IndexError when empty)."""

    def remove(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is (ValueError when absent)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    """First come, first served; a preempted sequence is next."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_preempted(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._items))


class PriorityQueue:
    """Lowest ``priority_key`` first; a preempted sequence takes its place by its key."""

    def __init__(self) -> None:
        # Entries (*priority_key, push count, sequence): the count orders the preempted children
        # of one request (their keys are equal) and keeps the comparison off the Sequence, which
        # has no order.
        self._heap: list[tuple[int, float, int, int, Sequence]] = []
        self._pushes = 0

    def push(self, seq: Sequence) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (*priority_key(seq), self._pushes, seq))

    def push_preempted(self, seq: Sequence) -> None:
        self.push(seq)

    def peek(self) -> Sequence:
        return self._heap[0][-1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[-1]

    def remove(self, seq: Sequence) -> None:
        # O(n): only an abort or a failure of a waiting request comes here.
        for i, entry in enumerate(self._heap):
            if entry[-1] is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{seq.seq_id} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([entry[-1] for entry in sorted(self._heap)])


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of ``policy`` (one of SCHEDULING_POLICIES)."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
