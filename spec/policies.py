"""Scheduling policies (R9): three pure choices registered under one name.

A policy decides

- ``select_victim(candidates) -> index``: which of the (non-empty) candidates
  ``running[i:]`` to preempt when ``running[i]`` needs blocks that are not free (R5, R6);
- ``order_waiting(waiting) -> waiting'``: the order phase C tries the waiting requests
  in (R8). It reorders, never adds or drops; the stored order of ``waiting`` is kept;
- ``can_admit(state, candidate, num_tokens) -> bool``: an admission gate consulted in
  phase C after the budget and block checks pass (default: always). ``state`` is the
  mid-step state with the requests admitted so far in this step already in
  ``running`` (their blocks taken); ``num_tokens`` is the chunk the candidate would
  get.

Shipped (the engine registers the same names with its own code):

========================  ===========================================  ======================
name                      victim                                       waiting order
========================  ===========================================  ======================
``lifo`` (default)        the last candidate (most recently admitted)  stored order
``priority``              the largest ``(priority, arrival)``          by ``(priority, arrival)``
``fewest-outputs``        fewest outputs; ties: longest prompt; then   stored order
                          the latest in running order
========================  ===========================================  ======================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from spec.types import ConfigError, RequestState, SchedulerState

VictimSelector = Callable[[tuple[RequestState, ...]], int]
WaitingOrder = Callable[[tuple[RequestState, ...]], tuple[RequestState, ...]]
AdmissionGate = Callable[[SchedulerState, RequestState, int], bool]


def always_admit(state: SchedulerState, candidate: RequestState, num_tokens: int) -> bool:
    """The default admission gate: never refuses (R9).

    post: __return__
    """
    return True


def stored_order(waiting: tuple[RequestState, ...]) -> tuple[RequestState, ...]:
    """Waiting order of ``lifo`` and ``fewest-outputs``: the queue as stored (R9).

    post: __return__ == waiting
    """
    return waiting


def lifo_victim(candidates: tuple[RequestState, ...]) -> int:
    """``lifo`` victim (R9): the last candidate, i.e. the most recently admitted.

    pre: len(candidates) >= 1
    post: __return__ == len(candidates) - 1
    """
    return len(candidates) - 1


def _priority_key(request: RequestState) -> tuple[int, int]:
    return (request.request.params.priority, request.request.arrival)


def priority_victim(candidates: tuple[RequestState, ...]) -> int:
    """``priority`` victim (R9): the largest ``(priority, arrival)``.

    A larger ``priority`` value is less important (vLLM), and among equals the latest
    arrival goes first.

    pre: len(candidates) >= 1
    post: 0 <= __return__ < len(candidates)
    post: all(_priority_key(c) <= _priority_key(candidates[__return__]) for c in candidates)
    """
    return max(range(len(candidates)), key=lambda i: _priority_key(candidates[i]))


def priority_order(waiting: tuple[RequestState, ...]) -> tuple[RequestState, ...]:
    """``priority`` waiting order (R9): sorted by ``(priority, arrival)``, smallest first.

    post: sorted(__return__, key=_priority_key) == list(__return__)
    post: len(__return__) == len(waiting)
    """
    return tuple(sorted(waiting, key=_priority_key))


def _fewest_outputs_key(candidates: tuple[RequestState, ...], i: int) -> tuple[int, int, int]:
    request = candidates[i]
    return (-len(request.output_token_ids), len(request.request.prompt_token_ids), i)


def fewest_outputs_victim(candidates: tuple[RequestState, ...]) -> int:
    """``fewest-outputs`` victim (R9, SGLang's retraction order).

    The candidate with the fewest outputs (it loses the least work); ties go to the
    longest prompt (it frees the most blocks), then to the latest in running order.

    pre: len(candidates) >= 1
    post: 0 <= __return__ < len(candidates)
    post: all(len(c.output_token_ids) >= len(candidates[__return__].output_token_ids) for c in candidates)
    """  # noqa: E501
    return max(range(len(candidates)), key=lambda i: _fewest_outputs_key(candidates, i))


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A scheduling policy: three pure functions (R9). See the module docstring."""

    name: str
    select_victim: VictimSelector
    order_waiting: WaitingOrder
    can_admit: AdmissionGate = always_admit


LIFO = Policy(name="lifo", select_victim=lifo_victim, order_waiting=stored_order)
PRIORITY = Policy(name="priority", select_victim=priority_victim, order_waiting=priority_order)
FEWEST_OUTPUTS = Policy(
    name="fewest-outputs", select_victim=fewest_outputs_victim, order_waiting=stored_order
)

POLICIES: Mapping[str, Policy] = MappingProxyType(
    {policy.name: policy for policy in (LIFO, PRIORITY, FEWEST_OUTPUTS)}
)
"""The registry (read-only): ``SchedulerConfig.policy`` names one of these."""


def is_registered(name: str) -> bool:
    """Whether ``name`` names a registered policy."""
    return name in POLICIES


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; ``ConfigError`` if there is none.

    post: __return__.name == name
    raises: ConfigError
    """
    policy = POLICIES.get(name)
    if policy is None:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown policy {name!r} (registered: {known})")
    return policy


def select_victim(policy: Policy, candidates: tuple[RequestState, ...]) -> int:
    """The index in ``candidates`` of the victim ``policy`` names (R5 step 3, R9).

    A policy that returns an index out of range is a bug in the policy, reported as a
    ``ConfigError`` rather than silently clamped. (Which victim each shipped policy
    names is the contract of its own ``*_victim`` function.)

    pre: len(candidates) >= 1
    post: 0 <= __return__ < len(candidates)
    raises: ConfigError
    """
    index = policy.select_victim(candidates)
    if not 0 <= index < len(candidates):
        raise ConfigError(
            f"policy {policy.name!r} chose victim {index} of {len(candidates)} candidates"
        )
    return index
