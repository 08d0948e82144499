"""The waiting queue (R1, R9): stored order for ``observe()``, policy order for admission.

A policy's ``new_waiting_queue()`` builds one. ``FifoWaitingQueue`` serves the stored
order itself (preempted requests at the front, new ones at the tail);
``KeyedWaitingQueue`` serves the order of a key (a heap) and keeps the stored order
as a number per entry. Every operation has an exact inverse for ``rollback``.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol

from impl.sequence import Sequence


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


class KeyedWaitingQueue:
    """A heap on ``key(seq)``: the policy order is the order of the keys, smallest first.

    A subclass defines ``key``, which must be unique (end it with ``seq.arrival``) and
    must not change while the request waits (nothing about a waiting request changes),
    so the heap never compares two ``Sequence`` objects.

    The stored order is kept as a number per entry: a front insertion takes a
    decreasing one, a tail insertion an increasing one, and ``stored()`` sorts by it
    (only ``observe()`` needs it).
    """

    __slots__ = ("_back_key", "_front_key", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], Sequence]] = []
        self._front_key = 0  # next front key is _front_key - 1
        self._back_key = 0  # next back key is _back_key

    def key(self, seq: Sequence) -> tuple[int, ...]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._heap)

    def push_back(self, seq: Sequence) -> None:
        seq.queue_key = self._back_key
        self._back_key += 1
        heapq.heappush(self._heap, (self.key(seq), seq))

    def push_front(self, seq: Sequence) -> None:
        self._front_key -= 1
        seq.queue_key = self._front_key
        heapq.heappush(self._heap, (self.key(seq), seq))

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def unpop(self, seq: Sequence) -> None:
        # The seq keeps its queue_key, so its stored position is unchanged.
        heapq.heappush(self._heap, (self.key(seq), seq))

    def unpush_front(self, seq: Sequence) -> None:
        assert seq.queue_key == self._front_key, "rollback out of order"
        self.remove(seq)
        self._front_key += 1

    def remove(self, seq: Sequence) -> None:
        heap = self._heap
        for index, entry in enumerate(heap):
            if entry[1] is seq:
                last = heap.pop()
                if index < len(heap):
                    heap[index] = last
                    heapq.heapify(heap)
                return
        raise ValueError(f"{seq.request_id!r} is not waiting")

    def stored(self) -> list[Sequence]:
        return sorted((entry[1] for entry in self._heap), key=lambda seq: seq.queue_key)


class PriorityWaitingQueue(KeyedWaitingQueue):
    """A heap on ``(priority, arrival)`` (vLLM V1's priority queue)."""

    __slots__ = ()

    def key(self, seq: Sequence) -> tuple[int, ...]:
        return (seq.priority, seq.arrival)
