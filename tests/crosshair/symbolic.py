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

import collections.abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import crosshair
from crosshair import SymbolicFactory, register_type
from crosshair.enforce import PreconditionFailed

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
from spec.scheduler import StepDraft, sampling_request_ids, schedule
from spec.types import (
    ConfigError,
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
)

# CrossHair's tracing switches and its "discard this path" exception are untyped.
NoTracing = cast(Callable[[], AbstractContextManager[None]], crosshair.NoTracing)
ResumedTracing = cast(Callable[[], AbstractContextManager[None]], crosshair.ResumedTracing)
IgnoreAttempt = cast(Callable[[str], BaseException], crosshair.IgnoreAttempt)

_T = TypeVar("_T")

QUEUE_GROWS = 0.7
"""The chance that a queue being built gets one more request (up to its bound)."""
OTHER_QUEUES_GROW = 0.3
"""... and a queue other than the state's focus, for a ``SchedulerState`` argument."""
POOL_FULL = 0.5
"""The chance that a state's GPU pool has no free block."""


class _BuiltStates:
    """The states (and the plan built after each) so far on the current path.

    CrossHair keeps one per solver. A plan belongs to the state built just before it,
    and the sampled tokens to that state and plan (``make_plan``, ``make_tokens``).
    """

    def __init__(self, solver: object) -> None:
        self.states: list[SchedulerState] = []
        self.plans: dict[int, StepPlan] = {}  # index in ``states`` -> its plan


def assume(p: SymbolicFactory, condition: object) -> None:
    """Add ``condition`` (a symbolic bool) to the path's constraints, without a fork.

    A concrete false condition abandons the path (it was not a valid input).
    """
    with NoTracing():
        if hasattr(condition, "var"):
            p.space.add(condition)
        elif not condition:
            raise IgnoreAttempt("assumption is false")


def prefer(p: SymbolicFactory, condition: object) -> None:
    """Add ``condition`` to the path's constraints if the solver can meet it, else nothing.

    Unlike ``assume``, for a wish that may contradict the constraints added before it
    (a full GPU pool with a lone running request in blocks of 1 cannot also let every
    request fit, R4): the solver decides, and the path stays a valid one either way.
    """
    with NoTracing():
        if hasattr(condition, "var"):
            p.space.choose_possible(condition.var, probability_true=1.0)


def bounded_int(p: SymbolicFactory, suffix: str, low: int, high: int | None = None) -> int:
    """A symbolic int in ``low..high`` (no upper bound when ``high`` is None)."""
    value: int = p(int, suffix)
    with ResumedTracing():
        assume(p, value >= low)
        if high is not None:
            assume(p, value <= high)
    return value


def choose(p: SymbolicFactory, suffix: str, probability: float) -> bool:
    """A concrete yes/no decision, taken as "yes" on about ``probability`` of new paths.

    A plain symbolic ``bool`` is decided where the code first branches on it, with
    CrossHair's default of 1 in 4 for "true" on a branch it has not explored: a chain
    of such decisions (a third running request, a block size of 4) is then reached on
    a few percent of the paths, and a planted bug that needs it is missed within the
    CI budget. The decisions that shape a state are taken here instead, each with the
    probability the builder asks for, so that every shape gets its share of paths.
    """
    value: Any = p(bool, suffix)  # a SymbolicBool: its solver variable is ``.var``
    if not hasattr(value, "var"):  # CrossHair sometimes hands out a plain bool
        return bool(value)
    with NoTracing():
        chosen: bool = p.space.choose_possible(value.var, probability_true=probability)
    return chosen


def choose_one(p: SymbolicFactory, suffix: str, options: Sequence[_T]) -> _T:
    """One of ``options``, each on about the same share of new paths."""
    for index, option in enumerate(options[:-1]):
        if choose(p, f"{suffix}_is_{index}", 1 / (len(options) - index)):
            return option
    return options[-1]


def concrete_int(p: SymbolicFactory, suffix: str, low: int, high: int) -> int:
    """An int in ``low..high``, concrete, each value on about the same share of paths."""
    return choose_one(p, suffix, range(low, high + 1))


