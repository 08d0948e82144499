"""Scheduling policies (R9): victim choice, waiting order and admission gate.

A policy is the mutable engine's counterpart of the spec's three pure choices,
registered under the same name in ``POLICIES``:

* ``select_victim(running, start)`` returns the index (``>= start``) in ``running`` of
  the request to preempt among the candidates ``running[start:]``;
* ``new_waiting_queue()`` builds the waiting queue, whose ``peek``/``pop`` walk the
  requests in the policy's order while ``stored()`` keeps the spec's stored order
  (preempted at the front, new at the tail);
* ``can_admit(seq, num_tokens, ...)`` is the admission gate (only ``reserve`` has one).

A policy that keeps its own state about the running requests sets ``tracks_running``;
the scheduler then calls ``on_run(seq)`` whenever a request enters ``running`` (admit,
swap-in, the rollback of a preemption) and ``on_leave(seq)`` whenever one leaves it
(preemption, finish, abort, the rollback of an admission or a swap-in), and
``bind(config)`` once at construction.

* ``lifo``: victim = the last candidate (``running.pop()``, O(1)); waiting in stored
  order (a deque);
* ``priority``: victim = the largest ``(priority, arrival)`` (O(candidates)); waiting
  by ``(priority, arrival)`` (a heap);
* ``fewest-outputs``: victim = fewest outputs, then longest prompt, then the latest
  (O(candidates)); waiting in stored order;
* ``reserve``: as ``lifo``, plus a gate that admits only what the pool can hold for
  the next ``RESERVE_HORIZON`` steps of decoding (O(1) per admission while the sum of
  the running requests' peaks fits, O(R log R) otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import ClassVar

from impl.queues import FifoWaitingQueue, PriorityWaitingQueue, WaitingQueue
from impl.sequence import Sequence
from spec.types import ConfigError, SchedulerConfig


class Policy(ABC):
    """The interface of a scheduling policy: a victim choice and a waiting queue.

    The admission gate and the running-set hooks have defaults (always admit; no
    state), as the spec's ``always_admit`` gate is the default there.
    """

    name: ClassVar[str]
    #: False lets the scheduler skip calling ``can_admit``.
    has_admission_gate: ClassVar[bool] = False
    #: False lets the scheduler skip calling ``on_run`` / ``on_leave``.
    tracks_running: ClassVar[bool] = False

    def bind(self, config: SchedulerConfig) -> None:  # noqa: B027 (a hook; doing nothing is the default)
        """Called once by the scheduler that owns this policy, with its config."""

    @abstractmethod
    def select_victim(self, running: list[Sequence], start: int) -> int:
        """The index (``>= start``) in ``running`` of the request to preempt."""

    @abstractmethod
    def new_waiting_queue(self) -> WaitingQueue:
        """A fresh, empty waiting queue that serves this policy's order."""

    def can_admit(
        self, seq: Sequence, num_tokens: int, *, running: list[Sequence], num_free_blocks: int
    ) -> bool:
        """The admission gate of R8 step 3 (default: always admit).

        Asked once the budget and block checks passed: ``seq`` would get a chunk of
        ``num_tokens`` tokens; ``running`` is the scheduler's running list (those
        admitted before it in this step at the tail; read it, never change it) and
        ``num_free_blocks`` GPU blocks are free (its own chunk's blocks not yet taken).
        """
        return True

    def on_run(self, seq: Sequence) -> None:  # noqa: B027 (a hook; doing nothing is the default)
        """``seq`` entered ``running`` (only called if ``tracks_running``)."""

    def on_leave(self, seq: Sequence) -> None:  # noqa: B027 (a hook; doing nothing is the default)
        """``seq`` left ``running`` (only called if ``tracks_running``)."""

    def check_invariants(self, running: list[Sequence]) -> None:  # noqa: B027 (a hook; doing nothing is the default)
        """Assert that the policy's own state agrees with ``running`` (for tests)."""


def lifo_victim(running: list[Sequence], start: int) -> int:
    """The most recently admitted candidate: the last one (``running.pop()``, O(1))."""
    return len(running) - 1


class LifoPolicy(Policy):
    """LIFO (vLLM, nano-vllm, the seed): preempt the most recently admitted request."""

    name = "lifo"

    def select_victim(self, running: list[Sequence], start: int) -> int:
        return lifo_victim(running, start)

    def new_waiting_queue(self) -> WaitingQueue:
        return FifoWaitingQueue()


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

    def new_waiting_queue(self) -> WaitingQueue:
        return FifoWaitingQueue()


#: ``reserve`` looks this many steps ahead (each request's tokens to sample are clipped).
RESERVE_HORIZON = 64


