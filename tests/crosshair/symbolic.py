"""How CrossHair builds the spec's values: small, valid by construction (a CrossHair plugin).

Left to itself, CrossHair builds a ``SchedulerState`` field by field from unconstrained
symbolic values, and almost none of them is a valid state (``check_state``): every
transition whose precondition is ``check_state(state)`` is then reported as "Unable to
meet precondition" and is never analysed. ``crosshair.register_type`` lets us supply
the builder instead. The builders below draw every number as a symbolic value and add
the constraints that make the state valid *to the solver* (no path is spent on
invalid states), within the sizes written down in ``spec.contracts``:

- queues: at most ``MAX_WAITING`` waiting, ``MAX_RUNNING`` running, ``MAX_SWAPPED``
  swapped, ``MAX_LIVE`` live requests (each length is a concrete choice per path);
- each request: prompt of 1..``MAX_PROMPT_LEN`` symbolic tokens, up to
  ``MAX_OUTPUTS`` symbolic outputs, ``max_tokens`` up to ``MAX_MAX_TOKENS``, any
  priority, any EOS (or none) that is not among its outputs, a unique arrival below
  ``next_arrival``; waiting ones have ``computed == 0``, running and swapped ones
  ``1 <= computed < num_tokens``, and every one fits alone (R4); only swap mode has
  swapped requests, and in restart mode a waiting request has no outputs (R6);
- the config: ``block_size`` 1..``MAX_BLOCK_SIZE`` (concrete per path), every
  preemption mode, chunked prefill on and off, every registered policy; GPU and CPU
  pools of ``owned + free`` blocks with ``free >= 0`` unbounded (conservation, R2);
  a budget and ``max_num_seqs`` that every request and the running queue fit.

A ``SchedulerConfig`` asked for alone gets the ``MAX_CONFIG_*`` ranges; a
``StepDraft`` is a valid state with the whole budget and nothing decided yet (the
precondition of phase A); a ``StepPlan`` matches the state built just before it on
the same path (the precondition of phase D); a ``Policy`` is a registered one; a
``SamplingParams`` has any scheduling fields (temperature 0.0, no seed).

This module imports CrossHair, so it is loaded only by CrossHair runs:
``crosshair check --extra_plugin tests/crosshair/plugin.py ...`` (see
``scripts/crosshair_check``). Importing it twice registers nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import crosshair
from crosshair import SymbolicFactory, register_type
from crosshair.core import realize

from spec.contracts import (
    MAX_BLOCK_SIZE,
    MAX_CONFIG_BLOCKS,
    MAX_CONFIG_BUDGET,
    MAX_CONFIG_SEQS,
    MAX_LIVE,
    MAX_MAX_TOKENS,
    MAX_OUTPUTS,
    MAX_PREEMPTIONS,
    MAX_PROMPT_LEN,
    MAX_RUNNING,
    MAX_SWAPPED,
    MAX_WAITING,
)
from spec.kv import blocks_held, largest_prefill, max_cached_tokens
from spec.policies import POLICIES, Policy
from spec.scheduler import StepDraft
from spec.types import (
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)

# CrossHair's tracing switches and its "discard this path" exception are untyped.
NoTracing = cast(Callable[[], AbstractContextManager[None]], crosshair.NoTracing)
ResumedTracing = cast(Callable[[], AbstractContextManager[None]], crosshair.ResumedTracing)
IgnoreAttempt = cast(Callable[[str], BaseException], crosshair.IgnoreAttempt)


class _BuiltStates:
    """The states built so far on the current path (CrossHair keeps one per solver)."""

    def __init__(self, solver: object) -> None:
        self.states: list[SchedulerState] = []


def assume(p: SymbolicFactory, condition: object) -> None:
    """Add ``condition`` (a symbolic bool) to the path's constraints, without a fork.

    A concrete false condition abandons the path (it was not a valid input).
    """
    with NoTracing():
        if hasattr(condition, "var"):
            p.space.add(condition)
        elif not condition:
            raise IgnoreAttempt("assumption is false")


def bounded_int(p: SymbolicFactory, suffix: str, low: int, high: int | None = None) -> int:
    """A symbolic int in ``low..high`` (no upper bound when ``high`` is None)."""
    value: int = p(int, suffix)
    with ResumedTracing():
        assume(p, value >= low)
        if high is not None:
            assume(p, value <= high)
    return value


def concrete_int(p: SymbolicFactory, suffix: str, low: int, high: int) -> int:
    """An int in ``low..high`` made concrete: the path forks once per value."""
    value = bounded_int(p, suffix, low, high)
    with NoTracing():
        result: int = realize(value)
    return result


def choose_policy(p: SymbolicFactory) -> str:
    """One registered policy name per path (a new policy is picked up with no wiring)."""
    names = sorted(POLICIES)
    for name in names[:-1]:
        if p(bool, "_policy_is_" + name.replace("-", "_")):
            return name
    return names[-1]


def make_policy(p: SymbolicFactory) -> Policy:
    """A registered policy (a ``Policy`` of arbitrary callables is not one)."""
    return POLICIES[choose_policy(p)]


def make_config(p: SymbolicFactory) -> SchedulerConfig:
    """A config alone: every field symbolic within the ``MAX_CONFIG_*`` ranges."""
    num_gpu_blocks = bounded_int(p, "_num_gpu_blocks", 1, MAX_CONFIG_BLOCKS)
    block_size = concrete_int(p, "_block_size", 1, MAX_BLOCK_SIZE)
    budget = bounded_int(p, "_max_num_batched_tokens", 1, MAX_CONFIG_BUDGET)
    max_num_seqs = bounded_int(p, "_max_num_seqs", 1, MAX_CONFIG_SEQS)
    num_cpu_blocks = bounded_int(p, "_num_cpu_blocks", 0, MAX_CONFIG_BLOCKS)
    chunked: bool = p(bool, "_enable_chunked_prefill")
    mode: PreemptionMode = p(PreemptionMode, "_preemption_mode")
    policy = choose_policy(p)
    with ResumedTracing():
        return SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            preemption_mode=mode,
            num_cpu_blocks=num_cpu_blocks,
            policy=policy,
        )


def _queue_lengths(p: SymbolicFactory, mode: PreemptionMode) -> tuple[int, int, int]:
    """Concrete queue lengths; only swap mode ever has swapped requests (R6)."""
    lengths: list[int] = []
    live = 0
    for name, most in (
        ("waiting", MAX_WAITING),
        ("running", MAX_RUNNING),
        ("swapped", MAX_SWAPPED),
    ):
        limit = 0 if name == "swapped" and mode is not PreemptionMode.SWAP else most
        length = 0
        while length < limit and live < MAX_LIVE and p(bool, f"_{name}_has_{length}"):
            length += 1
            live += 1
        lengths.append(length)
    return lengths[0], lengths[1], lengths[2]


def _make_request(
    p: SymbolicFactory, index: int, queue: str, arrivals: list[int], mode: PreemptionMode
) -> RequestState:
    """Request ``r<index>`` of ``queue``: its own constraints (R2, R4's first checks, R10)."""
    tag = f"_r{index}"
    prompt: tuple[int, ...] = p(tuple[int, ...], tag + "_prompt")
    outputs: tuple[int, ...] = p(tuple[int, ...], tag + "_outputs")
    max_tokens = bounded_int(p, tag + "_max_tokens", 1, MAX_MAX_TOKENS)
    eos: int | None = p(int | None, tag + "_eos")
    ignore_eos: bool = p(bool, tag + "_ignore_eos")
    priority: int = p(int, tag + "_priority")
    arrival = bounded_int(p, tag + "_arrival", 0)
    preemptions = bounded_int(p, tag + "_num_preemptions", 0, MAX_PREEMPTIONS)
    with ResumedTracing():
        assume(p, len(prompt) >= 1)
        assume(p, len(prompt) <= MAX_PROMPT_LEN)
        assume(p, len(outputs) <= MAX_OUTPUTS)
        assume(p, len(outputs) < max_tokens)
        if queue == "waiting" and mode is PreemptionMode.RESTART:
            assume(p, len(outputs) == 0)  # restart mode drops a victim's outputs (R6)
        for other in arrivals:
            assume(p, arrival != other)
        if eos is not None and not ignore_eos and eos in outputs:
            raise IgnoreAttempt("a live request never holds its EOS (R10)")
    if queue == "waiting":
        computed = 0
    else:
        computed = bounded_int(p, tag + "_num_computed_tokens", 1)
        with ResumedTracing():
            assume(p, computed < len(prompt) + len(outputs))
    arrivals.append(arrival)
    with ResumedTracing():
        return RequestState(
            request=Request(
                request_id=f"r{index}",
                prompt_token_ids=prompt,
                params=SamplingParams(
                    max_tokens=max_tokens,
                    eos_token_id=eos,
                    ignore_eos=ignore_eos,
                    priority=priority,
                ),
                arrival=arrival,
            ),
            output_token_ids=outputs,
            num_computed_tokens=computed,
            num_preemptions=preemptions,
        )


def make_state(p: SymbolicFactory) -> SchedulerState:
    """A valid state between steps (``check_state``) within the sizes of ``spec.contracts``."""
    block_size = concrete_int(p, "_block_size", 1, MAX_BLOCK_SIZE)
    chunked: bool = p(bool, "_enable_chunked_prefill")
    mode: PreemptionMode = p(PreemptionMode, "_preemption_mode")
    policy = choose_policy(p)
    num_waiting, num_running, num_swapped = _queue_lengths(p, mode)
    arrivals: list[int] = []
    queues: dict[str, tuple[RequestState, ...]] = {}
    index = 0
    for queue, length in (
        ("waiting", num_waiting),
        ("running", num_running),
        ("swapped", num_swapped),
    ):
        requests = []
        for _ in range(length):
            requests.append(_make_request(p, index, queue, arrivals, mode))
            index += 1
        queues[queue] = tuple(requests)
    free_gpu = bounded_int(p, "_num_free_gpu_blocks", 0)
    free_cpu = bounded_int(p, "_num_free_cpu_blocks", 0)
    budget = bounded_int(p, "_max_num_batched_tokens", 1)
    max_num_seqs = bounded_int(p, "_max_num_seqs", max(1, num_running))
    next_arrival = bounded_int(p, "_next_arrival", 0)
    num_steps = bounded_int(p, "_num_steps", 0)
    with ResumedTracing():
        state = _assemble_state(
            p,
            queues,
            block_size=block_size,
            chunked=chunked,
            mode=mode,
            policy=policy,
            free_gpu=free_gpu,
            free_cpu=free_cpu,
            budget=budget,
            max_num_seqs=max_num_seqs,
            next_arrival=next_arrival,
            num_steps=num_steps,
        )
    with NoTracing():
        p.space.extra(_BuiltStates).states.append(state)
    return state


def _assemble_state(
    p: SymbolicFactory,
    queues: dict[str, tuple[RequestState, ...]],
    *,
    block_size: int,
    chunked: bool,
    mode: PreemptionMode,
    policy: str,
    free_gpu: int,
    free_cpu: int,
    budget: int,
    max_num_seqs: int,
    next_arrival: int,
    num_steps: int,
) -> SchedulerState:
    """The state from its parts, with the constraints that tie them (R2, R4)."""
    live = (*queues["waiting"], *queues["running"], *queues["swapped"])
    gpu_owned = sum(blocks_held(r.num_computed_tokens, block_size) for r in queues["running"])
    cpu_owned = sum(blocks_held(r.num_computed_tokens, block_size) for r in queues["swapped"])
    num_gpu_blocks = gpu_owned + free_gpu
    assume(p, num_gpu_blocks >= 1)
    for request in live:
        prompt_len = len(request.request.prompt_token_ids)
        max_tokens = request.request.params.max_tokens
        assume(p, next_arrival > request.request.arrival)
        # R4: every live request fits alone.
        cached = max_cached_tokens(prompt_len, max_tokens)
        assume(p, blocks_held(cached, block_size) <= num_gpu_blocks)
        if not chunked:
            assume(p, largest_prefill(prompt_len, max_tokens, mode) <= budget)
    config = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_cpu_blocks=cpu_owned + free_cpu,
        policy=policy,
    )
    return SchedulerState(
        config=config,
        num_free_gpu_blocks=free_gpu,
        num_free_cpu_blocks=free_cpu,
        waiting=queues["waiting"],
        running=queues["running"],
        swapped=queues["swapped"],
        next_arrival=next_arrival,
        num_steps=num_steps,
    )


