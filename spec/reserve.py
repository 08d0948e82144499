"""Reserve the whole generation, prefill first: TokenSpeed's plan (TS1-TS6).

Under the ``tokenspeed`` profile (``spec.profiles.reserves_generation``) phases A-C are
TokenSpeed's ``buildFusedPlan`` with the prefix cache off and prefill and decode in
separate plans (tokenspeed-scheduler 0.1.42; ``scheduleLocalPrefillWork``,
``scheduleDecodeBatch`` in lightseekorg/tokenspeed
``tokenspeed-scheduler/csrc/scheduler/operations/forward.cpp``). Everything is taken
in submission order, which is ``running``'s order here (tokenspeed/submission-order):

1. the running requests still prefilling get their next chunk, ``min(rest,
   budget)``; a chunk that leaves its prefill incomplete ends the prefill work
   (tokenspeed/head-of-line-chunk);
2. then waiting requests are admitted while fewer than ``max_num_seqs`` run and
   budget is left: each reserves the blocks of its whole generation
   (tokenspeed/reserve-generation), is skipped if they are not free
   (tokenspeed/skip-not-fit), and gets a first chunk; an incomplete one ends the
   prefill work as in 1;
3. only if 1 and 2 scheduled nothing, the running requests that have sampled decode,
   one token each, while budget is left (tokenspeed/prefill-first).

Nothing is preempted: a request never needs a block beyond its reserve, and one that
could never fit alone is refused when it is added (tokenspeed/submit-refusal).
Every function is pure.
"""

from __future__ import annotations

from dataclasses import replace

from spec.invariants import (
    check_state,  # noqa: F401  (used by the PEP 316 contracts)
    kv_conserved_mid_step,
    live_ids_sorted,
)
from spec.profiles import generation_blocks, skips_unfit, submission_order
from spec.types import RequestState, ScheduledChunk, SchedulerState, StepPlan


def reserving_planned(state: SchedulerState, result: tuple[SchedulerState, StepPlan]) -> bool:
    """The plan is this step's, within the budget, preempts and swaps nothing; blocks are
    conserved with every admitted request holding its reserve and no request is lost; and
    (tokenspeed/prefill-first) a plan with a prefill chunk decodes no request."""
    after, plan = result
    decoding = {r.request_id for r in state.running if r.decoding}
    decodes = [rid for rid in plan.scheduled_ids if rid in decoding]
    return (
        plan.step == state.num_steps
        and plan.preempted == ()
        and plan.swapped_in == ()
        and sum(plan.num_scheduled_tokens) <= state.config.max_num_batched_tokens
        and (not decodes or len(decodes) == len(plan.scheduled))
        and live_ids_sorted(after) == live_ids_sorted(state)
        and kv_conserved_mid_step(after, plan.scheduled)
    )


def schedule_reserving(state: SchedulerState) -> tuple[SchedulerState, StepPlan]:
    """Phases A-C under the tokenspeed profile (TS1-TS6).

    Returns the mid-step state and the plan, as ``spec.scheduler.schedule`` does.

    pre: check_state(state)
    post: reserving_planned(state, __return__)
    """
    config = state.config
    budget = config.max_num_batched_tokens
    free = state.num_free_gpu_blocks
    chunks: list[ScheduledChunk] = []
    blocked = False  # an incomplete chunk holds the head of the line (TS4)
    for request in state.running:
        if request.decoding or budget == 0:
            continue
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        chunks.append(_chunk(request, n))
        budget -= n
        if n < request.num_tokens - request.num_computed_tokens:
            blocked = True
            break
    admitted: list[RequestState] = []
    for request in () if blocked else state.waiting:
        if len(state.running) + len(admitted) >= config.max_num_seqs or budget == 0:
            break
        need = generation_blocks(config, request)
        if need > free:  # TS5: skipped
            if skips_unfit(config):
                continue
            break
        n = min(request.num_tokens, budget)
        free -= need
        budget -= n
        admitted.append(request)
        chunks.append(_chunk(request, n))
        if n < request.num_tokens:
            break
    if not chunks:  # TS3: a decode plan
        for request in state.running:
            if budget == 0:
                break
            if request.decoding:
                chunks.append(_chunk(request, 1))
                budget -= 1
    joined = {r.request_id for r in admitted}
    mid = replace(
        state,
        running=submission_order((*state.running, *admitted)),  # TS6
        waiting=tuple(r for r in state.waiting if r.request_id not in joined),
        num_free_gpu_blocks=free,
        ids_held=(),  # TS8: the plan erases the requests finished in the last step
    )
    return mid, StepPlan.of(step=state.num_steps, scheduled=chunks)


def _chunk(request: RequestState, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request.request_id, start=request.num_computed_tokens, num_tokens=num_tokens
    )


__all__ = ["schedule_reserving"]
