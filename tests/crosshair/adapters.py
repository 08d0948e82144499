"""Spec and engine side by side, with one signature, for ``crosshair diffbehavior``.

``crosshair diffbehavior A B`` looks for an input on which ``A`` and ``B`` return
different values or raise different exceptions. The engine's logic lives in methods
over mutable objects (``impl.Scheduler``, ``impl.policies.Policy``), so each pair
below is two thin top-level functions with the same signature: ``spec_<x>`` calls the
spec's pure function, ``impl_<x>`` builds the engine objects the engine itself would
have at that point and calls the engine's own code.

``diffbehavior`` ignores preconditions: it tries every input of the annotated types.
Both sides of a pair therefore start with the same guard, ``_domain(...)``, which
raises ``OutsideDomain`` (same type, same message on both sides, so not a
difference) for an input outside the spec function's preconditions, e.g. a
``block_size`` of 0. Numbers are also bounded there, which keeps the engine's
allocations (a ``BlockManager`` of ``num_gpu_blocks`` blocks) small.

Pairs (``PAIRS``, run by ``python -m tests.crosshair.runner --diff``):

- ``blocks_needed``: ``spec.kv.blocks_needed`` against the block-table growth phase A
  of ``impl.Scheduler.schedule`` gives a lone running request;
- ``never_fits``: R4 check 5 by profile, ``spec.profiles.too_large`` (``spec.kv.never_fits``
  under kvsched and nano-vllm, the ``max_model_len`` bound under vllm-v1) against
  ``impl.Scheduler.check_request`` raising ``RequestTooLargeError``;
- ``victim_<policy>`` for every policy registered on both sides: the spec's
  ``choose_victim(policy, state.running, i)`` against the engine policy's
  ``select_victim(running, i)`` on the same requests (``i`` is the request that needs
  blocks; the candidates are ``running[i:]``);
- ``admit_<policy>`` likewise for the admission gate: the spec's ``can_admit(state,
  head of waiting, n)`` against the engine policy's ``can_admit`` (bound to the
  config and told about the running requests, as the scheduler does).

A new policy registered in both ``spec.policies.POLICIES`` and ``impl.policies.POLICIES``
gets its two pairs with no wiring: the functions are generated from the registries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from impl.policies import POLICIES as IMPL_POLICIES
from impl.scheduler import Scheduler
from impl.sequence import Sequence, SequenceStatus
from spec.kv import blocks_needed, cdiv
from spec.policies import POLICIES as SPEC_POLICIES
from spec.profiles import too_large
from spec.scheduler import choose_victim
from spec.types import (
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
)

MAX_TOKENS_IN_DOMAIN = 24
"""Token counts compared: 0..24 (keeps the engine's block pools small)."""


class OutsideDomainError(ValueError):
    """The input is outside the spec function's preconditions: not compared."""


def _domain(condition: bool) -> None:
    if not condition:
        raise OutsideDomainError("outside the spec's preconditions")


def to_sequence(request: RequestState, status: SequenceStatus) -> Sequence:
    """The engine's ``Sequence`` for a spec ``RequestState`` (``Sequence.to_state`` inverted)."""
    seq = Sequence(request.request)
    seq.token_ids.extend(request.output_token_ids)
    seq.num_tokens = len(seq.token_ids)
    seq.num_computed = request.num_computed_tokens
    seq.num_preemptions = request.num_preemptions
    seq.status = status
    return seq


# --- blocks needed (R5 step 2) -----------------------------------------------------------


def blocks_needed_domain(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> None:
    # The engine only ever asks for a chunk of n >= 1 tokens (phase A runs while the
    # budget is > 0 and every running request has a token left to compute).
    _domain(
        0 <= num_computed_tokens <= MAX_TOKENS_IN_DOMAIN
        and 1 <= num_new_tokens <= MAX_TOKENS_IN_DOMAIN
        and 1 <= block_size <= 4
    )


def spec_blocks_needed(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> int:
    """``spec.kv.blocks_needed`` on the common domain."""
    blocks_needed_domain(num_computed_tokens, num_new_tokens, block_size)
    return blocks_needed(num_computed_tokens, num_new_tokens, block_size)


def impl_blocks_needed(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> int:
    """The blocks the engine's phase A adds to a lone running request's table.

    The request has ``computed + n`` tokens (so ``n`` remain), ``computed`` of them
    cached in ``cdiv(computed, bs)`` blocks, and the budget is exactly ``n``; the pool
    is large enough that nothing is preempted.
    """
    blocks_needed_domain(num_computed_tokens, num_new_tokens, block_size)
    total = num_computed_tokens + num_new_tokens
    config = SchedulerConfig(
        num_gpu_blocks=total,
        block_size=block_size,
        max_num_batched_tokens=num_new_tokens,
    )
    scheduler = Scheduler(config)
    seq = scheduler.add_request("r", [0] * total, SamplingParams(max_tokens=1))
    if num_computed_tokens > 0:  # make it a running request with a cached prefix
        scheduler.waiting.pop()
        seq.status = SequenceStatus.RUNNING
        seq.num_computed = num_computed_tokens
        scheduler.gpu.grow(seq.block_table, cdiv(num_computed_tokens, block_size))
        scheduler.running.append(seq)
        scheduler.num_cached_tokens = num_computed_tokens
    before = len(seq.block_table)
    scheduler.schedule()
    return len(seq.block_table) - before


# --- never fits (R4 check 5) -------------------------------------------------------------


def _never_fits_domain(prompt_len: int, max_tokens: int) -> None:
    _domain(1 <= prompt_len <= MAX_TOKENS_IN_DOMAIN and 1 <= max_tokens <= MAX_TOKENS_IN_DOMAIN)


def spec_never_fits(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """R4 check 5 under the config's profile (``never_fits`` but under vllm-v1), on the
    common domain. (Configs are drawn over every profile: comparing ``never_fits``
    alone found vllm-v1's ``max_model_len`` bound as a "difference".)"""
    _never_fits_domain(prompt_len, max_tokens)
    return too_large(config, prompt_len, max_tokens)


def impl_never_fits(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """Whether the engine's ``check_request`` refuses the request as too large."""
    _never_fits_domain(prompt_len, max_tokens)
    scheduler = Scheduler(config)
    try:
        scheduler.check_request("r", [0] * prompt_len, SamplingParams(max_tokens=max_tokens))
    except RequestTooLargeError:
        return True
    return False


# --- victim choice and admission gate, one pair per registered policy -------------------


# Both take a ``SchedulerState`` (built valid and small by tests/crosshair/symbolic.py
# when CrossHair runs with the plugin) rather than loose requests: its running queue is
# a real one (unique ids and arrivals, R2), and the gate's candidate is the head of its
# waiting queue, a real waiting request.


def _victim_domain(state: SchedulerState, i: int) -> None:
    # R5 step 3: running[i] needs blocks; the candidates are running[i:].
    _domain(0 <= i < len(state.running))


def _gate_domain(state: SchedulerState, num_tokens: int) -> None:
    # R8 step 3: the head of waiting gets a chunk of n tokens that passed the budget
    # and block checks; the gate is asked last.
    _domain(
        len(state.waiting) >= 1
        and len(state.running) < state.config.max_num_seqs
        and 1 <= num_tokens <= min(state.waiting[0].num_tokens, state.config.max_num_batched_tokens)
        and cdiv(num_tokens, state.config.block_size) <= state.num_free_gpu_blocks
    )


VictimAdapter = Callable[[SchedulerState, int], int]
GateAdapter = Callable[[SchedulerState, int], bool]


def _make_victim_pair(name: str) -> tuple[VictimAdapter, VictimAdapter]:
    spec_policy = SPEC_POLICIES[name]
    impl_factory = IMPL_POLICIES[name]

    def spec_victim(state: SchedulerState, i: int) -> int:
        """The spec's victim index in ``state.running`` when ``running[i]`` needs blocks."""
        _victim_domain(state, i)
        return choose_victim(spec_policy, state.running, i)

    def impl_victim(state: SchedulerState, i: int) -> int:
        """The engine policy's ``select_victim(running, i)`` on the same requests."""
        _victim_domain(state, i)
        running = [to_sequence(r, SequenceStatus.RUNNING) for r in state.running]
        return impl_factory().select_victim(running, i)

    return spec_victim, impl_victim


def _make_admit_pair(name: str) -> tuple[GateAdapter, GateAdapter]:
    spec_policy = SPEC_POLICIES[name]
    impl_factory = IMPL_POLICIES[name]

    def spec_admit(state: SchedulerState, num_tokens: int) -> bool:
        """The spec gate on the head of ``waiting`` with a chunk of ``num_tokens``."""
        _gate_domain(state, num_tokens)
        return spec_policy.can_admit(state, state.waiting[0], num_tokens)

    def impl_admit(state: SchedulerState, num_tokens: int) -> bool:
        """The engine policy's gate, set up as the scheduler sets it up."""
        _gate_domain(state, num_tokens)
        candidate = state.waiting[0]
        policy = impl_factory()
        policy.bind(state.config)
        running = [to_sequence(r, SequenceStatus.RUNNING) for r in state.running]
        if policy.tracks_running:
            for seq in running:
                policy.on_run(seq)
        if not policy.has_admission_gate:  # the scheduler does not ask: it admits
            return True
        seq = to_sequence(candidate, SequenceStatus.WAITING)
        return policy.can_admit(
            seq, num_tokens, running=running, num_free_blocks=state.num_free_gpu_blocks
        )

    return spec_admit, impl_admit


def slug(policy_name: str) -> str:
    """A policy name as part of a Python identifier (``fewest-outputs`` -> ``fewest_outputs``)."""
    return policy_name.replace("-", "_")


def policy_names() -> list[str]:
    """The policies registered on both sides (the runner fails if the registries differ)."""
    return sorted(set(SPEC_POLICIES) & set(IMPL_POLICIES))


PAIRS: dict[str, tuple[str, str]] = {
    "blocks_needed": (f"{__name__}.spec_blocks_needed", f"{__name__}.impl_blocks_needed"),
    "never_fits": (f"{__name__}.spec_never_fits", f"{__name__}.impl_never_fits"),
}
"""Pair name -> (spec adapter, engine adapter), as dotted names for ``crosshair diffbehavior``."""

_generated: dict[str, Any] = {}
for _name in policy_names():
    for _kind, _make in (("victim", _make_victim_pair), ("admit", _make_admit_pair)):
        _pair = f"{_kind}_{slug(_name)}"
        _spec_fn, _impl_fn = _make(_name)
        for _side, _fn in (("spec", _spec_fn), ("impl", _impl_fn)):
            _fn.__name__ = _fn.__qualname__ = f"{_side}_{_pair}"
            _fn.__module__ = __name__
            _generated[_fn.__name__] = _fn
        PAIRS[_pair] = (f"{__name__}.spec_{_pair}", f"{__name__}.impl_{_pair}")
globals().update(_generated)