def choose_policy(p: SymbolicFactory) -> str:
    """One registered policy name per path (a new policy is picked up with no wiring)."""
    return choose_one(p, "_policy", sorted(POLICIES))


def choose_mode(p: SymbolicFactory) -> PreemptionMode:
    """Every preemption mode, each on about a third of the paths."""
    return choose_one(p, "_preemption_mode", list(PreemptionMode))


KVSCHED_SHARE = 0.8
"""The share of a state's paths under the kvsched profile; the peer profiles split the rest.

Most of the transitions' rules (and the planted table's bugs) are kvsched's; vllm-v1 and
nano-vllm change a few gates, the victim and the budget, so a tenth of the paths each
(measured: at a quarter each, four of phase A's and C's planted bugs were missed in the
budget at a load of 10)."""


def choose_semantics(p: SymbolicFactory, kvsched: float) -> Semantics:
    """A profile per path: kvsched on ``kvsched`` of the paths, vllm-v1 and nano-vllm
    alike on the rest."""
    if choose(p, "_semantics_is_kvsched", kvsched):
        return Semantics.KVSCHED
    return choose_one(p, "_semantics", (Semantics.VLLM_V1, Semantics.NANO_VLLM))


@dataclass(frozen=True)
class Profile:
    """A profile's config-time constraints (``SchedulerConfig._check_vllm_v1`` /
    ``_check_nano_vllm``), chosen concretely so that no path is spent on a ``ConfigError``."""

    semantics: Semantics
    mode: PreemptionMode
    policy: str
    chunked: bool
    block_size: int


def choose_profile(
    p: SymbolicFactory, kvsched: float, mode: PreemptionMode | None = None
) -> Profile:
    """The profile and the fields it constrains. ``mode`` forces that preemption mode
    (and so kvsched, for swap); otherwise every mode the profile allows."""
    semantics = Semantics.KVSCHED if mode is PreemptionMode.SWAP else choose_semantics(p, kvsched)
    if semantics is Semantics.KVSCHED:
        return Profile(
            semantics,
            mode or choose_mode(p),
            choose_policy(p),
            choose(p, "_enable_chunked_prefill", 0.5),
            concrete_int(p, "_block_size", 1, MAX_BLOCK_SIZE),
        )
    if semantics is Semantics.VLLM_V1:
        return Profile(
            semantics,
            PreemptionMode.RECOMPUTE,
            choose_one(p, "_policy", ("lifo", "priority")),
            choose(p, "_enable_chunked_prefill", 0.5),
            concrete_int(p, "_block_size", 1, MAX_BLOCK_SIZE),
        )
    return Profile(
        semantics,
        PreemptionMode.RECOMPUTE,
        "lifo",
        False,
        concrete_int(p, "_block_size", 2, MAX_BLOCK_SIZE),
    )


def make_policy(p: SymbolicFactory) -> Policy:
    """A registered policy (a ``Policy`` of arbitrary callables is not one)."""
    return POLICIES[choose_policy(p)]


def make_config(p: SymbolicFactory) -> SchedulerConfig:
    """A config alone: every profile (a third of the paths each), every field symbolic
    within the ``MAX_CONFIG_*`` ranges and the profile's constraints."""
    profile = choose_profile(p, 1 / 3)
    num_gpu_blocks = bounded_int(p, "_num_gpu_blocks", 1, MAX_CONFIG_BLOCKS)
    budget = bounded_int(p, "_max_num_batched_tokens", 1, MAX_CONFIG_BUDGET)
    max_num_seqs = bounded_int(p, "_max_num_seqs", 1, MAX_CONFIG_SEQS)
    num_cpu_blocks = 0
    if profile.semantics is Semantics.KVSCHED:
        num_cpu_blocks = bounded_int(p, "_num_cpu_blocks", 0, MAX_CONFIG_BLOCKS)
    with ResumedTracing(), _dropped_if_inconsistent():
        if profile.semantics is Semantics.VLLM_V1:
            _assume_vllm_v1(p, num_gpu_blocks * profile.block_size, budget, max_num_seqs, profile)
        return SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=profile.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=profile.chunked,
            preemption_mode=profile.mode,
            num_cpu_blocks=num_cpu_blocks,
            policy=profile.policy,
            semantics=profile.semantics,
        )


