"""The coverage events of the transformers and tokenspeed profiles' rules (docs/semantics.md,
"transformers", "tokenspeed"): a rule *made a difference* in a step when the spec's step
without it (its function replaced by ``WITHOUT[rule]``, what kvsched's R1-R11 do there)
decides otherwise, or, for the rules with no function of their own, when what the rule
alone allows is seen in the step.

``WITHOUT`` is also what tests/peers/test_profile_rules.py patches the spec with to show
that each rule is what makes the spec agree with the peer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any
from unittest import mock

import spec
import spec.offload
import spec.reserve
from spec.kv import cdiv, never_fits
from spec.types import (
    DuplicateRequestError,
    RequestState,
    RequestTooLargeError,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
)


def _all_starved(needs: list[int], held: list[int], free: int, num_active: int) -> int:
    return min(len(needs), num_active - 1)


def _no_reserve(config: SchedulerConfig, request: RequestState) -> int:
    return cdiv(request.num_tokens, config.block_size)


#: rule -> (the spec module that asks it, the function's name there, the function
#: without the rule).
WITHOUT: dict[str, tuple[ModuleType, str, Callable[..., Any]]] = {
    "transformers/safety-margin": (spec.offload, "in_safety_margin", lambda config, free: True),
    "transformers/skip-not-fit": (spec.offload, "skips_unfit", lambda config: False),
    "transformers/offload-starved": (spec.offload, "num_offloaded", _all_starved),
    "transformers/offloaded-interleaved": (
        spec.offload,
        "interleave_offloaded",
        lambda swapped, waiting: (*swapped, *waiting),
    ),
    "transformers/admission-frozen": (
        spec.offload,
        "admission_frozen_after",
        lambda frozen, offloaded, finished: False,
    ),
    "tokenspeed/reserve-generation": (spec.reserve, "generation_blocks", _no_reserve),
    "tokenspeed/skip-not-fit": (spec.reserve, "skips_unfit", lambda config: False),
    "tokenspeed/submission-order": (spec.reserve, "submission_order", tuple),
}

#: The rules whose step-time difference is an event here, by profile (admission-frozen's
#: difference is the next step's: ``frozen_held_back``).
STEP_RULES: dict[Semantics, tuple[str, ...]] = {
    Semantics.TRANSFORMERS: (
        "transformers/safety-margin",
        "transformers/skip-not-fit",
        "transformers/offload-starved",
        "transformers/offloaded-interleaved",
    ),
    Semantics.TOKENSPEED: (
        "tokenspeed/reserve-generation",
        "tokenspeed/skip-not-fit",
        "tokenspeed/submission-order",
    ),
}


def decisions(mid: SchedulerState, plan: StepPlan) -> tuple[object, ...]:
    """What a step decided: its chunks, victims and swap-ins, and the queues' order."""
    queues = tuple(tuple(r.request_id for r in q) for q in (mid.waiting, mid.running, mid.swapped))
    return plan.scheduled, plan.preempted, plan.swapped_in, queues


def _decided(state: SchedulerState) -> tuple[object, ...]:
    return decisions(*spec.schedule(state))


def differs_without(rule: str, before: SchedulerState, decided: tuple[object, ...]) -> bool:
    """Whether the spec's step from ``before`` without ``rule`` decides other than
    ``decided`` (a step that fails without it differs too)."""
    module, name, without = WITHOUT[rule]
    with mock.patch.object(module, name, without):
        try:
            return _decided(before) != decided
        except Exception:
            return True


def frozen_held_back(before: SchedulerState, decided: tuple[object, ...]) -> bool:
    """transformers/admission-frozen: the step would have decided otherwise unfrozen."""
    if not before.admission_frozen or not (before.waiting or before.swapped):
        return False
    return _decided(replace(before, admission_frozen=False)) != decided


def offload_reserve_events(
    before: SchedulerState, mid: SchedulerState, plan: StepPlan
) -> Iterator[str]:
    """The events of a step under the transformers or tokenspeed profile."""
    config = before.config
    rules = STEP_RULES.get(config.semantics)
    if rules is None:
        return
    decided = decisions(mid, plan)
    for rule in rules:
        if differs_without(rule, before, decided):
            yield f"{rule}: the step differs without it"
    if config.semantics is Semantics.TRANSFORMERS:
        if frozen_held_back(before, decided):
            yield "transformers/admission-frozen: the step differs unfrozen"
        if len(mid.running) > config.max_num_seqs:
            yield "transformers/seq-limit-per-step: more than max_num_seqs running"
        waiting_ids = {r.request_id for r in before.waiting}
        if plan.preempted and waiting_ids - set(plan.scheduled_ids):
            yield "transformers/victims-at-tail: a victim requeued behind waiting requests"
        return
    decoding = {r.request_id for r in before.running if r.decoding}
    if plan.scheduled and decoding and not decoding & set(plan.scheduled_ids):
        yield "tokenspeed/prefill-first: a prefill step with decoding requests left out"


def refusal_events(
    state: SchedulerState, request_id: str, prompt_len: int, max_tokens: int, refused: Exception
) -> Iterator[str]:
    """The events of a request both sides refused (``state``: the spec's, unchanged)."""
    if state.config.semantics is not Semantics.TOKENSPEED:
        return
    if isinstance(refused, RequestTooLargeError) and not never_fits(
        state.config, prompt_len, max_tokens
    ):
        yield "tokenspeed/submit-refusal: refused a request kvsched's R4 accepts"
    if isinstance(refused, DuplicateRequestError) and request_id in state.ids_held:
        yield "tokenspeed/finished-id-held: a finished or aborted id refused before the next plan"
