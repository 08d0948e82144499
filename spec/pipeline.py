"""Async scheduling (**vllm-v1/async-***): step N+1 is scheduled before step N's
sampled tokens are applied, as vLLM 0.32's ``AsyncScheduler`` does when
``EngineCore.step_with_batch_queue`` drives it (docs/semantics.md, "Async scheduling";
paths under vLLM 0.32.0's ``vllm/``).

A step under async scheduling is ``schedule`` (phases A-C, reading placeholders), then
``complete_async_step``: the step just scheduled **advances** (its chunks computed, a
placeholder for each token it will sample) and joins the steps in flight; then, if the
batch queue is full or nothing else is left to schedule, the oldest step in flight is
**applied** (its tokens appended, requests finished), which is the only time outputs
change. The rules, each where it acts:

- **vllm-v1/async-batch-queue** (``v1/engine/core.py:698-800``): a queue of two. A step
  schedules only while ``has_requests`` (``spec.lifecycle``); the step just scheduled
  is applied at once only if the queue is then full (two in flight) or it scheduled
  nothing and nothing is live; a step that schedules nothing still enters the queue.
  Between steps at most one step is in flight (``SchedulerState.in_flight``), and the
  run ends when the queue is empty.
- **vllm-v1/async-placeholders** (``v1/core/sched/async_scheduler.py:25-58``,
  ``scheduler.py:1625-1640``): scheduling a chunk advances ``num_computed_tokens`` and
  ``num_in_flight_tokens`` by it at once, and a chunk that samples adds one
  placeholder; phase A then schedules a running request on top of its placeholders
  (``spec.profiles.num_tokens_with_placeholders``).
- **vllm-v1/async-max-tokens**: phase A walks past a request whose step in flight
  already ends it by length (``spec.profiles.in_flight_reaches_the_end``).
- **vllm-v1/async-commit** (``async_scheduler.py:60-78``, ``scheduler.py:2493-2510``):
  applying a step appends each sampled token, takes a placeholder off, runs R10's stop
  checks on the tokens applied, and (prefix caching) keys the blocks filled up to
  ``computed - placeholders``, the tokens now known: a placeholder's slot is never keyed.
- **vllm-v1/async-stale-output** (``scheduler.py:1571-1616, 2080-2087, 934-939``): a
  request preempted with a step in flight keeps nothing of it but a count of stale
  tokens; that step's token is still **delivered** to the waiting request (appended,
  stop checks run, no placeholder taken, nothing keyed), and phase C walks past it
  until then (``spec.profiles.stale_output_in_flight``). A delivered stop finishes it
  from ``waiting``.
- **vllm-v1/async-discard** (``scheduler.py:2088-2097``): the output of a request that
  finished or was aborted since its step was scheduled is dropped.
- **vllm-v1/async-free**: blocks are freed at once, at preemption, finish or abort
  (vLLM defers the free only for a KV-consumer connector, ``scheduler.py:186-192``);
  the step in flight that still writes a freed block is the engine's concern (stream
  order in vLLM), not the pool's.

The ``kvsched`` profile and the other peers' profiles have no async scheduling
(``SchedulerConfig`` refuses it): their engines apply each step's outputs before the
next step is scheduled. Our engine runs these rules under ``vllm-v1`` in its own code
(``impl/pipeline.py``), its forward in a worker thread while the next step is scheduled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from spec.invariants import check_state, live_ids_sorted
from spec.lifecycle import has_requests
from spec.prefix_cache import give_keys, holders, release_blocks, request_tokens
from spec.profiles import gpu_blocks_owned, length_capped
from spec.scheduler import (
    _sampled_into,
    plan_matches,  # noqa: F401  (used by the PEP 316 contracts)
)
from spec.types import (
    FinishedRequest,
    InFlightBatch,
    PrefixCacheState,
    RequestState,
    SampledTokensError,
    SchedulerState,
    StepPlan,
)


def scheduled_now(state_mid: SchedulerState, plan: StepPlan) -> bool:
    """Whether ``schedule`` ran for ``plan`` (it queued it; ``spec.scheduler.queued``).

    post: not __return__ or state_mid.in_flight[-1].step == plan.step
    """
    return bool(state_mid.in_flight) and state_mid.in_flight[-1].step == plan.step


def pops_oldest(queued_now: bool, queue_len: int, scheduled_any: bool, live: bool) -> bool:
    """**vllm-v1/async-batch-queue**: whether a step applies the oldest step in flight,
    given whether it scheduled (``queued_now``), the queue's length after that, whether
    it scheduled any chunk and whether a request is live: unless it scheduled and left
    the queue with room while it scheduled something or a request is live
    (``v1/engine/core.py:758-766``); and never with the queue empty (``:768-772``).

    post: not __return__ or queue_len >= 1
    """
    if queued_now and queue_len < 2 and (scheduled_any or live):
        return False
    return queue_len >= 1


def applied_batch(state_mid: SchedulerState, plan: StepPlan) -> InFlightBatch | None:
    """The step whose outputs this step applies (``pops_oldest``), if any.

    post: __return__ is None or __return__ == state_mid.in_flight[0]
    """
    live = bool(state_mid.waiting or state_mid.running or state_mid.swapped)
    queue = state_mid.in_flight
    if pops_oldest(scheduled_now(state_mid, plan), len(queue), bool(plan.scheduled), live):
        return queue[0]
    return None


def applied_from(before: SchedulerState, plan: StepPlan) -> InFlightBatch | None:
    """``applied_batch`` read from the state ``before`` the step (for ``spec.invariants``).
    The batch ``schedule`` queued stands in empty: it is applied in its own step only if
    it scheduled nothing.

    post: __return__ is None or __return__.step <= plan.step
    """
    live = bool(before.waiting or before.running or before.swapped)
    queued_now = has_requests(before)
    queue = before.in_flight
    if queued_now:
        queue = (*queue, InFlightBatch(step=plan.step, scheduled=(), sampling_ids=(), arrivals=()))
    if pops_oldest(queued_now, len(queue), bool(plan.scheduled), live):
        return queue[0]
    return None


def live_sampling_ids(batch: InFlightBatch, state: SchedulerState) -> tuple[str, ...]:
    """The requests of ``batch`` that sampled and are still live in ``state`` (the same
    request: id and arrival), in its order; vllm-v1/async-discard drops the others.

    pre: len(batch.arrivals) == len(batch.scheduled)
    post: len(__return__) == len(set(__return__))
    """
    live = {(r.request_id, r.request.arrival) for r in (*state.running, *state.waiting)}
    sampling = set(batch.sampling_ids)
    return tuple(
        c.request_id
        for c, arrival in zip(batch.scheduled, batch.arrivals, strict=True)
        if c.request_id in sampling and (c.request_id, arrival) in live
    )


def applied_sampling_ids(state_mid: SchedulerState, plan: StepPlan) -> tuple[str, ...]:
    """The requests whose tokens this step applies: ``live_sampling_ids`` of
    ``applied_batch``.

    post: len(__return__) == len(set(__return__))
    """
    batch = applied_batch(state_mid, plan)
    return () if batch is None else live_sampling_ids(batch, state_mid)


def advanced(state_mid: SchedulerState, plan: StepPlan, after: SchedulerState) -> bool:
    """``advance``'s contract: nothing changed if ``schedule`` did not run; else each
    scheduled request's computed and in-flight counts grew by its chunk and its
    placeholders by one if it samples, outputs untouched, and the queues, pools and step
    count are as they were."""
    if not scheduled_now(state_mid, plan):
        return after == state_mid
    before = {r.request_id: r for r in state_mid.running}
    sampling = state_mid.in_flight[-1].sampling_ids
    grew = all(
        (r.num_computed_tokens, r.num_in_flight_tokens, r.num_output_placeholders)
        == (
            c.start + c.num_tokens,
            before[c.request_id].num_in_flight_tokens + c.num_tokens,
            before[c.request_id].num_output_placeholders + (c.request_id in sampling),
        )
        and r.output_token_ids == before[c.request_id].output_token_ids
        for c in plan.scheduled
        for r in after.running
        if r.request_id == c.request_id
    )
    return (
        grew
        and live_ids_sorted(after) == live_ids_sorted(state_mid)
        and after.num_free_gpu_blocks == state_mid.num_free_gpu_blocks
        and after.in_flight == state_mid.in_flight
    )


def advance(state_mid: SchedulerState, plan: StepPlan) -> SchedulerState:
    """**vllm-v1/async-placeholders**: the step just scheduled (if ``schedule`` ran) is on
    its way; each chunk ``(r, start, n)`` makes ``computed = start + n`` and ``in_flight +=
    n``, and one placeholder more if it samples (``queued`` recorded which).

    pre: plan_matches(state_mid, plan)
    post: advanced(state_mid, plan, __return__)
    """
    if not scheduled_now(state_mid, plan):
        return state_mid
    batch = state_mid.in_flight[-1]
    chunks = {c.request_id: c for c in plan.scheduled}
    sampling = set(batch.sampling_ids)

    def moved(r: RequestState) -> RequestState:
        chunk = chunks.get(r.request_id)
        if chunk is None:
            return r
        return replace(
            r,
            num_computed_tokens=chunk.start + chunk.num_tokens,
            num_in_flight_tokens=r.num_in_flight_tokens + chunk.num_tokens,
            num_output_placeholders=r.num_output_placeholders + (r.request_id in sampling),
        )

    return replace(state_mid, running=tuple(moved(r) for r in state_mid.running))


def _delivered(
    state: SchedulerState, request: RequestState, token: int, stale: bool
) -> tuple[RequestState, FinishedRequest | None]:
    """vllm-v1/async-commit (a stale delivery: vllm-v1/async-stale-output): ``token``
    appended, a placeholder taken off unless stale; the report if R10 stops it."""
    outputs, done = _sampled_into(state.config, request, token)
    after = replace(
        request,
        output_token_ids=outputs,
        num_output_placeholders=request.num_output_placeholders - (not stale),
    )
    return after, done


def _keyed(
    state: SchedulerState, request: RequestState, cache: PrefixCacheState
) -> PrefixCacheState:
    """vllm-v1/async-commit, PC2: the running request's blocks full of known tokens get
    their keys (``cache_blocks(request, computed - placeholders)``)."""
    known = request.num_computed_tokens - request.num_output_placeholders
    return give_keys(
        cache, request_tokens(request), request.block_ids, known, state.config.block_size
    )


def _apply_outputs(
    state: SchedulerState, batch: InFlightBatch, tokens: Mapping[str, int]
) -> tuple[SchedulerState, tuple[str, ...], tuple[int, ...], tuple[FinishedRequest, ...]]:
    """Apply ``batch``'s outputs (vllm-v1/async-commit, -stale-output, -discard, -free):
    the state after, and what was sampled and finished, in the batch's order.

    For each chunk ``(r, n)``: a request no longer live is skipped (its output dropped);
    else ``in_flight -= n``, and if it has stale tokens the output is stale and ``stale
    -= n``. If it sampled, its token is delivered (``_delivered``); a running request's
    filled blocks get their keys; a stopped request leaves its queue, a running one
    freeing its ``cdiv(computed, bs)`` blocks (PC6 with prefix caching), and is
    reported. ``tokens`` maps exactly ``applied_sampling_ids``' requests. ``batch`` is
    ``state.in_flight[0]``.
    """
    running = list(state.running)
    waiting = list(state.waiting)
    cache = state.prefix_cache
    free = state.num_free_gpu_blocks
    sampled_ids: list[str] = []
    sampled_tokens: list[int] = []
    finished: list[FinishedRequest] = []
    sampling = set(batch.sampling_ids)
    for chunk, arrival in zip(batch.scheduled, batch.arrivals, strict=True):
        rid = chunk.request_id
        found = next(
            (
                (queue, i)
                for queue in (running, waiting)
                for i, r in enumerate(queue)
                if (r.request_id, r.request.arrival) == (rid, arrival)
            ),
            None,
        )
        if found is None:
            continue  # vllm-v1/async-discard
        queue, index = found
        request = queue[index]
        stale = request.num_stale_output_tokens > 0
        request = replace(
            request,
            num_in_flight_tokens=request.num_in_flight_tokens - chunk.num_tokens,
            num_stale_output_tokens=request.num_stale_output_tokens
            - (chunk.num_tokens if stale else 0),
        )
        done: FinishedRequest | None = None
        if rid in sampling:
            token = tokens[rid]
            request, done = _delivered(state, request, token, stale)
            sampled_ids.append(rid)
            sampled_tokens.append(token)
            if cache is not None and queue is running:
                cache = _keyed(state, request, cache)
        if done is None:
            queue[index] = request
            continue
        del queue[index]
        finished.append(done)
        if queue is running:
            if cache is not None:
                cache = release_blocks(
                    state.config, cache, request.block_ids, holders(tuple(running))
                )
                free = len(cache.free_queue)
            else:
                free += gpu_blocks_owned(state.config, request, request.num_computed_tokens)
    after = replace(
        state,
        running=tuple(running),
        waiting=tuple(waiting),
        num_free_gpu_blocks=free,
        prefix_cache=cache,
        in_flight=state.in_flight[1:],
        has_finished_requests=state.has_finished_requests or bool(finished),
    )
    return after, tuple(sampled_ids), tuple(sampled_tokens), tuple(finished)


def async_step_completed(
    state_mid: SchedulerState,
    plan: StepPlan,
    tokens: Mapping[str, int],
    after: SchedulerState,
    done: StepPlan,
) -> bool:
    """``complete_async_step``'s contract: ``after`` valid (every invariant: R2 with the
    placeholders, the counters in flight); one step more; the decisions kept; one token
    per applied sampling request; the queue holds at most one step; no live request left
    with ``max_tokens`` outputs (R10); GPU blocks only freed; no request appears or is
    lost but those reported finished."""
    gone = {f.request_id for f in done.finished}
    return (
        check_state(after)
        and after.num_steps == state_mid.num_steps + 1
        and (done.scheduled, done.preempted) == (plan.scheduled, plan.preempted)
        and done.sampled_ids == applied_sampling_ids(state_mid, plan)
        and len(done.sampled_ids) == len(tokens)
        and len(after.in_flight) <= 1
        and all(
            not length_capped(
                after.config, r.num_tokens, len(r.output_token_ids), r.request.params.max_tokens
            )
            for r in (*after.running, *after.waiting)
            if r.output_token_ids
        )
        and after.num_free_gpu_blocks >= state_mid.num_free_gpu_blocks
        and live_ids_sorted(after) == sorted(set(live_ids_sorted(state_mid)) - gone)
    )


def complete_async_step(
    state_mid: SchedulerState, plan: StepPlan, tokens: Mapping[str, int]
) -> tuple[SchedulerState, StepPlan]:
    """The rest of an async step after ``schedule``: ``advance`` the step just scheduled
    (if ``schedule`` ran), then apply ``applied_batch``'s outputs (if any) with
    ``tokens``, which must map exactly ``applied_sampling_ids`` (else
    ``SampledTokensError``, nothing changes). The plan returned has this step's
    decisions and the applied step's ``sampled`` and ``finished``.

    pre: state_mid.config.async_scheduling and plan_matches(state_mid, plan)
    post: async_step_completed(state_mid, plan, tokens, *__return__)
    raises: SampledTokensError
    """
    expected = applied_sampling_ids(state_mid, plan)
    if set(tokens) != set(expected):
        raise SampledTokensError(
            f"step {plan.step}: tokens for {sorted(tokens)} but the applied step's sampling "
            f"requests are {sorted(expected)}"
        )
    batch = applied_batch(state_mid, plan)
    state = replace(advance(state_mid, plan), num_steps=state_mid.num_steps + 1)
    if batch is None:
        return state, plan
    state, sampled_ids, sampled_tokens, finished = _apply_outputs(state, batch, tokens)
    return state, replace(
        plan, sampled_ids=sampled_ids, sampled_token_ids=sampled_tokens, finished=finished
    )
