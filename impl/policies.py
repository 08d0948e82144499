"""Scheduling policies (R9): victim choice, waiting order and admission gate.

A policy is the mutable engine's counterpart of the spec's three pure choices,
registered under the same name in ``POLICIES``:

* ``select_victim(running, start)`` returns the index (``>= start``) in ``running`` of
  the request to preempt among the candidates ``running[start:]``;
* ``new_waiting_queue()`` builds the waiting queue, whose ``peek``/``pop`` walk the
  requests in the policy's order while ``stored()`` keeps the spec's stored order
  (preempted at the front, new at the tail);
* ``can_admit(seq, ...)`` is the admission gate (every shipped policy admits all).

* ``lifo``: victim = the last candidate (``running.pop()``, O(1)); waiting in stored
  order (a deque);
* ``priority``: victim = the largest ``(priority, arrival)`` (O(candidates)); waiting
  by ``(priority, arrival)`` (a heap);
* ``fewest-outputs``: victim = fewest outputs, then longest prompt, then the latest
  (O(candidates)); waiting in stored order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Protocol

from impl.sequence import Sequence
from spec.types import ConfigError


class WaitingQueue(Protocol):
    """The waiting requests: stored order for ``observe()``, policy order for admission."""

    def __len__(self) -> int: ...
    def push_back(self, seq: Sequence) -> None:
        """A new request: tail of the stored order (R4)."""

    def push_front(self, seq: Sequence) -> None:
        """A preempted request: head of the stored order (R6)."""

    def peek(self) -> Sequence:
        """The next request in the policy's order (the queue is not empty)."""

    def pop(self) -> Sequence:
        """Remove and return ``peek()`` (it is admitted)."""

    def unpop(self, seq: Sequence) -> None:
        """Undo the last ``pop`` (rollback)."""

    def unpush_front(self, seq: Sequence) -> None:
        """Undo the last ``push_front`` (rollback)."""

    def remove(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is (abort); O(len)."""

    def stored(self) -> list[Sequence]:
        """The requests in stored order, head first."""


class FifoWaitingQueue:
    """Stored order is the policy order: a deque, O(1) at both ends."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push_back(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def unpop(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def unpush_front(self, seq: Sequence) -> None:
        head = self._queue.popleft()
        assert head is seq, "rollback out of order"

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def stored(self) -> list[Sequence]:
        return list(self._queue)


class PriorityWaitingQueue:
    """A heap on ``(priority, arrival)`` (vLLM V1's priority queue).

    The stored order is kept as a key per entry: a front insertion takes a decreasing
    key, a tail insertion an increasing one, and ``stored()`` sorts by it (only
    ``observe()`` needs it). ``(priority, arrival)`` is unique (arrivals are), so the
    heap never compares two ``Sequence`` objects.
    """

    __slots__ = ("_back_key", "_front_key", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []
        self._front_key = 0  # next front key is _front_key - 1
        self._back_key = 0  # next back key is _back_key

    def __len__(self) -> int:
        return len(self._heap)

    def push_back(self, seq: Sequence) -> None:
        seq.queue_key = self._back_key
        self._back_key += 1
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))

    def push_front(self, seq: Sequence) -> None:
        self._front_key -= 1
        seq.queue_key = self._front_key
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))

    def peek(self) -> Sequence:
        return self._heap[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def unpop(self, seq: Sequence) -> None:
        # The seq keeps its queue_key, so its stored position is unchanged.
        heapq.heappush(self._heap, (seq.priority, seq.arrival, seq))

    def unpush_front(self, seq: Sequence) -> None:
        assert seq.queue_key == self._front_key, "rollback out of order"
        self.remove(seq)
        self._front_key += 1

    def remove(self, seq: Sequence) -> None:
        heap = self._heap
        for index, entry in enumerate(heap):
            if entry[2] is seq:
                last = heap.pop()
                if index < len(heap):
                    heap[index] = last
                    heapq.heapify(heap)
                return
        raise ValueError(f"{seq.request_id!r} is not waiting")

    def stored(self) -> list[Sequence]:
        return sorted((entry[2] for entry in self._heap), key=lambda seq: seq.queue_key)


class Policy:
    """LIFO (vLLM, nano-vllm, the seed): preempt the most recently admitted request."""

    name = "lifo"
    #: False lets the scheduler skip calling ``can_admit`` (every shipped policy).
    has_admission_gate = False

    def select_victim(self, running: list[Sequence], start: int) -> int:
        return len(running) - 1

    def new_waiting_queue(self) -> WaitingQueue:
        return FifoWaitingQueue()

    def can_admit(self, seq: Sequence, *, num_running: int, num_free_blocks: int) -> bool:
        """The admission gate of R8 step 3 (default: always admit)."""
        return True


LifoPolicy = Policy


class PriorityPolicy(Policy):
    """vLLM V1's priority scheduling: lower value is more important, then earlier arrival."""

    name = "priority"

    def select_victim(self, running: list[Sequence], start: int) -> int:
        best = start
        best_key = (running[start].priority, running[start].arrival)
        for index in range(start + 1, len(running)):
            seq = running[index]
            key = (seq.priority, seq.arrival)
            if key > best_key:
                best, best_key = index, key
        return best

    def new_waiting_queue(self) -> WaitingQueue:
        return PriorityWaitingQueue()


class FewestOutputsPolicy(Policy):
    """SGLang's retraction order: fewest outputs, then longest prompt, then latest."""

    name = "fewest-outputs"

    def select_victim(self, running: list[Sequence], start: int) -> int:
        last = len(running) - 1
        best = last
        seq = running[last]
        best_key = (seq.num_tokens - seq.num_prompt_tokens, -seq.num_prompt_tokens)
        # Walking backwards and replacing only on a strictly smaller key keeps the
        # latest request among ties.
        for index in range(last - 1, start - 1, -1):
            seq = running[index]
            key = (seq.num_tokens - seq.num_prompt_tokens, -seq.num_prompt_tokens)
            if key < best_key:
                best, best_key = index, key
        return best


#: Policy name -> factory, the same names the spec registers.
POLICIES: dict[str, Callable[[], Policy]] = {
    "lifo": LifoPolicy,
    "priority": PriorityPolicy,
    "fewest-outputs": FewestOutputsPolicy,
}


def make_policy(name: str) -> Policy:
    """A fresh policy registered as ``name``; an unknown name is a ``ConfigError``."""
    try:
        factory = POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown scheduling policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
    return factory()
