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
  a budget and ``max_num_seqs`` that every request and the running queue fit;
- the profile: all six (``choose_profile``, ``DOMAINS`` for the functions of one
  profile's own step), each with what it keeps in the state; for kvsched and vllm-v1 a
  concrete prefix-cache pool on a share of the paths (``_build_pool``): block ids,
  shared blocks, keyed free blocks, hits.

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
from spec.prefix_cache import block_key, request_tokens
from spec.profiles import generation_blocks, num_tokens_with_placeholders
from spec.scheduler import StepDraft, first_draft, sampling_request_ids, schedule
from spec.types import (
    ConfigError,
    InFlightBatch,
    PreemptionMode,
    PrefixCacheState,
    Request,
    RequestState,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
)
from tests.crosshair import ANALYSED

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


def require(p: SymbolicFactory, condition: object) -> None:
    """Like ``assume``, but the path is dropped at once if the solver cannot meet
    ``condition`` with the constraints added before it.

    For the constraints that can contradict the earlier ones (a computed count that fills
    its blocks exactly, beside R4 and the lengths' bounds): ``assume`` adds them unchecked,
    and realizing a value on an unsatisfiable path then stops CrossHair itself
    ("Unexpected unsat from solver", seen on the prefix-cache states).
    """
    with NoTracing():
        if not hasattr(condition, "var"):
            if not condition:
                raise IgnoreAttempt("requirement is false")
        elif not p.space.choose_possible(condition.var, probability_true=1.0):
            raise IgnoreAttempt("requirement cannot be met")


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


KVSCHED_SHARE = 0.8
"""The share of a state's paths under the kvsched profile; the peer profiles split the rest.

Most of the transitions' rules (and the planted table's bugs) are kvsched's; the peer
profiles change a few gates, the victim and the budget, so they share a fifth of the paths
(measured: with a quarter each for kvsched, vllm-v1 and nano-vllm, four of phase A's and
C's planted bugs were missed in the budget at a load of 10). The modules that hold one
profile's own step get that profile alone (``DOMAINS``)."""

PHASED = (Semantics.KVSCHED, Semantics.VLLM_V1, Semantics.NANO_VLLM, Semantics.VLLM_V0)
"""The profiles whose step is phases A-C (a ``StepDraft``'s): transformers' and
TokenSpeed's steps are their own walks (``spec.offload``, ``spec.reserve``)."""

SWAPS = (Semantics.KVSCHED, Semantics.VLLM_V0, Semantics.TRANSFORMERS)
"""The profiles with a CPU pool (swap preemption, transformers' offload to the CPU)."""

CACHES = (Semantics.KVSCHED, Semantics.VLLM_V1)
"""The profiles whose states are built with a prefix-cache pool on some paths
(``CACHING_SHARE``). nano-vllm's cache (last-key-wins, drop-key-on-free) is reached at its
helpers only; the other profiles do not model caching (``ConfigError``)."""

CACHING_SHARE = 0.5
"""The share of a caching profile's paths with prefix caching on (decided before the
preemption mode, which is then recompute or restart); with a waiting focus
``CACHING_SHARE_ADMITTING`` (measured: at 0.3 of the paths outside swap mode, the
planted admission bugs over a pool were missed in the budget)."""
CACHING_SHARE_ADMITTING = 0.75

LONG_PREFILL_SHARE = 0.5
"""The share of vllm-v1's paths with a ``long_prefill_token_threshold`` (vllm-v1/long-prefill-cap),
a concrete one of ``1..MAX_LONG_PREFILL_THRESHOLD``: small enough to cut the prompts
these states hold."""
MAX_LONG_PREFILL_THRESHOLD = 3

ASYNC_SHARE = 0.25
"""The share of vllm-v1's paths with async scheduling on (vllm-v1/async-*; every path of
``spec.pipeline``'s functions). The builders put no step in flight (a run's start, or a
queue drained), so CrossHair follows async's scheduling and the advance of the step just
scheduled, not the applying of outputs, which the runtime contracts
(tests/spec/test_contracts_runtime.py), tests/spec/test_pipeline.py and the lockstep
with vLLM's AsyncScheduler check."""

DOMAINS: dict[str, tuple[Semantics, ...]] = {
    "spec.offload": (Semantics.TRANSFORMERS,),
    "spec.reserve": (Semantics.TOKENSPEED,),
    # The rule of these two profiles (prefill-first); under the others it is False.
    "spec.profiles.admits_first": (Semantics.NANO_VLLM, Semantics.VLLM_V0),
    # vllm-v1's rule; under the others it is 0.
    "spec.profiles.long_prefill_cap": (Semantics.VLLM_V1,),
    "spec.pipeline": (Semantics.VLLM_V1,),  # async scheduling is vllm-v1's alone
}
"""The profiles a module's (or one function's) rules are defined for; every other function
gets every profile. Without this a transformers-only walk would see a transformers state
on one path in twenty-five, and its contract would be checked on kvsched's states."""


def analysed_domain() -> tuple[Semantics, ...]:
    """The profiles of the function CrossHair analyses now (``ANALYSED``, set by the driver):
    its own entry in ``DOMAINS``, else its module's, else every profile."""
    name = ANALYSED[-1] if ANALYSED else ""
    module = name.rsplit(".", 1)[0]
    for key in (name, module):
        if key in DOMAINS:
            return DOMAINS[key]
    return tuple(Semantics)


def choose_semantics(p: SymbolicFactory, kvsched: float, allowed: Sequence[Semantics]) -> Semantics:
    """A profile of ``allowed`` per path: kvsched (if allowed) on ``kvsched`` of the paths,
    the others alike on the rest."""
    peers = [s for s in allowed if s is not Semantics.KVSCHED]
    if Semantics.KVSCHED in allowed and (not peers or choose(p, "_semantics_is_kvsched", kvsched)):
        return Semantics.KVSCHED
    return choose_one(p, "_semantics", peers)


@dataclass(frozen=True)
class Profile:
    """A profile's config-time constraints (``SchedulerConfig._check_*``), chosen
    concretely so that no path is spent on a ``ConfigError``."""

    semantics: Semantics
    mode: PreemptionMode
    policy: str
    chunked: bool
    block_size: int
    caching: bool = False


@dataclass(frozen=True)
class ProfileChoices:
    """What a profile's config checks leave to choose: its preemption modes, its policies
    (None: every registered one), chunked prefill (None: on or off) and the smallest
    block size."""

    modes: tuple[PreemptionMode, ...]
    policies: tuple[str, ...] | None
    chunked: bool | None
    min_block_size: int


RECOMPUTE_OR_SWAP = (PreemptionMode.RECOMPUTE, PreemptionMode.SWAP)
CHOICES: dict[Semantics, ProfileChoices] = {
    Semantics.KVSCHED: ProfileChoices(tuple(PreemptionMode), None, None, 1),
    Semantics.VLLM_V1: ProfileChoices((PreemptionMode.RECOMPUTE,), ("lifo", "priority"), None, 1),
    Semantics.NANO_VLLM: ProfileChoices((PreemptionMode.RECOMPUTE,), ("lifo",), False, 2),
    Semantics.VLLM_V0: ProfileChoices(RECOMPUTE_OR_SWAP, ("lifo",), False, 1),
    # transformers' page size is at least 4: MAX_BLOCK_SIZE alone.
    Semantics.TRANSFORMERS: ProfileChoices(RECOMPUTE_OR_SWAP, ("lifo",), True, MAX_BLOCK_SIZE),
    Semantics.TOKENSPEED: ProfileChoices((PreemptionMode.RECOMPUTE,), ("lifo",), True, 1),
}
"""Each profile's ``ProfileChoices`` (its ``SchedulerConfig._check_*``)."""


def choose_profile(
    p: SymbolicFactory,
    kvsched: float,
    mode: PreemptionMode | None = None,
    allowed: Sequence[Semantics] | None = None,
    caching_share: float = CACHING_SHARE,
) -> Profile:
    """The profile (one of ``allowed``, by default ``analysed_domain``) and the fields it
    constrains (``CHOICES``), each a concrete choice (a single option is no choice). ``mode``
    forces that preemption mode (swap: a profile of ``SWAPS``, unless none is allowed). A
    profile of ``CACHES`` has prefix caching on ``caching_share`` of the paths not forced
    to swap, and then no swap mode."""
    domain = tuple(allowed or analysed_domain())
    if mode is PreemptionMode.SWAP:
        swapping = tuple(s for s in domain if s in SWAPS)
        domain, mode = (swapping, mode) if swapping else (domain, None)
    semantics = choose_semantics(p, kvsched, domain)
    caching = (
        semantics in CACHES
        and mode is not PreemptionMode.SWAP
        and choose(p, "_enable_prefix_caching", caching_share)
    )
    rules = CHOICES[semantics]
    modes = tuple(m for m in rules.modes if not (caching and m is PreemptionMode.SWAP))
    mode = mode or choose_one(p, "_preemption_mode", modes)
    policy = (
        choose_policy(p) if rules.policies is None else choose_one(p, "_policy", rules.policies)
    )
    chunked = choose(p, "_enable_chunked_prefill", 0.5) if rules.chunked is None else rules.chunked
    block_size = concrete_int(p, "_block_size", rules.min_block_size, MAX_BLOCK_SIZE)
    return Profile(semantics, mode, policy, chunked, block_size, caching)


def make_policy(p: SymbolicFactory) -> Policy:
    """A registered policy (a ``Policy`` of arbitrary callables is not one)."""
    return POLICIES[choose_policy(p)]


def make_config(p: SymbolicFactory) -> SchedulerConfig:
    """A config alone: every profile (kvsched on a third of the paths, the others alike
    on the rest), every field symbolic within the ``MAX_CONFIG_*`` ranges and the
    profile's constraints."""
    profile = choose_profile(p, 1 / 3)
    num_gpu_blocks = bounded_int(p, "_num_gpu_blocks", 1, MAX_CONFIG_BLOCKS)
    budget = bounded_int(p, "_max_num_batched_tokens", 1, MAX_CONFIG_BUDGET)
    max_num_seqs = bounded_int(p, "_max_num_seqs", 1, MAX_CONFIG_SEQS)
    num_cpu_blocks = 0
    if profile.semantics in SWAPS:
        num_cpu_blocks = bounded_int(p, "_num_cpu_blocks", 0, MAX_CONFIG_BLOCKS)
    with ResumedTracing(), _dropped_if_inconsistent():
        capacity = num_gpu_blocks * profile.block_size
        _assume_profile(p, capacity, budget, max_num_seqs, profile)
        threshold, adaptive = _long_prefill(p, profile, capacity, budget)
        return SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=profile.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=profile.chunked,
            preemption_mode=profile.mode,
            num_cpu_blocks=num_cpu_blocks,
            policy=profile.policy,
            enable_prefix_caching=profile.caching,
            semantics=profile.semantics,
            long_prefill_token_threshold=threshold,
            long_prefill_token_threshold_adaptive=adaptive,
            async_scheduling=_async_scheduling(p, profile),
        )


