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
``reserve``               as ``lifo``                                  stored order
========================  ===========================================  ======================

``reserve`` is the one shipped policy with an admission gate (``reserve_admit``): it
admits a request only if the running requests and it can all keep decoding for the next
``RESERVE_HORIZON`` steps without running out of blocks, and it never refuses when
``running`` is empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from spec.kv import cdiv, max_cached_tokens
from spec.types import ConfigError, RequestState, SchedulerState

VictimSelector = Callable[[tuple[RequestState, ...]], int]
WaitingOrder = Callable[[tuple[RequestState, ...]], tuple[RequestState, ...]]
AdmissionGate = Callable[[SchedulerState, RequestState, int], bool]


def always_admit(state: SchedulerState, candidate: RequestState, num_tokens: int) -> bool:
    """The default admission gate: never refuses (R9). (No contract: it would only say so.)"""
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


def is_latest_priority(candidates: tuple[RequestState, ...], index: int) -> bool:
    """Whether ``candidates[index]`` has the largest ``(priority, arrival)``: the lowest
    priority, latest arrival among them."""
    chosen = candidates[index].request
    return all(
        (c.request.params.priority, c.request.arrival) <= (chosen.params.priority, chosen.arrival)
        for c in candidates
    )


def priority_victim(candidates: tuple[RequestState, ...]) -> int:
    """``priority`` victim (R9): the largest ``(priority, arrival)``.

    A larger ``priority`` value is less important (vLLM), and among equals the latest
    arrival goes first.

    pre: len(candidates) >= 1
    post: 0 <= __return__ < len(candidates) and is_latest_priority(candidates, __return__)
    """
    return max(range(len(candidates)), key=lambda i: _priority_key(candidates[i]))


def is_priority_ordering(
    waiting: tuple[RequestState, ...], ordered: tuple[RequestState, ...]
) -> bool:
    """Whether ``ordered`` is ``waiting`` rearranged, smallest ``(priority, arrival)`` first."""
    keys = [(r.request.params.priority, r.request.arrival) for r in ordered]
    return (
        len(ordered) == len(waiting)
        and all(ordered.count(r) == waiting.count(r) for r in waiting)
        and all(a <= b for a, b in itertools.pairwise(keys))
    )


def priority_order(waiting: tuple[RequestState, ...]) -> tuple[RequestState, ...]:
    """``priority`` waiting order (R9): sorted by ``(priority, arrival)``, smallest first.

    post: is_priority_ordering(waiting, __return__)
    """
    return tuple(sorted(waiting, key=_priority_key))


def _fewest_outputs_key(candidates: tuple[RequestState, ...], i: int) -> tuple[int, int, int]:
    request = candidates[i]
    return (-len(request.output_token_ids), len(request.request.prompt_token_ids), i)


def has_fewest_outputs(candidates: tuple[RequestState, ...], index: int) -> bool:
    """Whether no candidate has fewer outputs than ``candidates[index]``, nor as few and a
    longer prompt."""
    chosen = candidates[index]
    outputs, prompt = len(chosen.output_token_ids), len(chosen.request.prompt_token_ids)
    return all(
        len(c.output_token_ids) > outputs
        or (len(c.output_token_ids) == outputs and len(c.request.prompt_token_ids) <= prompt)
        for c in candidates
    )


def fewest_outputs_victim(candidates: tuple[RequestState, ...]) -> int:
    """``fewest-outputs`` victim (R9, SGLang's retraction order).

    The candidate with the fewest outputs (it loses the least work); ties go to the
    longest prompt (it frees the most blocks), then to the latest in running order.

    pre: len(candidates) >= 1
    post: 0 <= __return__ < len(candidates) and has_fewest_outputs(candidates, __return__)
    """
    return max(range(len(candidates)), key=lambda i: _fewest_outputs_key(candidates, i))


def peak_blocks(request: RequestState, block_size: int) -> int:
    """The most GPU blocks ``request`` can ever hold: ``cdiv(L, bs)``, ``L = P + M - 1`` (R4).

    pre: block_size >= 1
    pre: len(request.request.prompt_token_ids) >= 1
    pre: request.request.params.max_tokens >= 1
    post: __return__ >= 1
    """
    prompt_len = len(request.request.prompt_token_ids)
    return cdiv(max_cached_tokens(prompt_len, request.request.params.max_tokens), block_size)


RESERVE_HORIZON = 64
"""``reserve`` looks this many steps ahead: each request's tokens still to sample are
clipped to it (SGLang clips its estimate the same way, at 4096 tokens)."""


def now_blocks(requests: tuple[RequestState, ...], block_size: int) -> int:
    """The blocks ``requests`` hold with every token they have cached."""
    return sum(cdiv(r.num_tokens, block_size) for r in requests)


