"""Liveness: how long it takes, at most, for every live request to finish.

The argument (docs/semantics.md, "Why every accepted request finishes", and the
docstring of ``spec.lifecycle.add_request``) is about the *head* of ``running`` under
``lifo``: it is never preempted, is scheduled first in every step with the whole
budget, and so finishes in a number of steps that depends only on its own progress.
Heads follow one another without a gap, each request is head at most once, and the
bound below adds up how long each live request can be head.
"""

from __future__ import annotations

from spec.invariants import check_state  # noqa: F401  (used by the PEP 316 contracts)
from spec.kv import cdiv
from spec.oracle import TokenOracle
from spec.profiles import (
    admits_after_swap_in,
    least_chunk,
    prefill_first,
)
from spec.scheduler import step
from spec.types import (
    PreemptionMode,
    RequestState,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)


def head_steps(request: RequestState, budget: int) -> int:
    """Steps a request needs as the head of ``running``, from its current progress, in
    which it is scheduled.

    As the head it gets ``min(remaining, budget)`` tokens every step
    (``remaining = num_tokens - computed``), so its prefill completes, sampling its
    next output, after ``ceil(remaining / budget)`` steps; every later step is a
    decode that samples one more. It has ``max_tokens - outputs`` outputs to go, so
    it finishes (``length``, or earlier on EOS) within
    ``ceil(remaining / budget) + (max_tokens - outputs - 1)`` steps.

    Under async scheduling (vllm-v1/async-placeholders) a placeholder ``p`` counts as
    an output already sampled and as a token still to compute (its position is
    computed, its token not yet known): ``remaining = num_tokens + p - computed`` and
    ``outputs + p`` outputs. A request whose step in flight samples its last allowed
    token is scheduled no more (vllm-v1/async-max-tokens): zero steps. The step that
    applies its finish is the drain bound's lag step, not counted here.

    pre: budget >= 1
    pre: 0 <= request.num_computed_tokens
    pre: request.num_computed_tokens < request.num_tokens + request.num_output_placeholders
    pre: len(request.output_token_ids) < request.request.params.max_tokens
    post: __return__ >= 1 or (__return__ >= 0 and request.num_output_placeholders > 0)
    """
    placeholders = request.num_output_placeholders
    remaining = request.num_tokens + placeholders - request.num_computed_tokens
    to_sample = request.request.params.max_tokens - len(request.output_token_ids) - placeholders
    if to_sample <= 0:
        return 0
    return cdiv(remaining, budget) + to_sample - 1


def worst_head_steps(request: RequestState, config: SchedulerConfig) -> int:
    """Steps a request can need as head, whatever happens to it before it gets there.

    Until it is head it may be preempted any number of times, losing its computed
    tokens. Counting pessimistically from ``computed = 0``, with ``B`` the fewest
    tokens a head's chunk gets (``least_chunk``: the budget, or under
    vllm-v1/long-prefill-cap ``min(budget, threshold)``):

    - restart mode may also discard its outputs: ``ceil(P / B) + M - 1``;
    - recompute and swap modes keep the outputs ``o`` (they only grow, and a swap that
      does not fit falls back to recompute): ``ceil((P + o) / B) + M - o - 1``.

    Both are at least ``head_steps`` of any progress it can be in when it becomes
    head: ``ceil((P + o') / B) + M - o' - 1`` does not grow with ``o'`` (one more
    output adds at most one prefill step and saves one decode step), and a computed
    prefix only shortens the prefill.

    pre: config.max_num_batched_tokens >= 1
    pre: len(request.request.prompt_token_ids) >= 1
    pre: len(request.output_token_ids) < request.request.params.max_tokens
    post: __return__ >= 1
    """
    budget = least_chunk(config)
    prompt_len = len(request.request.prompt_token_ids)
    max_tokens = request.request.params.max_tokens
    if config.preemption_mode is PreemptionMode.RESTART:
        return cdiv(prompt_len, budget) + max_tokens - 1
    outputs = len(request.output_token_ids)
    return cdiv(prompt_len + outputs, budget) + max_tokens - outputs - 1