def _assume_profile(
    p: SymbolicFactory, capacity: int, budget: int, max_num_seqs: int, profile: Profile
) -> None:
    """The profile's config checks on symbolic fields, as constraints. vllm-v1: a budget
    of at least ``max_num_seqs``, and a default ``max_model_len`` (the cache's capacity,
    or the budget with chunked prefill off) of at least 2; vllm-v0: the budget. (The
    others' checks are on concrete fields; tokenspeed's cache of at most 4097 tokens
    holds at these sizes.)"""
    if profile.semantics in (Semantics.VLLM_V1, Semantics.VLLM_V0):
        assume(p, budget >= max_num_seqs)
    if profile.semantics is Semantics.VLLM_V1:
        assume(p, capacity >= 2)
        if not profile.chunked:
            assume(p, budget >= 2)


def _long_prefill(
    p: SymbolicFactory, profile: Profile, capacity: int, budget: int
) -> tuple[int, bool]:
    """``long_prefill_token_threshold`` and its adaptive floor: (0, False) outside
    vllm-v1 and on the rest of its paths (``LONG_PREFILL_SHARE``); else a concrete
    threshold no larger than the default ``max_model_len`` (the cache's capacity, with
    chunked prefill off also the budget: vLLM's own check), adaptive on half the paths."""
    if profile.semantics is not Semantics.VLLM_V1 or not choose(
        p, "_long_prefill", LONG_PREFILL_SHARE
    ):
        return 0, False
    threshold = concrete_int(p, "_long_prefill_token_threshold", 1, MAX_LONG_PREFILL_THRESHOLD)
    assume(p, threshold <= capacity)
    if not profile.chunked:
        assume(p, threshold <= budget)
    return threshold, choose(p, "_long_prefill_adaptive", 0.5)


