"""Rule P, progress: no preempted request waits in a step that could take it back.

A predicate over a state between steps and the plan of its step, with its own fit
arithmetic (it does not call the phases: that independence is what lets it catch a
bug the phases and the engine share). ``spec.scheduler.step``'s contract states it,
and ``spec.liveness`` builds the wait bound on it (docs/semantics.md, "Progress: no
request waits idle").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec.kv import chunk_for_prefill
from spec.policies import get_policy
from spec.prefix_cache import grow, longest_hit, num_evictable, request_tokens
from spec.profiles import (
    admits_after_swap_in,
    admits_first,
    capped,
    chunk_blocks,
    full_sequence_fits,
    liveness_proved,
    long_prefill_cap,
    reserved_blocks,
    running_capped,
    speculative,
    stale_output_in_flight,
    whole_sequence_admissible,
)
from spec.speculative import pads
from spec.types import PrefixCacheState, RequestState, SchedulerConfig, SchedulerState, StepPlan


@dataclass(frozen=True, slots=True)
class _Left:
    """What a step's first chunks left: budget, free GPU blocks, seats, and the pool;
    and the step's ``cap`` on a chunk (vllm-v1/long-prefill-cap, 0: none).

    ``cache`` is the GPU pool after those chunks with prefix caching on (the free queue
    and keys their touches, reclaims and new keys made), ``None`` with it off; then
    ``free`` is its free queue's length.
    """

    budget: int
    free: int
    seats: int
    cache: PrefixCacheState | None
    cap: int
    #: vllm-v1/spec-padded-new-decode reads them: a running request's chunk among those
    #: chunks, and one of a request mid-prefill.
    running_scheduled: bool = False
    prefill_scheduled: bool = False


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
    running_scheduled = prefill_scheduled = False
    for chunk in plan.scheduled[:upto]:
        end = chunk.start + chunk.num_tokens
        budget -= chunk.num_tokens
        held = by_id.get(chunk.request_id)
        if held is None:
            seats -= 1
        elif speculative(config):  # vllm-v1/spec-padded-new-decode reads these
            running_scheduled = True
            prefill_scheduled |= not held.decoding
        if cache is None:
            request = held if held is not None else _find(before, chunk.request_id)
            free -= chunk_blocks(config, request, chunk.start, end, on_gpu=held is not None)
            continue
        if held is not None:
            tokens = request_tokens(held)
            owned = held.block_ids
        else:
            tokens = request_tokens(_find(before, chunk.request_id))
            owned = longest_hit(cache, tokens, bs)[: chunk.start // bs]
        cache, _ = grow(config, cache, tokens, owned, start=chunk.start, end=end)
        free = len(cache.free_queue)
    return _Left(
        budget, free, seats, cache, long_prefill_cap(before), running_scheduled, prefill_scheduled
    )


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
    Its chunk is cut to the step's cap first, as phase C cuts it; under
    vllm-v1/spec-padded-new-decode a one-token chunk is padded to ``1 + K`` and fits
    only padded.
    """
    if left.seats <= 0 or left.budget <= 0:
        return 0
    bs = config.block_size
    num_hit, evictable = hit
    start = request.num_computed_tokens + num_hit * bs
    remaining = capped(request.num_tokens - start, left.cap)  # vllm-v1/long-prefill-cap
    n = chunk_for_prefill(remaining, left.budget, config.enable_chunked_prefill)
    if pads(
        config,
        start=start,
        num_tokens=request.num_tokens - start,
        prefill_scheduled=left.prefill_scheduled,
        running_scheduled=left.running_scheduled,
    ):
        n = 1 + config.num_speculative_tokens
    need = chunk_blocks(config, request, start, start + n, on_gpu=False) - num_hit + evictable
    if n > left.budget or need > left.free - reserved_blocks(config):  # vllm-v0/watermark
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

    **vllm-v0/prefill-first**: phase C runs first when nothing is swapped, so such a
    step is judged as under nano-vllm (but with R8's seats); a step that starts with
    requests swapped admits nobody, so only its swapped half is judged. Under
    vllm-v0/watermark a request fits only if its blocks leave the watermark free.

    A step that preempts takes nothing back (anti-thrash, R7/R8) and is not judged
    (except when phase C came first, above).
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
    first = admits_first(before)  # phase C came first (nano-vllm, vllm-v0)
    if (plan.preempted and not first) or not liveness_proved(config):
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
    if before.swapped and not admits_after_swap_in(config):
        return ()  # vllm-v0: a step that starts with requests swapped admits nobody
    admitted = set(plan.scheduled_ids) - running
    # nano-vllm, vllm-v0: phase C came first, so only the admissions (if any) came before.
    upto = len(admitted) if first else len(plan.scheduled)
    policy = get_policy(config.policy)
    for request in policy.order_waiting(before.waiting):
        if request.request_id in admitted or stale_output_in_flight(request):
            continue  # a stale output still in flight is a wait of its own (async)
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