def _assume_vllm_v1(
    p: SymbolicFactory, capacity: int, budget: int, max_num_seqs: int, profile: Profile
) -> None:
    """vllm-v1's config checks on symbolic fields, as constraints: a budget of at least
    ``max_num_seqs``, and a default ``max_model_len`` (the cache's capacity, or the budget
    with chunked prefill off) of at least 2."""
    assume(p, budget >= max_num_seqs)
    assume(p, capacity >= 2)
    if not profile.chunked:
        assume(p, budget >= 2)


def _queue_lengths(
    p: SymbolicFactory, mode: PreemptionMode, focus: str | None, grows: float
) -> tuple[int, int, int]:
    """Concrete queue lengths; only swap mode ever has swapped requests (R6).

    The ``focus`` queue (if any) gets at least one request (two running: a preemption
    needs a victim other than the head, which fits alone, R4), and with a waiting focus
    ``swapped`` stays empty (no admission while a request is swapped, R8). Each queue
    gets one more request with probability ``grows`` (``QUEUE_GROWS`` for the focus).
    """
    lengths: list[int] = []
    least = {"running": 2}.get(focus or "", 1) if focus is not None else 0
    live = least  # the focus queue's requests, kept their places
    for name, most in (
        ("waiting", MAX_WAITING),
        ("running", MAX_RUNNING),
        ("swapped", MAX_SWAPPED),
    ):
        limit = 0 if name == "swapped" and mode is not PreemptionMode.SWAP else most
        if name == "swapped" and focus == "waiting":
            limit = 0
        length = least if name == focus else 0
        while (
            length < limit
            and live < MAX_LIVE
            and choose(p, f"_{name}_has_{length}", QUEUE_GROWS if name == focus else grows)
        ):
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
    has_outputs = choose(p, tag + "_has_outputs", 0.75)
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
        if has_outputs:  # last: a wish that the constraints above may rule out
            prefer(p, len(outputs) >= 1)  # else the solver's first answer is 0, every time
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
    """A valid state between steps (``check_state``) within the sizes of ``spec.contracts``.

    On a quarter of the paths each, no queue or one queue is the focus, the others
    mostly short: a transition that looks a request up by id (``abort_request``)
    compares the ids of ``waiting``, then ``running``, then ``swapped``, each match a
    fresh branch, so a swapped request is reached mostly when the queues before it
    are empty (measured: with every queue alike, aborting a swapped request was too
    rare to find its planted bug in the budget).
    """
    focus = choose_one(p, "_focus", (None, "waiting", "running", "swapped"))
    return build_state(p, focus, QUEUE_GROWS if focus is None else OTHER_QUEUES_GROW)


@contextmanager
def _dropped_if_inconsistent() -> Iterator[None]:
    """Drop the path (``IgnoreAttempt``) if building the state fails.

    The constraints added are satisfiable together, but the solver's queries have a
    wall-clock timeout: on a loaded machine one can give up, after which the path's
    constraints may be inconsistent and a value the constraints keep positive comes
    out as 0 (seen under a load of 11: ``ConfigError`` for ``num_gpu_blocks``, whose
    message's ``repr`` of the symbolic value then recursed without end). Such a path
    is no input at all; without this, it would stop the whole CrossHair process. The
    same holds for a precondition of the spec that a builder's own call finds false
    on a plan built to meet it (seen once at a load of 8-9: ``plan_matches`` before
    ``sampling_request_ids`` in ``make_tokens``, which then stopped the process and
    left 14 contracts unanalysed; not reproduced alone, and never false at run time).
    """
    try:
        yield
    except (ConfigError, ZeroDivisionError, RecursionError, PreconditionFailed) as error:
        raise IgnoreAttempt(
            f"inconsistent path while building a state: {type(error).__name__}"
        ) from None