def _async_analysed() -> bool:
    """Whether CrossHair analyses one of ``spec.pipeline``'s functions (async's rules)."""
    return bool(ANALYSED) and ANALYSED[-1].startswith("spec.pipeline.")


def _async_scheduling(p: SymbolicFactory, profile: Profile) -> bool:
    """``async_scheduling``: on ``ASYNC_SHARE`` of vllm-v1's paths, on all of them for
    ``spec.pipeline``'s functions, off elsewhere."""
    if profile.semantics is not Semantics.VLLM_V1:
        return False
    return _async_analysed() or choose(p, "_async_scheduling", ASYNC_SHARE)


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
            if queue == "running" and _async_analysed():
                # One token left: a decode, which _decodes_in_flight puts in flight.
                prefer(p, computed == len(prompt) + len(outputs) - 1)
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
    p: SymbolicFactory,
    focus: str | None,
    grows: float = QUEUE_GROWS,
    allowed: Sequence[Semantics] | None = None,
) -> SchedulerState:
    """A valid state; with a ``focus`` queue, shaped for the phase that serves it.

    ``running``: at least two running requests and a full GPU pool on 3 paths in 4
    (phase A preempts); ``swapped``: swap mode with a swapped request (phase B swaps
    in); ``waiting``: a waiting request and nothing swapped (phase C admits). Without
    a focus, every mode and a full pool on ``POOL_FULL`` of the paths. The profile is
    one of ``allowed`` (by default ``analysed_domain``); what a profile keeps in the
    state is built by its rules: a prefix-cache pool (``_build_pool``), transformers'
    and TokenSpeed's ``decoding`` flags (``_mark_decoding``) and submission order,
    transformers' frozen admission, TokenSpeed's held ids.
    """
    swap = PreemptionMode.SWAP if focus == "swapped" else None
    caching = CACHING_SHARE_ADMITTING if focus == "waiting" else CACHING_SHARE
    profile = choose_profile(p, KVSCHED_SHARE, swap, allowed, caching)
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
    queues["running"] = _mark_decoding(p, profile, queues["running"])
    if profile.semantics is Semantics.NANO_VLLM:  # whole prefills: each is one decode away
        with ResumedTracing():
            for request in queues["running"]:
                require(p, len(request.output_token_ids) >= 1)
                require(p, request.num_computed_tokens == request.num_tokens - 1)
    if profile.semantics is Semantics.TOKENSPEED:  # tokenspeed/submission-order
        with ResumedTracing():
            for queue in ("waiting", "running"):
                for older, newer in zip(queues[queue], queues[queue][1:], strict=False):
                    assume(p, older.request.arrival < newer.request.arrival)
    free_gpu = 0 if profile.caching else bounded_int(p, "_num_free_gpu_blocks", 0)
    full = {None: POOL_FULL, "running": 0.75}.get(focus, 0.0)
    pool_full = full > 0 and choose(p, "_gpu_pool_full", full)
    cache: PrefixCacheState | None = None
    if profile.caching:
        queues, cache = _build_pool(p, profile.block_size, queues, pool_full, focus)
        free_gpu = len(cache.free_queue)
    # Phase A: the head's chunk capped by the budget (a prefill longer than it), on half
    # of the paths with a running focus.
    head_over_budget = focus == "running" and choose(p, "_head_over_budget", 0.5)
    free_cpu = 0
    if profile.semantics in SWAPS:
        free_cpu = bounded_int(p, "_num_free_cpu_blocks", 0)
    frozen = profile.semantics is Semantics.TRANSFORMERS and choose(p, "_admission_frozen", 0.25)
    held = profile.semantics is Semantics.TOKENSPEED and choose(p, "_ids_held", 0.25)
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
        # transformers/admission-frozen; tokenspeed/finished-id-held: an id no live
        # request has (a request that finished in the last step).
        state = replace(
            state,
            prefix_cache=cache,
            admission_frozen=frozen,
            ids_held=(f"r{MAX_LIVE}",) if held else (),
        )
        if pool_full and cache is None:
            prefer(p, free_gpu == 0)
        if head_over_budget:
            head = state.running[0]
            prefer(p, budget < head.num_tokens - head.num_computed_tokens)
    with NoTracing():
        p.space.extra(_BuiltStates).states.append(state)
    return state