class ReservePolicy(Policy):
    """LIFO victims plus reserve-aware admission (LightLLM's peak formula, in blocks).

    Admits ``seq`` iff ``running`` is empty (liveness: an empty engine is never
    refused) or the peak KV use of ``running + [seq]`` in the next ``RESERVE_HORIZON``
    steps, if each of them decodes one token per step towards ``max_tokens``, fits the
    whole GPU pool. A request with ``a + 1`` tokens (``a = num_tokens - 1``) and ``b``
    tokens still to sample holds ``cdiv(a + k, bs)`` blocks in the ``k``-th step from
    now, for ``k <= b``; the use ``U(k)`` peaks at a ``k`` equal to some request's
    ``min(b, RESERVE_HORIZON)``.

    Cost: O(1) when the cache is not contended: a counter keeps the sum of the
    running requests' peaks ``cdiv(P + M - 1, bs)`` (``on_run``/``on_leave``; a
    request's peak never changes), and if that sum plus ``seq``'s fits, so does the
    estimate, which is never larger. Otherwise one sort and one pass,
    O(R log R) for ``R`` running requests, only at an admission attempt (each
    request's ``b`` changes every step, so there is nothing to keep sorted).
    """

    name = "reserve"
    has_admission_gate = True
    tracks_running = True

    def select_victim(self, running: list[Sequence], start: int) -> int:
        return lifo_victim(running, start)

    def new_waiting_queue(self) -> WaitingQueue:
        return FifoWaitingQueue()

    def __init__(self) -> None:
        self.block_size = 1
        self.num_gpu_blocks = 0
        #: Sum of ``peak(seq)`` over the running requests.
        self.running_peak_blocks = 0

    def bind(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks

    def peak(self, seq: Sequence) -> int:
        """``cdiv(P + M - 1, bs)``: the most blocks ``seq`` ever holds (``stop_len = P + M``)."""
        return (seq.stop_len - 2) // self.block_size + 1

    def on_run(self, seq: Sequence) -> None:
        self.running_peak_blocks += self.peak(seq)

    def on_leave(self, seq: Sequence) -> None:
        self.running_peak_blocks -= self.peak(seq)

    def check_invariants(self, running: list[Sequence]) -> None:
        expected = sum(self.peak(seq) for seq in running)
        assert self.running_peak_blocks == expected, (
            f"reserve: running peak counter {self.running_peak_blocks} != {expected}"
        )

    def can_admit(
        self, seq: Sequence, num_tokens: int, *, running: list[Sequence], num_free_blocks: int
    ) -> bool:
        if not running:
            return True
        capacity = self.num_gpu_blocks
        if self.running_peak_blocks + self.peak(seq) <= capacity:
            return True
        return self.decode_peak([*running, seq]) <= capacity

    def decode_peak(self, seqs: list[Sequence], horizon: int = RESERVE_HORIZON) -> int:
        """``max over k <= horizon of U(k)`` (see the class doc), in O(n log n).

        With ``a = q*bs + rho`` and ``k = Q*bs + kappa`` (``0 <= rho, kappa < bs``),
        ``cdiv(a + k, bs) = q + Q + [rho + kappa >= 1] + [rho + kappa > bs]``, so
        ``U(k)`` over the requests with ``b >= k`` is ``sum(q) + n*Q`` plus two counts
        of ``rho`` values, read from a sorted list as the requests join in order of
        decreasing ``b``.
        """
        bs = self.block_size
        items = sorted(
            ((min(s.stop_len - s.num_tokens, horizon), s.num_tokens - 1) for s in seqs),
            reverse=True,
        )
        rhos: list[int] = []  # sorted rho of the requests with b >= k
        sum_q = 0
        peak = 0
        count = len(items)
        i = 0
        while i < count:
            k = items[i][0]
            while i < count and items[i][0] == k:  # every request with this b joins
                a = items[i][1]
                sum_q += a // bs
                insort(rhos, a % bs)
                i += 1
            big_q, kappa = divmod(k, bs)
            n = len(rhos)
            use = sum_q + n * big_q
            use += n if kappa >= 1 else n - bisect_left(rhos, 1)
            if kappa >= 1:
                use += n - bisect_left(rhos, bs + 1 - kappa)
            peak = max(peak, use)
        return peak


#: Policy name -> factory, the same names the spec registers.
POLICIES: dict[str, Callable[[], Policy]] = {
    "lifo": LifoPolicy,
    "priority": PriorityPolicy,
    "fewest-outputs": FewestOutputsPolicy,
    "reserve": ReservePolicy,
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