def drain_step_bound(state: SchedulerState) -> int:
    """An upper bound on the steps until every live request has finished.

    Valid under ``lifo`` with no new arrivals and no aborts, for a state between steps
    that satisfies the invariants (every live request fits alone, R4).

    Derivation. Call the head of ``running`` at the start of a step that step's head.

    1. The head is never preempted: the ``lifo`` victim for ``running[i]`` is the last
       of ``running[i:]``, which is the head only when the head is alone, and alone it
       fits (R4), so it never needs a victim.
    2. The head is scheduled first with the whole budget ``B``, so it finishes within
       ``head_steps`` of its progress when it became head.
    3. When the head finishes, the next request in ``running`` is head of the next
       step; if ``running`` is empty, the next step admits (R7, R8) the head of
       ``swapped`` or the first waiting request, which fits alone, with the whole
       budget: it is that step's head. So every step of the drain has a head, and a
       request, once head, stays head until it finishes: each is head at most once,
       in one unbroken run of steps.

    Hence the drain takes at most the sum, over the live requests, of how long each
    can be head: ``head_steps`` of its current progress for the current head of
    ``running`` (nothing can happen to it before), and ``worst_head_steps`` for every
    other request. Writing ``B = max_num_batched_tokens``, ``P`` the prompt length,
    ``M`` max_tokens, ``o`` the outputs so far and ``r = num_tokens - computed``::

        bound = [ceil(r_h / B) + M_h - o_h - 1]                  (the head, if any)
              + sum over the others of
                  ceil((P + o) / B) + M - o - 1                  (recompute, swap)
                  ceil(P / B) + M - 1                            (restart)

    It is tight for one request at a time (a lone request finishes in exactly this
    many steps when it never samples EOS) and loose by up to the number of requests
    that make progress side by side, since the argument credits progress to the head
    only. Observed (``tests/spec/test_properties.py``, small contended pools): bound /
    actual has a median of 1.1-1.25, a 90th percentile of 2-2.3 and a maximum of about
    3.3; the seed tutorial's scenario gives 64 against 34 steps (recompute) and 57
    (restart); with no memory pressure at all it tends to the number of requests
    running side by side (8 requests that all fit at once: 64 against 8).

    **Profiles.** ``vllm-v1`` (``lifo``): the same bound. Its R4 accepts every prompt
    shorter than ``max_model_len`` and vllm-v1/max-model-len finishes a request before
    it holds ``max_model_len`` tokens, which fit the GPU cache (and, chunked prefill off,
    one budget), so a lone request still fits (step 1); the full-sequence gate asks for
    ``cdiv(num_tokens, bs)`` blocks, all free when ``running`` is empty (step 3); and
    finishing at ``max_model_len`` only ends a request sooner. Under
    vllm-v1/long-prefill-cap the head's chunk may be cut to ``T`` (the threshold; the
    adaptive floor only raises it), so ``B`` above is ``least_chunk``'s ``min(B, T)``:
    steps 1-3 hold as they are (the cut is a smaller chunk of the same request, and
    a chunk of ``min(B, T)`` tokens needs no more blocks than the uncut one).

    ``nano-vllm``: a step that admits (nano-vllm/prefill-first) does not decode the
    head, so step 2 holds only for decode steps, and the head is never a victim
    (victim-next preempts the candidate *after* the current request, so the head only
    when alone, and alone it fits). Call ``H`` the bound above. Decode steps, and the
    admissions into an empty ``running`` that start a head, are at most ``H`` (each is
    a step of some head's run, counted as above). Every other step is a prefill step
    admitting at least one request; each admission takes a request out of ``waiting``,
    and requests enter ``waiting`` only as victims, at most ``n - 1`` per decode step
    for ``n`` live requests. So with ``W`` requests waiting now the drain takes at most
    ``H + W + (n - 1) * H = n * H + W`` steps (loose; honest).

    ``vllm-v1`` with async scheduling (vllm-v1/async-*, a batch queue of two): steps
    1-3 hold with ``head_steps`` read on top of the placeholders, and the one-step lag
    adds steps the sum does not count, each bounded:

    a. A head's run ends one step late: after the step that schedules its last
       allowed token (or samples its EOS), the next step walks past it
       (vllm-v1/async-max-tokens; an EOS in flight is scheduled once more and that
       output discarded, vllm-v1/async-discard) and applies its finish, since the
       step it queues fills the batch queue. One **lag step** per request, at most.
    b. Step 3's admission still has a head ready: a waiting request walked past for
       a stale output (vllm-v1/async-stale-output) was preempted by the step then
       scheduled, and that step applies the step in flight, delivering the stale
       output, before the next one; a preempting step admits nobody anyway. So
       between steps no waiting request waits on a stale output, and an empty
       ``running`` admits the waiting head as before. The head of ``running`` is never
       preempted (step 1: alone it fits, and it is never scheduled past ``max_tokens``
       or ``max_model_len``, vllm-v1/async-max-tokens).
    c. After the last finish the batch queue empties in two steps: one the finish
       still makes schedule (``has_finished_requests``), which applies the step queued
       with the finish, and one that only applies its own.

    So the bound is ``H + n + 2`` for ``n > 0`` live requests; with none live, the
    tail under way: a step for the finish not yet reported, and one per step in
    flight. It is exact for a lone request that never samples EOS, from every state
    of its run (tests/spec/test_pipeline.py).

    ``vllm-v0``: the head may be a victim (vllm-v0/append-touches-last-block: alone,
    holding every block, a decode into its partly filled last block still wants a free
    one, so it preempts itself), so heads do not follow one another. Another count
    holds: chunked prefill is off under the profile, so every chunk samples a token (a
    whole prefill, a decode, a swap-in's decode), and a request samples at most
    ``M - o`` more. A step that schedules nothing has a lone head that preempted itself;
    then ``running`` is empty and the next step schedules the head of ``swapped`` or
    (nothing swapped) of ``waiting``, which fits the empty pool above the watermark
    (the profile's config). So at most every other step is empty:
    ``2 * sum(M - o)`` over the live requests.

    pre: check_state(state)
    post: __return__ >= 0
    """
    if not admits_after_swap_in(state.config):  # vllm-v0
        requests = (*state.waiting, *state.running, *state.swapped)
        return 2 * sum(r.request.params.max_tokens - len(r.output_token_ids) for r in requests)
    bound = lifo_drain_bound(state)
    if state.config.async_scheduling:
        live = len(state.waiting) + len(state.running) + len(state.swapped)
        if live:
            return bound + live + 2
        return len(state.in_flight) + state.has_finished_requests  # c., under way
    if prefill_first(state.config):
        live = len(state.waiting) + len(state.running) + len(state.swapped)
        return live * bound + len(state.waiting)
    return bound


def lifo_drain_bound(state: SchedulerState) -> int:
    """``drain_step_bound``'s ``H``: the sum over the live requests of their head steps.

    pre: check_state(state)
    post: __return__ >= 0
    """
    config = state.config
    bound = 0
    others: tuple[RequestState, ...] = (*state.waiting, *state.swapped)
    if state.running:
        bound += head_steps(state.running[0], least_chunk(config))
        others = (*state.running[1:], *others)
    for request in others:
        bound += worst_head_steps(request, config)
    return bound


def drain(
    state: SchedulerState, next_token: TokenOracle, max_steps: int
) -> tuple[SchedulerState, tuple[StepPlan, ...]]:
    """Step with the oracle until nothing is live or ``max_steps`` steps have run.

    Returns the last state and every step's plan (the caller checks whether requests
    are left: a drain that hits ``max_steps`` is not an error here).

    pre: check_state(state)
    pre: max_steps >= 0
    post: len(__return__[1]) <= max_steps and check_state(__return__[0])
    """
    plans: list[StepPlan] = []
    while len(plans) < max_steps and (state.waiting or state.running or state.swapped):
        state, plan = step(state, next_token)
        plans.append(plan)
    return state, tuple(plans)