TRACKS_DECODING = (Semantics.TRANSFORMERS, Semantics.TOKENSPEED)
"""The profiles that keep ``RequestState.decoding`` (``spec.profiles.tracks_decoding``)."""


def _mark_decoding(
    p: SymbolicFactory, profile: Profile, running: tuple[RequestState, ...]
) -> tuple[RequestState, ...]:
    """The running requests' ``decoding`` flags under ``TRACKS_DECODING``'s profiles: on
    a quarter of the paths one is mid-prefill (under transformers the newest, under tokenspeed
    any), as ``single_prefill_violations`` allows; every other one has sampled since its
    prefill, so it has an output and one token left to compute (a decode). Under
    transformers 3 decodes in 4 start a new block, so that a full pool starves them
    and the step offloads (a probe reached such a state in 1.2 CPU s; the offload's own
    planted bug is still missed in the budget: docs/crosshair.md)."""
    if profile.semantics not in TRACKS_DECODING or not running:
        return running
    prefilling: int | None = None
    if choose(p, "_one_prefilling", 0.25):
        last = len(running) - 1
        newest = profile.semantics is Semantics.TRANSFORMERS
        prefilling = last if newest else concrete_int(p, "_prefilling", 0, last)
    marked: list[RequestState] = []
    transformers = profile.semantics is Semantics.TRANSFORMERS
    edges = [transformers and choose(p, f"_{r.request_id}_at_block_edge", 0.75) for r in running]
    with ResumedTracing():
        for k, request in enumerate(running):
            if k == prefilling:
                marked.append(request)
                continue
            require(p, len(request.output_token_ids) >= 1)
            require(p, request.num_computed_tokens == request.num_tokens - 1)
            if edges[k]:  # its decode needs a new block: in a full pool it starves
                prefer(p, request.num_computed_tokens % profile.block_size == 0)
            marked.append(replace(request, decoding=True))
    return tuple(marked)


