"""Liveness: how long it takes, at most, for every live request to finish.

The argument (docs/semantics.md, "Why every accepted request finishes", and the
docstring of ``spec.lifecycle.add_request``) is about the *head* of ``running`` under
``lifo``: it is never preempted, is scheduled first in every step with the whole
budget, and so finishes in a number of steps that depends only on its own progress.
Heads follow one another without a gap, each request is head at most once, and the
bound below adds up how long each live request can be head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec.invariants import check_state  # noqa: F401  (used by the PEP 316 contracts)
from spec.kv import cdiv, chunk_for_prefill
from spec.policies import get_policy
from spec.prefix_cache import grow, longest_hit, num_evictable, request_tokens
from spec.profiles import (
    full_sequence_fits,
    prefill_first,
    running_capped,
    whole_sequence_admissible,
)
from spec.scheduler import TokenOracle, step
from spec.types import (
    PreemptionMode,
    PrefixCacheState,
    RequestState,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)


def head_steps(request: RequestState, budget: int) -> int:
    """Steps a request needs as the head of ``running``, from its current progress.

    As the head it gets ``min(remaining, budget)`` tokens every step
    (``remaining = num_tokens - computed``), so its prefill completes, sampling its
    next output, after ``ceil(remaining / budget)`` steps; every later step is a
    decode that samples one more. It has ``max_tokens - outputs`` outputs to go, so
    it finishes (``length``, or earlier on EOS) within
    ``ceil(remaining / budget) + (max_tokens - outputs - 1)`` steps.

    pre: budget >= 1
    pre: 0 <= request.num_computed_tokens < request.num_tokens
    pre: len(request.output_token_ids) < request.request.params.max_tokens
    post: __return__ >= 1
    """
    remaining = request.num_tokens - request.num_computed_tokens
    to_sample = request.request.params.max_tokens - len(request.output_token_ids)
    return cdiv(remaining, budget) + to_sample - 1


def worst_head_steps(request: RequestState, config: SchedulerConfig) -> int:
    """Steps a request can need as head, whatever happens to it before it gets there.

    Until it is head it may be preempted any number of times, losing its computed
    tokens. Counting pessimistically from ``computed = 0``:

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
    budget = config.max_num_batched_tokens
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
    finishing at ``max_model_len`` only ends a request sooner.

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

    pre: check_state(state)
    post: __return__ >= 0
    """
    bound = lifo_drain_bound(state)
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
        bound += head_steps(state.running[0], config.max_num_batched_tokens)
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
    post: len(__return__[1]) <= max_steps
    post: check_state(__return__[0])
    """
    plans: list[StepPlan] = []
    while len(plans) < max_steps and (state.waiting or state.running or state.swapped):
        state, plan = step(state, next_token)
        plans.append(plan)
    return state, tuple(plans)


# --- progress: no idle wait (docs/semantics.md, "Progress: no request waits idle") -------


@dataclass(frozen=True, slots=True)
class _Left:
    """What a step's first chunks left: budget, free GPU blocks, seats, and the pool.

    ``cache`` is the GPU pool after those chunks with prefix caching on (the free queue
    and keys their touches, reclaims and new keys made), ``None`` with it off; then
    ``free`` is its free queue's length.
    """

    budget: int
    free: int
    seats: int
    cache: PrefixCacheState | None