def make_plan(p: SymbolicFactory) -> StepPlan:
    """A plan that ``plan_matches`` the state built last on this path.

    CrossHair builds the arguments in order, so for ``complete_step(state_mid, plan,
    tokens)`` the plan is built right after ``state_mid``: each running request is
    scheduled or not (in running order), with a chunk that starts at its computed
    count and has 1..remaining tokens. Without a state before it, the plan is empty.
    """
    with NoTracing():
        built = p.space.extra(_BuiltStates).states
        state = built[-1] if built else None
    if state is None:
        return StepPlan(step=bounded_int(p, "_step", 0))
    chunks: list[ScheduledChunk] = []
    for request in state.running:
        rid = request.request_id
        if not p(bool, f"_plan_schedules_{rid}"):
            continue
        computed = request.num_computed_tokens
        n = bounded_int(p, f"_plan_{rid}_num_tokens", 1)
        with ResumedTracing():
            assume(p, n <= request.num_tokens - computed)
            chunks.append(ScheduledChunk(request_id=rid, start=computed, num_tokens=n))
    with ResumedTracing():
        return StepPlan.of(step=state.num_steps, scheduled=chunks)


def make_sampling_params(p: SymbolicFactory) -> SamplingParams:
    """Any scheduling parameters; ``temperature`` 0.0 and no ``seed``.

    The scheduler never reads those two (only the engine's sampler does), and a
    symbolic float can be NaN, which is not equal to itself: ``diffbehavior`` would
    report two equal inputs as changed.
    """
    max_tokens: int = p(int, "_max_tokens")
    eos: int | None = p(int | None, "_eos_token_id")
    ignore_eos: bool = p(bool, "_ignore_eos")
    priority: int = p(int, "_priority")
    with ResumedTracing():
        return SamplingParams(
            max_tokens=max_tokens, eos_token_id=eos, ignore_eos=ignore_eos, priority=priority
        )


def make_draft(p: SymbolicFactory) -> StepDraft:
    """The start of phase A: a valid state, the whole budget, nothing decided."""
    state: SchedulerState = p(SchedulerState, "_state")
    with ResumedTracing():
        return StepDraft(state=state, budget=state.config.max_num_batched_tokens)


_REGISTERED: dict[type, Any] = {}


def register() -> None:
    """Register the builders with CrossHair (once per process)."""
    for typ, creator in (
        (SchedulerConfig, make_config),
        (SchedulerState, make_state),
        (StepDraft, make_draft),
        (StepPlan, make_plan),
        (Policy, make_policy),
        (SamplingParams, make_sampling_params),
    ):
        if typ not in _REGISTERED:
            register_type(typ, creator)
            _REGISTERED[typ] = creator


register()