MAX_HELD_BLOCKS = 2
"""The most GPU blocks a running request holds in a state with a prefix-cache pool."""
MAX_FREE_BLOCKS = 2
"""The most free GPU blocks in a state with a prefix-cache pool."""


def _build_pool(
    p: SymbolicFactory,
    block_size: int,
    queues: dict[str, tuple[RequestState, ...]],
    pool_full: bool,
    focus: str | None,
) -> tuple[dict[str, tuple[RequestState, ...]], PrefixCacheState]:
    """The GPU pool of a state with prefix caching on (PC1, PC9): every block id concrete.

    Each running request holds 1..``MAX_HELD_BLOCKS`` blocks, its computed count
    constrained to fill them (the last one full on half of the paths), and each full
    block has its key, the request's prefix at that block (PC2). From the second request
    on, on 3 paths in 4 a request shares the first full block 0 of an earlier one, their
    tokens then equal over it (a shared block has a key: PC9). The free queue holds
    0..``MAX_FREE_BLOCKS`` blocks (none when ``pool_full``), each keyed on 3 paths in 4
    with ``bs`` symbolic tokens (the cached prefix of a request gone since, PC6), on 3 in
    4 of those the waiting head's first block, which it then hits (PC3, PC7). With a
    waiting ``focus`` at least one block is free (else nothing could be admitted). (Measured:
    with sharing and hits left to the solver's equalities, the planted admission and
    preemption bugs over a pool were missed in the budget.)
    """
    bs = block_size
    cached: list[tuple[tuple[int, ...], int]] = []
    running: list[RequestState] = []
    first: RequestState | None = None  # the first request whose block 0 is full
    next_id = 0
    for request in queues["running"]:
        rid = request.request_id
        num_blocks = concrete_int(p, f"_{rid}_num_blocks", 1, MAX_HELD_BLOCKS)
        # The first request's block 0 full on most paths: the others can share it.
        full = 0.75 if first is None else 0.5
        num_full = num_blocks - 1 + choose(p, f"_{rid}_last_block_full", full)
        shares = first is not None and num_full >= 1 and choose(p, f"_{rid}_shares", 0.75)
        with ResumedTracing():
            computed = request.num_computed_tokens
            require(p, computed > (num_blocks - 1) * bs)
            if num_full == num_blocks:
                require(p, computed == num_blocks * bs)
            else:
                require(p, computed < num_blocks * bs)
            tokens = request_tokens(request)
            if first is not None and shares:
                other = request_tokens(first)
                for t in range(bs):
                    require(p, tokens[t] == other[t])
            block_ids: list[int] = []
            for j in range(num_blocks):
                if j == 0 and first is not None and shares:
                    block_ids.append(first.block_ids[0])
                    continue
                if j < num_full:
                    cached.append((block_key(tokens, j, bs), next_id))
                block_ids.append(next_id)
                next_id += 1
            holder = replace(request, block_ids=tuple(block_ids))
        if first is None and num_full >= 1:
            first = holder
        running.append(holder)
    least = 1 if focus == "waiting" else 0
    num_free = 0 if pool_full else concrete_int(p, "_num_free_blocks", least, MAX_FREE_BLOCKS)
    free_queue = tuple(range(next_id, next_id + num_free))
    head = queues["waiting"][0] if queues["waiting"] else None
    for block in free_queue:
        if not choose(p, f"_block_{block}_keyed", 0.75):
            continue
        key = tuple(p(int, f"_block_{block}_key_{t}") for t in range(bs))
        if head is not None and choose(p, f"_block_{block}_hit", 0.75):
            with ResumedTracing():  # the waiting head's first block: a hit (PC3)
                # Its length first: ``request_tokens`` fixes the lengths it unpacks.
                require(p, len(head.request.prompt_token_ids) + len(head.output_token_ids) > bs)
                tokens = request_tokens(head)
                for t in range(bs):
                    require(p, key[t] == tokens[t])
        cached.append((key, block))
    pool = PrefixCacheState(free_queue=free_queue, cached=tuple(cached))
    return {**queues, "running": tuple(running)}, pool