def peak_sum(requests: tuple[RequestState, ...], block_size: int) -> int:
    """The blocks ``requests`` would hold if each reached its ``peak_blocks`` at once."""
    return sum(peak_blocks(r, block_size) for r in requests)


def decode_peak_blocks(requests: tuple[RequestState, ...], block_size: int, horizon: int) -> int:
    """``reserve``: the most GPU blocks ``requests`` hold in the next ``horizon`` steps.

    The estimate (LightLLM's ``_can_add_new_req``, counted in blocks, with
    ``max_tokens`` as the output length): from now on each request samples one token
    per step until it has ``max_tokens`` outputs. In the ``k``-th step from now, a
    request with ``b = M - outputs`` tokens still to sample (``k <= b``) has
    ``num_tokens + k - 1`` tokens in the cache, hence ``cdiv(num_tokens + k - 1, bs)``
    blocks; after its ``b``-th step it finishes and frees them. The use in step ``k``,
    ``U(k) = sum over the requests with b >= k of cdiv(num_tokens + k - 1, bs)``,
    only grows with ``k`` until a request finishes, so its maximum over
    ``1 <= k <= horizon`` is at a ``k`` equal to some request's ``min(b, horizon)``.

    pre: block_size >= 1
    pre: horizon >= 1
    pre: all(len(r.request.prompt_token_ids) >= 1 for r in requests)
    pre: all(len(r.output_token_ids) < r.request.params.max_tokens for r in requests)
    post: now_blocks(requests, block_size) <= __return__ <= peak_sum(requests, block_size)
    """
    to_sample = [
        min(r.request.params.max_tokens - len(r.output_token_ids), horizon) for r in requests
    ]
    return max(
        (
            sum(
                cdiv(r.num_tokens + k - 1, block_size)
                for r, b in zip(requests, to_sample, strict=True)
                if b >= k
            )
            for k in set(to_sample)
        ),
        default=0,
    )


def peak_fits(state: SchedulerState, candidate: RequestState) -> bool:
    """Whether every request ``reserve`` would run together stays within the pool even if
    each reached its peak at once (``peak_sum``): then nothing is ever short."""
    together = (*state.running, candidate)
    return peak_sum(together, state.config.block_size) <= state.config.num_gpu_blocks


def reserve_admit(state: SchedulerState, candidate: RequestState, num_tokens: int) -> bool:
    """``reserve`` admission gate (R9): admit only what can keep decoding together.

    Liveness rule: **it never refuses when ``running`` is empty** (the mid-step
    ``running``, with the requests admitted before the candidate in this step). Then
    the candidate is admitted exactly as under ``lifo`` (it fits alone, R4), so the
    liveness argument and the drain bound of ``lifo`` (docs/semantics.md) hold for
    ``reserve`` too; a gate that could refuse an empty engine could leave the head of
    ``waiting`` there forever.

    Otherwise it admits iff ``decode_peak_blocks(running + (candidate,))``, the peak
    KV use in the next ``RESERVE_HORIZON`` steps if every one of them decodes one
    token per step towards ``max_tokens``, fits the ``num_gpu_blocks`` of the whole
    pool. This charges each request an estimate of its future decode KV at
    admission, as SGLang and LightLLM do (LightLLM's exact peak formula with
    ``max_tokens`` as the estimate, clipped like SGLang's; tighter than SGLang's sum
    of every request's remaining growth): with every request decoding each step,
    nothing admitted is preempted within ``RESERVE_HORIZON`` steps. ``num_tokens``
    (the candidate's chunk) does not enter: the estimate counts whole prefills.

    pre: num_tokens >= 1
    pre: len(candidate.request.prompt_token_ids) >= 1
    pre: len(candidate.output_token_ids) < candidate.request.params.max_tokens
    pre: all(len(r.request.prompt_token_ids) >= 1 for r in state.running)
    pre: all(len(r.output_token_ids) < r.request.params.max_tokens for r in state.running)
    post: __return__ or (len(state.running) > 0 and not peak_fits(state, candidate))
    """
    if not state.running:
        return True
    config = state.config
    peak = decode_peak_blocks((*state.running, candidate), config.block_size, RESERVE_HORIZON)
    return peak <= config.num_gpu_blocks


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

RESERVE = Policy(
    name="reserve", select_victim=lifo_victim, order_waiting=stored_order, can_admit=reserve_admit
)

POLICIES: Mapping[str, Policy] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            LIFO,
            PRIORITY,
            FEWEST_OUTPUTS,
            RESERVE,
        )
    }
)
"""The registry (read-only): ``SchedulerConfig.policy`` names one of these."""


def is_registered(name: str) -> bool:
    """Whether ``name`` names a registered policy.

    post: __return__ == (name in POLICIES)
    """
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