def build_state(
    p: SymbolicFactory, focus: str | None, grows: float = QUEUE_GROWS
) -> SchedulerState:
    """A valid state; with a ``focus`` queue, shaped for the phase that serves it.

    ``running``: at least two running requests and a full GPU pool on 3 paths in 4
    (phase A preempts); ``swapped``: swap mode with a swapped request (phase B swaps
    in); ``waiting``: a waiting request and nothing swapped (phase C admits). Without
    a focus, every mode and a full pool on ``POOL_FULL`` of the paths.
    """
    profile = choose_profile(p, KVSCHED_SHARE, PreemptionMode.SWAP if focus == "swapped" else None)
    mode = profile.mode
    num_waiting, num_running, num_swapped = _queue_lengths(p, mode, focus, grows)
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
    full = {None: POOL_FULL, "running": 0.75}.get(focus, 0.0)
    pool_full = full > 0 and choose(p, "_gpu_pool_full", full)
    # Phase A: the head's chunk capped by the budget (a prefill longer than it), on half
    # of the paths with a running focus.
    head_over_budget = focus == "running" and choose(p, "_head_over_budget", 0.5)
    free_cpu = 0
    if profile.semantics is Semantics.KVSCHED:
        free_cpu = bounded_int(p, "_num_free_cpu_blocks", 0)
    budget = bounded_int(p, "_max_num_batched_tokens", 1)
    max_num_seqs = bounded_int(p, "_max_num_seqs", max(1, num_running))
    next_arrival = bounded_int(p, "_next_arrival", 0)
    num_steps = bounded_int(p, "_num_steps", 0)
    with ResumedTracing(), _dropped_if_inconsistent():
        state = _assemble_state(
            p,
            queues,
            profile,
            free_gpu=free_gpu,
            free_cpu=free_cpu,
            budget=budget,
            max_num_seqs=max_num_seqs,
            next_arrival=next_arrival,
            num_steps=num_steps,
        )
        if pool_full:
            prefer(p, free_gpu == 0)
        if head_over_budget:
            head = state.running[0]
            prefer(p, budget < head.num_tokens - head.num_computed_tokens)
    with NoTracing():
        p.space.extra(_BuiltStates).states.append(state)
    return state


