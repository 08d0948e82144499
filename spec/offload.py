"""Schedule first, offload the starved after: transformers' continuous batching step (T2-T9).

Under **transformers/offload-starved** (``spec.profiles.offloads_starved``) phases A-C
are one walk and a preemption pass after it, as transformers 5.19.0's
``ContinuousBatchProcessor.prepare_next_batch`` runs them
(``generation/continuous_batching/continuous_api.py:482-536``):

1. **walk** the candidates: the running requests (transformers takes the decoding ones
   first, which is their order: ``spec.profiles``), then, unless admission is frozen
   (transformers/admission-frozen), the swapped (CPU-offloaded) and waiting requests
   interleaved (transformers/offloaded-interleaved). Each gets ``n = min(num_tokens -
   computed, budget)`` tokens if the blocks of its chunk are free; one that does not
   fit is **skipped**, not a stop (transformers/skip-not-fit), and a running one is
   recorded as starved. Outside the safety margin, once one candidate is scheduled the
   walk stops at the first that is not decoding (transformers/safety-margin). The walk
   stops when the budget is spent or ``max_num_seqs`` requests are scheduled
   (transformers/seq-limit-per-step: a step's count, not ``running``'s);
2. if the walk scheduled nothing and something did not fit, **offload** starved
   requests and walk again (``continuous_api.py:506-513``);
3. if starved requests remain beside a scheduled batch, **offload** so that they fit
   next step (``:519-520``);
4. the swapped requests scheduled in the step give their CPU blocks back (their K/V is
   copied in after the offloads, ``:523``, ``offloading_manager.py:244-266``).

An offload (transformers/offload-starved) takes the starved from the newest
(``spec.profiles.num_offloaded``), frees their GPU blocks, swaps each to the CPU pool if
its blocks fit there and soft-resets it otherwise (a recompute: outputs kept, prompt and
outputs prefilled again), requeues the victims at the **tail**, oldest first
(transformers/victims-at-tail), and freezes admission until a request finishes.

Every function is pure. The step's plan lists the chunks in walk order, the victims in
the order they were taken, the swapped-in requests in walk order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec.invariants import (
    check_state,  # noqa: F401  (used by the PEP 316 contracts)
    kv_conserved_mid_step,
    live_ids_sorted,
)
from spec.kv import blocks_held
from spec.profiles import (
    admission_frozen_after,
    in_safety_margin,
    interleave_offloaded,
    num_offloaded,
    skips_unfit,
)
from spec.scheduler import release_victim
from spec.types import (
    Preemption,
    PreemptionMode,
    RequestState,
    ScheduledChunk,
    SchedulerState,
    StepPlan,
)


@dataclass(frozen=True, slots=True)
class Walk:
    """One walk over the candidates: the mid-step state (admitted requests at the tail
    of ``running``, their blocks taken), the chunks, the swapped-in ids, and the starved
    running requests with the chunk each was refused, in walk order."""

    state: SchedulerState
    chunks: tuple[ScheduledChunk, ...]
    swapped_in: tuple[str, ...]
    starved: tuple[tuple[str, int], ...]
    failed: bool  # some candidate did not fit (``one_allocation_failed``)


def candidates(state: SchedulerState) -> tuple[tuple[RequestState, str], ...]:
    """T8, T9: who the walk considers, in order, each with the queue it is in.

    Admission is frozen only while a request runs: transformers keeps it frozen when the
    last running request is aborted, and then serves nothing ever again (docs/peers.md
    T10, a bug in the peer the profile does not copy).

    post: len(__return__) <= len(state.running) + len(state.swapped) + len(state.waiting)
    """
    running = tuple((r, "running") for r in state.running)
    if state.admission_frozen and state.running:
        return running
    swapped_ids = {r.request_id for r in state.swapped}
    return (
        *running,
        *(
            (r, "swapped" if r.request_id in swapped_ids else "waiting")
            for r in interleave_offloaded(state.swapped, state.waiting)
        ),
    )


def walk_within_limits(state: SchedulerState, walk: Walk) -> bool:
    """What one walk may schedule: at most ``max_num_seqs`` chunks and the budget's
    tokens, and never more blocks than are free."""
    return (
        len(walk.chunks) <= state.config.max_num_seqs
        and sum(c.num_tokens for c in walk.chunks) <= state.config.max_num_batched_tokens
        and walk.state.num_free_gpu_blocks >= 0
    )


def walk(state: SchedulerState) -> Walk:
    """Step 1: schedule the candidates that fit, skip the rest (T2-T4, T8).

    ``FIFOScheduler._process_candidates`` (``scheduler.py:196-280``): the margin is
    judged once, before the walk; a candidate's chunk is ``min(num_tokens - computed,
    budget)``; it needs the blocks that cover ``computed + n`` tokens beyond those it
    holds (a swapped or waiting request holds none on the GPU); the walk ends when the
    budget is 0 or ``max_num_seqs`` requests are scheduled.

    pre: state.num_free_gpu_blocks >= 0
    post: walk_within_limits(state, __return__)
    """
    config = state.config
    bs = config.block_size
    free = state.num_free_gpu_blocks
    margin = in_safety_margin(config, free)
    budget = config.max_num_batched_tokens
    running = list(state.running)
    chunks: list[ScheduledChunk] = []
    swapped_in: list[str] = []
    starved: list[tuple[str, int]] = []
    moved: set[str] = set()
    failed = False
    for request, queue in candidates(state):
        if not margin and chunks and not request.decoding:
            break
        computed = request.num_computed_tokens
        n = min(request.num_tokens - computed, budget)
        held = blocks_held(computed, bs) if queue == "running" else 0
        need = blocks_held(computed + n, bs) - held
        if need > free:  # a running one is starved; T2: a waiting one skipped
            failed = True
            if queue == "running":
                starved.append((request.request_id, n))
                continue
            if skips_unfit(config):
                continue
            break
        free -= need
        budget -= n
        chunks.append(ScheduledChunk(request_id=request.request_id, start=computed, num_tokens=n))
        if queue != "running":
            running.append(request)
            moved.add(request.request_id)
            if queue == "swapped":
                swapped_in.append(request.request_id)
        if budget == 0 or len(chunks) == config.max_num_seqs:
            break
    new_state = replace(
        state,
        running=tuple(running),
        waiting=tuple(r for r in state.waiting if r.request_id not in moved),
        swapped=tuple(r for r in state.swapped if r.request_id not in moved),
        num_free_gpu_blocks=free,
    )
    return Walk(new_state, tuple(chunks), tuple(swapped_in), tuple(starved), failed)


def offloads_freeze(
    starved: tuple[tuple[str, int], ...], result: tuple[SchedulerState, tuple[Preemption, ...]]
) -> bool:
    """The victims are the newest of the starved, newest first (T5: which requests move),
    and an offload freezes admission (T9)."""
    state, victims = result
    newest = [rid for rid, _ in reversed(starved)]
    return [v.request_id for v in victims] == newest[: len(victims)] and (
        victims == () or state.admission_frozen
    )


def newest_starved(requests: list[RequestState], count: int) -> list[RequestState]:
    """T5: the last ``count`` of the starved ``requests`` (in walk order), newest first
    (``offload_requests`` pops them from the end of its list).

    pre: 0 <= count <= len(requests)
    post: len(__return__) == count
    """
    return requests[len(requests) - count :][::-1]


def offload(
    state: SchedulerState, starved: tuple[tuple[str, int], ...]
) -> tuple[SchedulerState, tuple[Preemption, ...]]:
    """Steps 2-3: offload the last ``num_offloaded`` starved requests (T5-T7, T9).

    ``OffloadingManager.offload_requests`` (``offloading_manager.py:156-242``): the
    victims leave ``running`` and free their GPU blocks; then, newest first, each is
    swapped if the blocks it held fit the free CPU blocks (``_offload_to_cpu``, ``:345-393``)
    and soft reset otherwise (``create_equivalent_initial_request``,
    ``requests.py:329-352``: the spec's recompute, outputs kept); they are requeued at the
    tail of their queue oldest first (``:208-234``), not decoding, and admission freezes.
    With no victim nothing changes.

    pre: all(any(r.request_id == rid for r in state.running) for rid, _ in starved)
    pre: all(n >= 1 for _, n in starved)
    post: offloads_freeze(starved, __return__)
    """
    config = state.config
    bs = config.block_size
    by_id = {r.request_id: r for r in state.running}
    requests = [by_id[rid] for rid, _ in starved]
    needs = [
        blocks_held(r.num_computed_tokens + n, bs) - blocks_held(r.num_computed_tokens, bs)
        for r, (_, n) in zip(requests, starved, strict=True)
    ]
    held = [blocks_held(r.num_computed_tokens, bs) for r in requests]
    count = num_offloaded(needs, held, state.num_free_gpu_blocks, len(state.running))
    if count == 0:
        return state, ()
    victims = newest_starved(requests, count)
    gone = {v.request_id for v in victims}
    others = tuple(r for r in state.running if r.request_id not in gone)
    free = state.num_free_gpu_blocks
    free_cpu = state.num_free_cpu_blocks
    preempted: list[Preemption] = []
    requeued: list[tuple[RequestState, PreemptionMode]] = []
    for victim in victims:
        after, mode, free, free_cpu, _ = release_victim(
            victim, victim.num_computed_tokens, config, free=free, free_cpu=free_cpu
        )
        preempted.append(Preemption(request_id=victim.request_id, mode=mode))
        requeued.append((replace(after, decoding=False), mode))
    requeued.reverse()  # T7: oldest first, at the tail
    swap = PreemptionMode.SWAP
    return replace(
        state,
        running=others,
        waiting=(*state.waiting, *(r for r, mode in requeued if mode is not swap)),
        swapped=(*state.swapped, *(r for r, mode in requeued if mode is swap)),
        num_free_gpu_blocks=free,
        num_free_cpu_blocks=free_cpu,
        admission_frozen=admission_frozen_after(state.admission_frozen, True, False),
    ), tuple(preempted)


def offloading_planned(state: SchedulerState, result: tuple[SchedulerState, StepPlan]) -> bool:
    """The plan is this step's, samples nothing yet, and preempts each victim once; an
    offload freezes admission (T9); blocks are conserved on both pools with every chunk
    holding its blocks, and no request is lost. (The conservation test, with the most
    branches, comes last: CrossHair explores a predicate's branches as paths too.)"""
    after, plan = result
    victims = [p.request_id for p in plan.preempted]
    return (
        plan.step == state.num_steps
        and plan.sampled == ()
        and len(set(victims)) == len(victims)
        and (not victims or after.admission_frozen)
        and live_ids_sorted(after) == live_ids_sorted(state)
        and kv_conserved_mid_step(after, plan.scheduled)
    )


def schedule_offloading(state: SchedulerState) -> tuple[SchedulerState, StepPlan]:
    """Phases A-C under transformers/offload-starved: walk, offload, walk again (T2-T9).

    Returns the mid-step state and the plan, as ``spec.scheduler.schedule`` does. If a
    walk schedules nothing although something did not fit, the starved are offloaded and
    the walk repeats; transformers raises ``RuntimeError("No requests can be scheduled
    and no requests can be offloaded.")`` when no victim can be taken then
    (``continuous_api.py:506-509``), which R4 makes unreachable: a lone running request
    always fits, and with nothing running all blocks are free for any accepted request.

    pre: check_state(state)
    post: offloading_planned(state, __return__)
    """
    preempted: tuple[Preemption, ...] = ()
    current = walk(state)
    while not current.chunks and current.failed:
        state, victims = offload(state, current.starved)
        if not victims:
            break
        preempted += victims
        current = walk(state)
    mid = current.state
    if current.starved:
        mid, victims = offload(mid, current.starved)
        preempted += victims
    if current.swapped_in:  # step 4: their CPU blocks come free after the offloads
        bs = state.config.block_size
        back = sum(
            blocks_held(r.num_computed_tokens, bs)
            for r in mid.running
            if r.request_id in current.swapped_in
        )
        mid = replace(mid, num_free_cpu_blocks=mid.num_free_cpu_blocks + back)
    plan = StepPlan.of(
        step=state.num_steps,
        scheduled=current.chunks,
        preempted=preempted,
        swapped_in=current.swapped_in,
    )
    return mid, plan


__all__ = ["Walk", "candidates", "newest_starved", "offload", "schedule_offloading", "walk"]