def _left_after(before: SchedulerState, plan: StepPlan, upto: int) -> _Left:
    """What is left after the first ``upto`` chunks of ``plan``, a step that preempts nothing.

    Every chunk charges its ``n`` computed tokens to the budget and holds
    ``cdiv(start + n, bs)`` blocks. A running request already held ``len(block_ids)``
    of them (``cdiv(start, bs)``); a swapped-in one held none on the GPU; an admitted
    one starts at its hit ``h = k * bs`` (PC4), whose ``k`` blocks exist already. With
    caching on the chunks are replayed on the pool in plan order by PC2-PC5: an
    admission touches its hit (found in the pool as the earlier chunks left it), takes
    its new blocks from the head of the free queue (reclaiming their keys), and keys
    the blocks its chunk fills (by profile: nano-vllm/last-key-wins); a running
    request's growth takes and keys likewise.
    Seats: ``max_num_seqs`` minus ``running`` (R8), or minus this step's admissions
    alone under nano-vllm/seq-limit-per-step.
    """
    config = before.config
    bs = config.block_size
    by_id = {r.request_id: r for r in before.running}
    budget = config.max_num_batched_tokens
    free = before.num_free_gpu_blocks
    cache = before.prefix_cache
    seats = config.max_num_seqs - (len(before.running) if running_capped(config) else 0)
    for chunk in plan.scheduled[:upto]:
        end = chunk.start + chunk.num_tokens
        budget -= chunk.num_tokens
        held = by_id.get(chunk.request_id)
        if held is None:
            seats -= 1
        if cache is None:
            free -= cdiv(end, bs) - (0 if held is None else cdiv(chunk.start, bs))
            continue
        if held is not None:
            tokens = request_tokens(held)
            owned = held.block_ids
        else:
            tokens = request_tokens(_find(before, chunk.request_id))
            owned = longest_hit(cache, tokens, bs)[: chunk.start // bs]
        cache, _ = grow(config, cache, tokens, owned, start=chunk.start, end=end)
        free = len(cache.free_queue)
    return _Left(budget, free, seats, cache)


def _find(before: SchedulerState, request_id: str) -> RequestState:
    return next(r for r in (*before.swapped, *before.waiting) if r.request_id == request_id)


def _hit(request: RequestState, left: _Left, bs: int) -> tuple[int, int]:
    """``request``'s hit in the pool ``left`` (PC3), in blocks, and how many of those
    blocks sit in the free queue (PC4); ``(0, 0)`` with caching off."""
    if left.cache is None:
        return 0, 0
    hit = longest_hit(left.cache, request_tokens(request), bs)
    return len(hit), num_evictable(left.cache, hit)


def _fits(request: RequestState, config: SchedulerConfig, left: _Left, hit: tuple[int, int]) -> int:
    """The chunk ``request`` would get from what is ``left``, or 0 if it does not fit.

    With caching on, a waiting request's chunk starts after its hit in ``left.cache``
    (``hit``, from ``_hit``: the pool as the earlier chunks left it, PC3), only the ``n``
    tokens after the hit are charged to the budget, and it needs its
    ``cdiv(h + n, bs) - k`` new blocks plus the hit blocks that sit in the free queue (PC4).
    """
    if left.seats <= 0 or left.budget <= 0:
        return 0
    bs = config.block_size
    num_hit, evictable = hit
    start = request.num_computed_tokens + num_hit * bs
    n = chunk_for_prefill(request.num_tokens - start, left.budget, config.enable_chunked_prefill)
    need = cdiv(start + n, bs) - num_hit + evictable
    if n > left.budget or need > left.free:
        return 0
    return n


def progress_violations(before: SchedulerState, plan: StepPlan) -> tuple[str, ...]:
    """Rule P: a preempted request never waits in a step that could take it back.

    ``before`` is the state between steps, ``plan`` the step's plan (only its decisions
    are read). In a step that preempts nothing:

    - **swapped**: the first swapped request that did not come back (the one after the
      ``swapped_in`` prefix) does not fit what the running requests and the earlier
      swap-ins left: no seat under ``max_num_seqs``, no budget, or fewer free GPU
      blocks than its chunk needs;
    - **waiting** (which holds recomputed and restarted victims at its front), once
      ``swapped`` is empty after phase B: the first waiting request, in the policy's
      order, that was not admitted does not fit what phases A and B and the earlier
      admissions left, or vllm-v1/full-sequence-admission's gate (with its hit credit),
      nano-vllm/admission-tests-len-seq's or the policy's gate refuses it.

    **With prefix caching on** (no swap then), "fits" is PC4's test on the pool *as the
    step's earlier chunks left it*, not as it was at the step's start: the head's hit
    is its longest cached prefix in that pool (earlier growth and admissions may have
    reclaimed blocks it would have hit at the start, or keyed blocks it hits only now,
    e.g. an identical prompt admitted just before it); its chunk starts after the hit
    and only its ``n`` computed tokens are charged to the budget; and it needs
    ``cdiv(h + n, bs) - k`` new blocks plus its hit blocks that sit in the free queue,
    out of that pool's free queue. This is exactly the test phase C applies to it, on
    the pool phase C saw, so the derivation below is unchanged.

    **nano-vllm/prefill-first**: phase C runs first, on the whole budget, every free
    block and ``max_num_seqs`` seats of its own (seq-limit-per-step); a step that
    admitted nobody is a decode step. So under nano-vllm the waiting half is judged
    against what this step's admissions alone left (all of a prefill step's chunks,
    none of a decode step's), and a preempting step is judged too: its preemptions
    came after phase C, which admitted nobody although the head might have fitted the
    whole pool. (The profile has no swap, so its swapped half never applies.)

    A step that preempts takes nothing back (anti-thrash, R7/R8) and is not judged
    (except under nano-vllm, above).
    Derivation of the wait bound: R5-R8 decide the chunks of a step in the order
    running, swapped, waiting (nano-vllm: waiting first), each phase head-of-line on
    what the previous left; a victim is only ever behind requests that came before it,
    so the head of ``swapped`` (and of ``waiting`` in policy order, once ``swapped`` is
    empty) waits **zero** steps in which it fits. Combined with ``drain_step_bound``
    (some request always progresses) this bounds every victim's wait, and it rules out
    the starvation ``drain_step_bound`` cannot see: swapped requests that come back only
    when nothing else runs still drain within the bound (step 3 of its derivation).

    ``plan`` must be a plan of a step from ``before`` (no contract for CrossHair: an
    arbitrary plan names requests ``before`` lacks).
    """
    config = before.config
    nano = prefill_first(config)
    if plan.preempted and not nano:
        return ()
    num_back = len(plan.swapped_in)
    running = {r.request_id for r in before.running}
    num_running = sum(1 for rid in plan.scheduled_ids if rid in running)
    if num_back < len(before.swapped):
        head = before.swapped[num_back]
        left = _left_after(before, plan, num_running + num_back)
        n = _fits(head, config, left, _hit(head, left, config.block_size))
        if n:
            return (
                f"progress: swapped {head.request_id!r} waits, but a chunk of {n} tokens "
                f"fits what step {before.num_steps} left",
            )
        return ()
    admitted = set(plan.scheduled_ids) - running
    # nano-vllm: phase C came first, so only the admissions (if any) came before.
    upto = len(admitted) if nano else len(plan.scheduled)
    policy = get_policy(config.policy)
    for request in policy.order_waiting(before.waiting):
        if request.request_id in admitted:
            continue
        left = _left_after(before, plan, upto)
        num_hit, evictable = hit = _hit(request, left, config.block_size)
        n = _fits(request, config, left, hit)
        if (
            n
            and full_sequence_fits(
                config, request, left.free, num_hit=num_hit, num_evictable=evictable
            )
            and whole_sequence_admissible(config, request, left.budget, left.free)
            and policy.can_admit(_view(before, plan, upto, left), request, n)
        ):
            return (
                f"progress: waiting {request.request_id!r} waits, but a chunk of {n} tokens "
                f"fits what step {before.num_steps} left",
            )
        break
    return ()


def _view(before: SchedulerState, plan: StepPlan, upto: int, left: _Left) -> SchedulerState:
    """The mid-step state the admission gate sees after ``plan``'s first ``upto`` chunks."""
    by_id = {r.request_id: r for r in (*before.running, *before.swapped, *before.waiting)}
    was_running = {r.request_id for r in before.running}
    running = (
        *before.running,
        *(by_id[c.request_id] for c in plan.scheduled[:upto] if c.request_id not in was_running),
    )
    taken = {r.request_id for r in running}
    return replace(
        before,
        running=running,
        swapped=(),
        waiting=tuple(r for r in before.waiting if r.request_id not in taken),
        num_free_gpu_blocks=left.free,
        prefix_cache=left.cache,
    )