def _assemble_state(
    p: SymbolicFactory,
    queues: dict[str, tuple[RequestState, ...]],
    profile: Profile,
    *,
    free_gpu: int,
    free_cpu: int,
    budget: int,
    max_num_seqs: int,
    next_arrival: int,
    num_steps: int,
) -> SchedulerState:
    """The state from its parts, with the constraints that tie them (R2, R4; vllm-v1:
    its config checks and R10's ``max_model_len``)."""
    block_size, chunked, mode = profile.block_size, profile.chunked, profile.mode
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
    if profile.semantics is Semantics.VLLM_V1:
        _assume_vllm_v1(p, num_gpu_blocks * block_size, budget, max_num_seqs, profile)
    config = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_cpu_blocks=cpu_owned + free_cpu,
        policy=profile.policy,
        semantics=profile.semantics,
    )
    length = config.max_model_len
    if length is not None:  # R10: a live request stops before max_model_len tokens
        for request in live:
            assume(p, request.num_tokens < length)
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
    scheduled or not (in running order, each on about 3 paths in 4), with a chunk that
    starts at its computed count and either completes the request (it samples, on
    about half of the paths) or has 1..remaining-1 tokens. Without a state before it,
    the plan is empty.
    """
    with NoTracing():
        built = p.space.extra(_BuiltStates)
        state = built.states[-1] if built.states else None
    if state is None:
        return StepPlan(step=bounded_int(p, "_step", 0))
    chunks: list[ScheduledChunk] = []
    for request in state.running:
        rid = request.request_id
        if not choose(p, f"_plan_schedules_{rid}", 0.75):
            continue
        computed = request.num_computed_tokens
        samples = choose(p, f"_plan_{rid}_samples", 0.5)
        n = bounded_int(p, f"_plan_{rid}_num_tokens", 1)
        with ResumedTracing():
            if samples:
                assume(p, n == request.num_tokens - computed)
            else:
                assume(p, n < request.num_tokens - computed)
            chunks.append(ScheduledChunk(request_id=rid, start=computed, num_tokens=n))
    with ResumedTracing():
        plan = StepPlan.of(step=state.num_steps, scheduled=chunks)
    with NoTracing():
        built.plans[len(built.states) - 1] = plan
    return plan


def make_tokens(p: SymbolicFactory, key_type: type, value_type: type) -> Mapping[str, int] | None:
    """The sampled tokens of the step of the state (and plan) built last on this path.

    Exactly the ids of ``sampling_request_ids``, each with a symbolic token: any other
    key set only raises ``SampledTokensError`` (declared, so CrossHair drops the path).
    After a plan, they are its sampling requests; after a state alone (``step``), the
    builder runs ``schedule`` on it to learn them, which decides the path's branches
    in the order ``step`` then takes them again. With no state before it (not an
    argument of the spec's), CrossHair's own builder makes the mapping (None here).
    """
    with NoTracing():
        built = p.space.extra(_BuiltStates)
        if not built.states:
            return None
        index = len(built.states) - 1
        state, plan = built.states[index], built.plans.get(index)
    with ResumedTracing(), _dropped_if_inconsistent():
        if plan is None:
            state, plan = schedule(state)
        ids = sampling_request_ids(state, plan)
    by_id = {r.request_id: r for r in state.running}
    tokens: dict[str, int] = {}
    for rid in ids:
        request = by_id[rid]
        token = tokens[rid] = p(int, f"_token_{rid}")
        # R10's EOS finish: the token is the request's EOS on a quarter of the paths
        # (else the solver's first answer rarely is; measured: D-eos-dropped was missed).
        if choose(p, f"_token_{rid}_is_eos", 0.25):
            with ResumedTracing():
                eos = request.request.params.eos_token_id
                if eos is not None:
                    prefer(p, token == eos)
    return tokens


def make_prompt(p: SymbolicFactory, item_type: type) -> Sequence[int]:
    """A prompt given to ``add_request``: a tuple of 0..``MAX_PROMPT_LEN`` symbolic ids.

    CrossHair's own ``Sequence[int]`` (even a symbolic tuple) gets a concrete length
    when ``add_request`` copies it with ``tuple(...)``, at the first value the solver
    offers: 0, on every path (measured: every path of ``add_request`` raised
    ``EmptyPromptError``, so no accepted request was ever checked). The length is
    chosen here instead, each on about the same share of paths.
    """
    length = concrete_int(p, "_len", 0, MAX_PROMPT_LEN)
    return tuple(p(int, f"_{i}") for i in range(length))


def make_request_id(p: SymbolicFactory) -> str | None:
    """An argument named ``request_id``: a live id of the state built before it on
    half of the paths (each live one alike), else CrossHair's own symbolic string.

    The spec looks an id up by comparing it with the live ids in queue order, each
    match a fresh branch taken on a quarter of new paths (and the string's length is
    fixed first, at the solver's first answer): an abort of the second swapped request
    was reached on too few paths to find its planted bug in the budget. Any other
    ``str`` argument (None here) is CrossHair's own.
    """
    if not p.varname.startswith("request_id"):
        return None
    with NoTracing():
        built = p.space.extra(_BuiltStates)
        state = built.states[-1] if built.states else None
    if state is None:
        return None
    live = [r.request_id for r in (*state.waiting, *state.running, *state.swapped)]
    if not live or not choose(p, "_is_live", 0.5):
        return None
    return choose_one(p, "_live", live)


def make_sampling_params(p: SymbolicFactory) -> SamplingParams:
    """Any scheduling parameters (``max_tokens`` in 1..``MAX_MAX_TOKENS`` on most paths);
    ``temperature`` 0.0 and no ``seed``.

    The scheduler never reads those two (only the engine's sampler does), and a
    symbolic float can be NaN, which is not equal to itself: ``diffbehavior`` would
    report two equal inputs as changed.
    """
    max_tokens: int = p(int, "_max_tokens")
    eos: int | None = p(int | None, "_eos_token_id")
    ignore_eos: bool = p(bool, "_ignore_eos")
    priority: int = p(int, "_priority")
    valid = choose(p, "_max_tokens_valid", 0.85)
    with ResumedTracing():
        if valid:  # else a quarter of the paths of add_request end in InvalidMaxTokensError
            prefer(p, max_tokens >= 1)
            prefer(p, max_tokens <= MAX_MAX_TOKENS)
        return SamplingParams(
            max_tokens=max_tokens, eos_token_id=eos, ignore_eos=ignore_eos, priority=priority
        )


def make_draft(p: SymbolicFactory) -> StepDraft:
    """The start of phase A: a valid state, the whole budget, nothing decided.

    A draft is the input of one of phases A, B and C, which each serve one queue and
    return at once when it has nothing for them: on a third of the paths each, the
    state is shaped for one of them (``build_state``'s focus), so that every phase
    gets paths where it does its work (measured: with one shape for all, phase B
    swapped a request in on too few paths to find its planted bugs in the budget).
    """
    focus = choose_one(p, "_draft_focus", ("running", "swapped", "waiting"))
    state = build_state(p, focus)
    with ResumedTracing():
        return StepDraft(state=state, budget=state.config.max_num_batched_tokens)


MAX_VICTIM_BLOCKS = 3
"""The most GPU blocks a ``victim`` argument holds (ids ``0..k-1``, concrete)."""


class _Victim:
    """The block ids of the ``victim`` built on the current path, if any (one per path)."""

    def __init__(self, solver: object) -> None:
        self.block_ids: tuple[int, ...] = ()


def make_request_state(p: SymbolicFactory) -> RequestState | None:
    """A ``victim`` argument holding a small concrete pool of blocks, and running
    requests built after it on the same path that share them (prefix caching, PC6).

    ``release_victim(victim, ..., cache, others)`` frees the victim's blocks that none
    of ``others`` holds. CrossHair's own builder gives every request a symbolic tuple
    of symbolic block ids, and a block shared by the victim and another request then
    needs the solver to make two ids equal inside ``holders``' counter and ``release``'s
    sets (symbolic dict keys): that path was reached once in 13 CPU s and missed at 16
    the next run. Here the victim holds blocks ``0..k-1`` (``k`` in
    0..``MAX_VICTIM_BLOCKS``, about the same share each) and each request built later on
    the path (an element of ``others``, named ``RequestState_inheap...`` by CrossHair)
    holds, on about half of the paths, one of them (else none): the shares are
    concrete choices, every other field stays CrossHair's own symbolic value. Any other
    ``RequestState`` (None here) is CrossHair's own.
    """
    with NoTracing():
        victim = p.space.extra(_Victim)
    if p.varname.startswith("victim"):
        block_ids = tuple(range(concrete_int(p, "_num_blocks", 0, MAX_VICTIM_BLOCKS)))
        with NoTracing():
            victim.block_ids = block_ids
    elif victim.block_ids and p.varname.startswith("RequestState_inheap"):
        shares = choose(p, "_shares_a_block", 0.5)
        block_ids = (choose_one(p, "_shared", victim.block_ids),) if shares else ()
    else:
        return None
    request = crosshair.core.proxy_for_class(RequestState, p.varname)
    with ResumedTracing():
        return replace(request, block_ids=block_ids)


_REGISTERED: dict[type, Any] = {}


def _replace_builder(typ: type, creator: Callable[..., Any]) -> None:
    """Put ``creator`` in place of CrossHair's own builder for ``typ`` (``Mapping``,
    ``str``; ``Sequence`` has none), which it calls when the spec's shapes do not
    apply (``creator`` returns None)."""
    original = crosshair.core._SIMPLE_PROXIES.pop(typ, None)

    def build(p: SymbolicFactory, *type_args: type) -> Any:
        value = creator(p, *type_args)
        if value is None and original is not None:
            return original(p, *type_args)
        if value is None:
            return crosshair.core.proxy_for_class(typ, p.varname)
        return value

    register_type(typ, build)


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
    if RequestState not in _REGISTERED:
        _replace_builder(RequestState, make_request_state)
        _REGISTERED[RequestState] = make_request_state
    replaced: tuple[tuple[type, Callable[..., Any]], ...] = (
        (collections.abc.Mapping, make_tokens),
        (collections.abc.Sequence, make_prompt),
        (str, make_request_id),
    )
    for abstract, builder in replaced:
        if abstract not in _REGISTERED:
            _replace_builder(abstract, builder)
            _REGISTERED[abstract] = builder


register()