def _owned_blocks(profile: Profile, request: RequestState) -> int:
    """R2 by profile, between steps: the GPU blocks a running request owns (with caching
    off): ``cdiv(computed, bs)``, and under tokenspeed/reserve-generation its reserve."""
    if profile.semantics is Semantics.TOKENSPEED:
        # ``generation_blocks`` reads the config's block size only.
        sizing = SchedulerConfig(
            num_gpu_blocks=1, block_size=profile.block_size, semantics=Semantics.TOKENSPEED
        )
        return generation_blocks(sizing, request)
    return blocks_held(request.num_computed_tokens, profile.block_size)


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
    """The state from its parts, with the constraints that tie them (R2, R4; vllm-v1 and
    vllm-v0: their config checks and R10's ``max_model_len``)."""
    block_size, chunked, mode = profile.block_size, profile.chunked, profile.mode
    live = (*queues["waiting"], *queues["running"], *queues["swapped"])
    if profile.caching:  # PC1: the distinct blocks held, a shared one counted once
        gpu_owned = len({b for r in queues["running"] for b in r.block_ids})
    else:
        gpu_owned = sum(_owned_blocks(profile, r) for r in queues["running"])
    cpu_owned = sum(blocks_held(r.num_computed_tokens, block_size) for r in queues["swapped"])
    num_gpu_blocks = gpu_owned + free_gpu
    assume(p, num_gpu_blocks >= 1)
    # A prefix-cache pool has a concrete size, which the requests built to fill their
    # blocks may not fit: checked as added (``require``), else CrossHair stops.
    fits = require if profile.caching else assume
    for request in live:
        prompt_len = len(request.request.prompt_token_ids)
        max_tokens = request.request.params.max_tokens
        assume(p, next_arrival > request.request.arrival)
        # R4: every live request fits alone (tokenspeed/submit-refusal: its reserve).
        if profile.semantics is Semantics.TOKENSPEED:
            assume(p, prompt_len + max_tokens <= num_gpu_blocks * block_size)
        else:
            cached = max_cached_tokens(prompt_len, max_tokens)
            fits(p, blocks_held(cached, block_size) <= num_gpu_blocks)
        if not chunked:
            assume(p, largest_prefill(prompt_len, max_tokens, mode) <= budget)
    _assume_profile(p, num_gpu_blocks * block_size, budget, max_num_seqs, profile)
    threshold, adaptive = _long_prefill(p, profile, num_gpu_blocks * block_size, budget)
    config = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_cpu_blocks=cpu_owned + free_cpu,
        policy=profile.policy,
        enable_prefix_caching=profile.caching,
        semantics=profile.semantics,
        long_prefill_token_threshold=threshold,
        long_prefill_token_threshold_adaptive=adaptive,
        async_scheduling=_async_scheduling(p, profile),
    )
    length = config.max_model_len
    if length is not None:  # R10: a live request stops before max_model_len tokens
        for request in live:
            fits(p, request.num_tokens < length)
    state = SchedulerState(
        config=config,
        num_free_gpu_blocks=free_gpu,
        num_free_cpu_blocks=free_cpu,
        waiting=queues["waiting"],
        running=queues["running"],
        swapped=queues["swapped"],
        next_arrival=next_arrival,
        num_steps=num_steps,
    )
    if config.async_scheduling and not config.enable_prefix_caching and num_steps >= 1:
        return _decodes_in_flight(state)
    return state


