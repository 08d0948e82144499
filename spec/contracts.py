"""Check-only wrappers, and the state sizes CrossHair verifies (docs/crosshair.md).

Nothing here is used by the scheduler: these functions exist to be analysed by
``crosshair check`` (``scripts/crosshair_check``). The contracts of the real
transitions live in their own docstrings and hold for states of any size; the
*bounds* below are the sizes the symbolic check covers, written down once:

- ``tests/crosshair/symbolic.py`` builds every ``SchedulerState`` (and
  ``SchedulerConfig``) that CrossHair analyses within them, valid by construction;
- the wrappers below state them again as preconditions (``within_bounds``), so the
  bounds are visible in their contracts.

A wrapper is needed where a property is not a postcondition of one call: which
exception a call raises (a PEP 316 ``post:`` only speaks of normal returns), or a
property that relates transitions. Each one calls the real functions and restates
nothing they already promise: CrossHair *assumes* a callee's own postconditions while
it analyses a caller (a path that breaks one is dropped), so a restated one would
hide a bug rather than find it (docs/crosshair.md, "How the check is shaped").
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.invariants import check_state  # noqa: F401  (used by the PEP 316 contracts)
from spec.lifecycle import abort_request, add_request, is_live
from spec.policies import get_policy, lifo_victim
from spec.profiles import prefill_first, too_large
from spec.scheduler import schedule
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidMaxTokensError,
    RequestTooLargeError,
    SamplingParams,
    SchedulerState,
    UnknownRequestError,
)

# --- the state sizes the symbolic check covers ------------------------------------------

MAX_WAITING = 2
"""At most this many waiting requests in an analysed state."""
MAX_RUNNING = 3
"""At most this many running requests."""
MAX_SWAPPED = 2
"""At most this many swapped requests."""
MAX_LIVE = 4
"""At most this many live requests in all."""
MAX_PROMPT_LEN = 6
"""Prompt lengths 1..6."""
MAX_OUTPUTS = 3
"""At most 3 outputs so far per live request."""
MAX_MAX_TOKENS = 8
"""``max_tokens`` 1..8."""
MAX_BLOCK_SIZE = 4
"""``block_size`` 1..4 (a concrete value on each path)."""
MAX_PREEMPTIONS = 3
"""``num_preemptions`` 0..3."""
MAX_CONFIG_BLOCKS = 8
"""A ``SchedulerConfig`` built alone has 1..8 GPU blocks and 0..8 CPU blocks."""
MAX_CONFIG_BUDGET = 16
"""... ``max_num_batched_tokens`` 1..16 ..."""
MAX_CONFIG_SEQS = 4
"""... and ``max_num_seqs`` 1..4."""


def within_bounds(state: SchedulerState) -> bool:
    """Whether ``state`` is inside the sizes above (the queues and the requests)."""
    live = (*state.waiting, *state.running, *state.swapped)
    return (
        len(state.waiting) <= MAX_WAITING
        and len(state.running) <= MAX_RUNNING
        and len(state.swapped) <= MAX_SWAPPED
        and len(live) <= MAX_LIVE
        and 1 <= state.config.block_size <= MAX_BLOCK_SIZE
        and all(
            1 <= len(r.request.prompt_token_ids) <= MAX_PROMPT_LEN
            and len(r.output_token_ids) <= MAX_OUTPUTS
            and r.request.params.max_tokens <= MAX_MAX_TOKENS
            for r in live
        )
    )


# --- R4: admission rejects exactly the requests that can never fit -----------------------


def first_failing_check(
    state: SchedulerState, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
) -> str:
    """R4's checks in order: the error of the first that fails, else ``"accepted"``."""
    if len(prompt_token_ids) == 0:
        return "EmptyPromptError"
    if params.max_tokens < 1:
        return "InvalidMaxTokensError"
    if is_live(state, request_id):
        return "DuplicateRequestError"
    if too_large(state.config, len(prompt_token_ids), params.max_tokens):
        return "RequestTooLargeError"
    return "accepted"


def admission_outcome(
    state: SchedulerState, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
) -> str:
    """``add_request``'s outcome as a name: ``"accepted"`` or the error it raised.

    The PEP 316 ``post:`` of ``add_request`` only sees accepted requests; this wrapper
    lets the contract speak about refusals too. R4's checks run in order (empty
    prompt, ``max_tokens < 1``, live id, can never fit), so a request is refused as
    too large exactly when it passes the first three and the profile's ``too_large``
    holds. (What
    an accepted request looks like is ``add_request``'s own contract.)

    pre: check_state(state)
    pre: within_bounds(state)
    pre: len(prompt_token_ids) <= MAX_PROMPT_LEN
    pre: params.max_tokens <= MAX_MAX_TOKENS
    post: __return__ == first_failing_check(state, request_id, prompt_token_ids, params)
    """
    try:
        add_request(state, request_id, prompt_token_ids, params)
    except (
        EmptyPromptError,
        InvalidMaxTokensError,
        DuplicateRequestError,
        RequestTooLargeError,
    ) as error:
        return type(error).__name__
    return "accepted"


# --- R11: an abort is refused exactly for an id that is not live -------------------------


def abort_refused(state: SchedulerState, request_id: str) -> bool:
    """Whether ``abort_request(state, request_id)`` raised ``UnknownRequestError``.

    R11: ``abort`` works in every state, so it is refused exactly when the id is not
    live. (What an accepted abort frees and keeps is ``abort_request``'s own contract.)

    pre: check_state(state)
    pre: within_bounds(state)
    post: __return__ == (not is_live(state, request_id))
    """
    try:
        abort_request(state, request_id)
    except UnknownRequestError:
        return True
    return False


# --- liveness: every step serves a head (docs/semantics.md, spec.liveness) ----------------


def head_progresses(state: SchedulerState) -> bool:
    """The step of the liveness argument: in every step some head of a queue is served.

    If ``running`` is not empty, its head is scheduled in the step, under every policy
    whose victim is ``lifo``'s (the head is preempted only when alone, and alone it
    fits by R4). If ``running`` is empty and a request is waiting or swapped, the step
    schedules one (the head of ``swapped``, or the first waiting request, fits alone
    by R4; no admission gate refuses an empty engine) -- under every policy. Under
    nano-vllm/prefill-first only a step that admits nobody decodes the head.

    pre: check_state(state)
    pre: within_bounds(state)
    post: __return__
    """
    _, plan = schedule(state)
    scheduled = [chunk.request_id for chunk in plan.scheduled]
    if state.running:
        waiting = {r.request_id for r in state.waiting}
        if prefill_first(state.config) and any(rid in waiting for rid in scheduled):
            return True  # a prefill step: the head decodes in the next step that admits none
        if get_policy(state.config.policy).select_victim is not lifo_victim:
            return True  # the argument is lifo's; other victim choices may preempt the head
        return scheduled[:1] == [state.running[0].request_id]
    return bool(scheduled) or not (state.waiting or state.swapped)