def _decodes_in_flight(state: SchedulerState) -> SchedulerState:
    """The async state whose step in flight is the decodes of ``state``'s running requests
    that have one token left and room for it in their last block: each has that token
    computed, a placeholder for it and one token in flight (vllm-v1/async-placeholders),
    so that the steps CrossHair follows apply outputs too. (Caching off: a decode that
    fills its block would key it.)"""
    bs = state.config.block_size
    chunks: list[ScheduledChunk] = []
    running: list[RequestState] = []
    for request in state.running:
        computed = request.num_computed_tokens
        if computed != request.num_tokens - 1 or computed % bs == 0:
            running.append(request)
            continue
        rid = request.request_id
        chunks.append(ScheduledChunk(request_id=rid, start=computed, num_tokens=1))
        running.append(
            replace(
                request,
                num_computed_tokens=computed + 1,
                num_output_placeholders=1,
                num_in_flight_tokens=1,
            )
        )
    if not chunks:
        return state
    batch = InFlightBatch(
        step=state.num_steps - 1,
        scheduled=tuple(chunks),
        sampling_ids=tuple(c.request_id for c in chunks),
        arrivals=tuple(r.request.arrival for r in running if r.num_in_flight_tokens),
    )
    return replace(state, running=tuple(running), in_flight=(batch,))


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
            end = num_tokens_with_placeholders(request)  # async: on top of the placeholders
            if samples:
                assume(p, n == end - computed)
            else:  # none when it is one token from its end (a decode)
                require(p, n < end - computed)
            chunks.append(ScheduledChunk(request_id=rid, start=computed, num_tokens=n))
    with ResumedTracing():
        plan = StepPlan.of(step=state.num_steps, scheduled=chunks)
    with NoTracing():
        built.plans[len(built.states) - 1] = plan
    return plan


def make_tokens(
    p: SymbolicFactory, key_type: type, value_type: type
) -> Mapping[str, int] | Mapping[str, tuple[int, ...]] | None:
    """The sampled tokens of the step of the state (and plan) built last on this path.

    Exactly the ids of ``sampling_request_ids``, each with a symbolic token (for a
    mapping of runs, ``complete_verified_step``'s, a run of that one token): any other
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
    by_id = {r.request_id: r for r in (*state.running, *state.waiting)}
    tokens: dict[str, int] = {}
    runs = getattr(value_type, "__origin__", value_type) is tuple
    # R10's EOS finish: the token is the request's EOS on a share of the paths (else the
    # solver's first answer rarely is; measured: D-eos-dropped was missed). Half of them
    # for complete_verified_step, whose stop checks run token by token through
    # _run_into (at a quarter D-eos-dropped took 10-17 CPU s there, and was missed once
    # on 2026-12-04; at a half, 4-6 s); a quarter elsewhere, where most bugs show on a
    # request that goes on running.
    eos_share = 0.5 if runs else 0.25
    for rid in ids:
        request = by_id[rid]
        token = tokens[rid] = p(int, f"_token_{rid}")
        if choose(p, f"_token_{rid}_is_eos", eos_share):
            with ResumedTracing():
                eos = request.request.params.eos_token_id
                if eos is not None:
                    prefer(p, token == eos)
    if runs:  # complete_verified_step's: a run of one (the symbolic configs draft nothing)
        return {rid: (token,) for rid, token in tokens.items()}
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
    phased = [s for s in analysed_domain() if s in PHASED]
    state = build_state(p, focus, allowed=phased or PHASED)
    with ResumedTracing():
        return first_draft(state)


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
    ``RequestState`` is CrossHair's own. None has drafts or blocks ahead: the symbolic
    configs never decode speculatively (``make_config``), so a request with them would
    only fail the preconditions (measured: two planted bugs were missed while CrossHair
    spent its paths on them).
    """
    with NoTracing():
        victim = p.space.extra(_Victim)
    request = _request_state_without_drafts(p)
    if p.varname.startswith("victim"):
        block_ids = tuple(range(concrete_int(p, "_num_blocks", 0, MAX_VICTIM_BLOCKS)))
        with NoTracing():
            victim.block_ids = block_ids
    elif victim.block_ids and p.varname.startswith("RequestState_inheap"):
        shares = choose(p, "_shares_a_block", 0.5)
        block_ids = (choose_one(p, "_shared", victim.block_ids),) if shares else ()
    else:
        return request
    with ResumedTracing():
        return replace(request, block_ids=block_ids)


def _request_state_without_drafts(p: SymbolicFactory) -> RequestState:
    """CrossHair's own ``RequestState`` (every field symbolic, as ``proxy_for_class``
    makes it) but for the speculative-decoding fields, left empty: a symbolic
    ``spec_token_ids`` costs the solver a tuple on every path for states no symbolic
    config reaches."""
    request = p(Request, "_request")
    outputs = p(tuple[int, ...], "_output_token_ids")
    computed = p(int, "_num_computed_tokens")
    preemptions = p(int, "_num_preemptions")
    block_ids = p(tuple[int, ...], "_block_ids")
    decoding = p(bool, "_decoding")
    placeholders = p(int, "_num_output_placeholders")
    in_flight = p(int, "_num_in_flight_tokens")
    stale = p(int, "_num_stale_output_tokens")
    with ResumedTracing():
        return RequestState(
            request=request,
            output_token_ids=outputs,
            num_computed_tokens=computed,
            num_preemptions=preemptions,
            block_ids=block_ids,
            decoding=decoding,
            num_output_placeholders=placeholders,
            num_in_flight_tokens=in_flight,
            num_stale_output_tokens=stale,
        )


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
