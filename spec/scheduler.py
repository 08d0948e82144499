"""One scheduler step (R5-R10): decide (phases A-C), then apply sampled tokens (phase D).

``step(state, tokens)`` is the whole step. It is ``schedule`` (phases A-C, which
decide what runs and allocate its blocks) followed by ``complete_step`` (phase D,
which advances the computed counts, appends the sampled tokens and finishes
requests). A caller that runs a real model in between uses the two halves:
``schedule``, then ``sampling_request_ids`` to learn who samples, then
``complete_step`` with the sampled tokens.

Every function is pure. Inside a phase, fresh local lists collect the decisions and
become tuples once at the end of the phase; no value that a caller can see is ever
changed.

Vocabulary: ``budget`` is what is left of ``max_num_batched_tokens`` in this step;
``free`` is the number of free GPU blocks. "Schedule chunk (r, n)" means the plan gets
``ScheduledChunk(r.id, start=r.computed, num_tokens=n)``, ``budget -= n``, and r's GPU
blocks grow from ``cdiv(computed, bs)`` to ``cdiv(computed + n, bs)``, taken from
``free``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from spec.invariants import (
    blocks_in_use,
    check_plan,
    check_state,
    eos_sampled,
    kv_conserved_mid_step,
    live_ids_sorted,
    outputs_extended,
)
from spec.kv import (
    blocks_held,
    blocks_to_grow,
    cdiv,
    chunk_for_prefill,
    table_blocks,
)
from spec.lifecycle import has_requests
from spec.oracle import Drafter, TokenOracle
from spec.policies import (
    Policy,
    always_admit,
    get_policy,
    is_latest_priority,
    lifo_victim,
    priority_victim,
    select_victim,
)
from spec.prefix_cache import (
    grow,
    holders,
    longest_hit,
    num_evictable,
    release_blocks,
    request_tokens,
    unkey_undone_chunk,
)
from spec.profiles import (
    admission_frozen_after,
    admits_after_swap_in,
    admits_first,
    blocks_to_run,
    cap_by_profile,
    capped,
    decode_unbudgeted,
    full_sequence_fits,
    gpu_blocks_owned,
    held_after_finish,
    in_flight_reaches_the_end,
    length_capped,
    long_prefill_cap,
    next_victim,
    num_tokens_with_placeholders,
    num_tokens_with_spec,
    offloads_starved,
    reserved_blocks,
    reserves_generation,
    running_capped,
    speculative,
    stale_output_in_flight,
    step_token_limit,
    tracks_decoding,
    victim_among_all_running,
    victim_next,
    whole_sequence_admissible,
)
from spec.progress import progress_violations
from spec.reserve import schedule_reserving
from spec.speculative import (
    blocks_ahead_after,
    capped_to_model_len,
    drafts_scheduled,
    padded,
    pads,
    update_draft_token_ids,
    valid_run,
    verify,
)
from spec.types import (
    FinishedRequest,
    FinishReason,
    InFlightBatch,
    Preemption,
    PreemptionMode,
    PrefixCacheState,
    RequestState,
    SampledTokensError,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDraft:
    """The decisions of phases A-C so far, passed from phase to phase.

    ``state`` is the mid-step state: queues as decided, the blocks of every scheduled
    chunk already taken, but no ``num_computed_tokens`` advanced yet.
    """

    state: SchedulerState
    budget: int
    scheduled: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Preemption, ...] = ()
    swapped_in: tuple[str, ...] = ()
    #: The victims whose chunk of this step was undone (vllm-v1/priority-victim-any-running).
    undone: tuple[str, ...] = ()
    #: The most tokens a chunk of this step takes, 0 for no cap (vllm-v1/long-prefill-cap:
    #: ``long_prefill_cap`` of the state the step starts from).
    long_prefill_cap: int = 0


def first_draft(state: SchedulerState) -> StepDraft:
    """The draft a step's first phase starts from: nothing decided, the whole budget,
    and the step's ``long_prefill_cap`` (read from the state the step starts from).

    post: starts_step(state, __return__)
    """
    return StepDraft(
        state=state,
        budget=state.config.max_num_batched_tokens,
        long_prefill_cap=long_prefill_cap(state),
    )


def starts_step(state: SchedulerState, draft: StepDraft) -> bool:
    """``first_draft``'s contract: ``draft`` is of ``state``, has decided nothing, and holds
    the whole budget and a cap the profile allows (``cap_by_profile``)."""
    return (
        draft.state is state
        and draft.budget == state.config.max_num_batched_tokens
        and not (draft.scheduled or draft.preempted or draft.swapped_in or draft.undone)
        and cap_by_profile(state, draft.long_prefill_cap)
    )


def draft_violations(before: StepDraft, after: StepDraft) -> tuple[str, ...]:
    """What each of phases A-C must keep, one readable line per broken rule.

    - R2 in the middle of a step: ``kv_conserved_mid_step(after.state, after.scheduled)``
      (blocks conserved with every chunk holding its blocks; at most ``max_num_seqs``
      running);
    - R5: the plan only grows (earlier chunks, victims and swap-ins are kept); every new
      chunk has ``1 <= n <= num_tokens - computed`` tokens, starts at its request's
      computed count and names a running request; the budget goes down by exactly the
      new chunks' tokens (but for nano-vllm/decode-unbudgeted's decodes, which it does not
      charge) and stays ``>= 0``;
    - R1: no request is lost or duplicated (the same live ids).

    The contracts of the three phases are ``draft_violations(draft, __return__) == ()``.
    """
    found: list[str] = []
    old = len(before.scheduled)
    if after.scheduled[:old] != before.scheduled:
        found.append("R5: an earlier chunk changed")
    if after.preempted[: len(before.preempted)] != before.preempted:
        found.append("R6: an earlier preemption changed")
    if after.swapped_in[: len(before.swapped_in)] != before.swapped_in:
        found.append("R7: an earlier swap-in changed")
    new = after.scheduled[old:]
    # nano-vllm/decode-unbudgeted: phase A's chunks (of requests running before it) are
    # not charged; an admission is, even one that starts after a cache hit.
    unbudgeted = decode_unbudgeted(after.state.config)
    decoding = {r.request_id for r in before.state.running} if unbudgeted else set()
    charged = sum(c.num_tokens for c in new if c.request_id not in decoding)
    if after.budget != before.budget - charged or after.budget < 0:
        found.append(f"R5: budget {before.budget} -> {after.budget} for {len(new)} new chunks")
    running = {r.request_id: r for r in after.state.running}
    cap = after.long_prefill_cap
    if cap != before.long_prefill_cap:
        found.append(f"R5: long-prefill cap {before.long_prefill_cap} -> {cap}")
    for chunk in new:
        if cap and chunk.num_tokens > cap:
            found.append(f"R5: chunk {chunk} over the long-prefill cap {cap}")
        request = running.get(chunk.request_id)
        if request is None:
            found.append(f"R5: chunk of {chunk.request_id!r}, which is not running")
        elif chunk.start != request.num_computed_tokens or not (
            1 <= chunk.num_tokens <= request.num_tokens - chunk.start
        ):
            found.append(f"R5: chunk {chunk} does not fit {chunk.request_id!r}")
    if not kv_conserved_mid_step(after.state, after.scheduled):
        found.append("R2: blocks not conserved mid-step (or too many running)")
    if live_ids_sorted(after.state) != live_ids_sorted(before.state):
        found.append("R1: a request was lost or duplicated")
    return tuple(found)


def plan_tokens(plan: StepPlan) -> int:
    """The tokens a plan schedules, to compare with ``max_num_batched_tokens``.

    pre: all(chunk.num_tokens >= 1 for chunk in plan.scheduled)
    post: __return__ >= len(plan.scheduled)
    """
    return sum(plan.num_scheduled_tokens)


# --- preemption (R6) -------------------------------------------------------------------


def preempted_as(
    victim: RequestState, after: RequestState, computed: int, outputs: tuple[int, ...]
) -> bool:
    """Whether ``after`` is ``victim`` (the same request) preempted once more, now with
    ``computed`` tokens computed and ``outputs``."""
    return (
        after.request == victim.request
        and after.num_computed_tokens == computed
        and after.output_token_ids == outputs
        and after.num_preemptions == victim.num_preemptions + 1
    )


def can_swap_out(victim: RequestState, block_size: int, num_free_cpu_blocks: int) -> bool:
    """R6 swap: whether the victim's ``cdiv(computed, bs)`` blocks fit the free CPU blocks.

    pre: block_size >= 1
    pre: victim.num_computed_tokens >= 0
    post: __return__ == (victim.num_computed_tokens <= num_free_cpu_blocks * block_size)
    """
    return blocks_held(victim.num_computed_tokens, block_size) <= num_free_cpu_blocks


def swap_out(victim: RequestState) -> RequestState:
    """R6 swap: the victim keeps ``computed`` and its outputs; its blocks move to the CPU.

    post: preempted_as(victim, __return__, victim.num_computed_tokens, victim.output_token_ids)
    """
    return replace(victim, num_preemptions=victim.num_preemptions + 1)


def recompute(victim: RequestState) -> RequestState:
    """R6 recompute: ``computed = 0``, outputs kept; it re-prefills prompt + outputs.
    Its drafts go (vllm-v1/spec-propose: ``_preempt_request`` clears ``spec_token_ids``,
    ``scheduler.py:1594-1595``) with the blocks they held.

    post: preempted_as(victim, __return__, 0, victim.output_token_ids)
    """
    return replace(
        victim,
        num_computed_tokens=0,
        num_preemptions=victim.num_preemptions + 1,
        spec_token_ids=(),
        num_blocks_ahead=0,
        decoding=False,
        # vllm-v1/async-stale-output: what is in flight is stale; its placeholders go.
        num_output_placeholders=0,
        num_stale_output_tokens=victim.num_in_flight_tokens,
    )


def restart(victim: RequestState) -> RequestState:
    """R6 restart: ``computed = 0`` and the outputs are discarded (the seed tutorial).

    post: preempted_as(victim, __return__, 0, ())
    """
    return replace(
        victim,
        output_token_ids=(),
        num_computed_tokens=0,
        num_preemptions=victim.num_preemptions + 1,
    )


def preempted_by_mode(
    victim: RequestState, config: SchedulerConfig, after: RequestState, mode: PreemptionMode
) -> bool:
    """``preempt``'s contract: one more preemption, in the configured mode or by
    recompute; a swap keeps ``computed``, recompute and restart reset it."""
    computed = victim.num_computed_tokens if mode is PreemptionMode.SWAP else 0
    return (
        after.num_preemptions == victim.num_preemptions + 1
        and mode in (config.preemption_mode, PreemptionMode.RECOMPUTE)
        and after.num_computed_tokens == computed
    )


def preempt(
    victim: RequestState, config: SchedulerConfig, num_free_cpu_blocks: int
) -> tuple[RequestState, PreemptionMode]:
    """R6: the victim after preemption and the mode actually used.

    By ``preemption_mode``: recompute (``computed = 0``, outputs kept), restart
    (``computed = 0``, outputs discarded), or swap when its blocks fit the free CPU
    blocks (``computed`` kept), else recompute (the fallback, which is what the mode
    then says). The caller frees its GPU blocks, takes the CPU blocks of a swap, and
    puts it at the front of ``waiting`` or, if swapped, at the tail of ``swapped``.

    pre: victim.num_computed_tokens >= 0

    post: preempted_by_mode(victim, config, *__return__)
    """
    mode = config.preemption_mode
    if mode is PreemptionMode.SWAP and can_swap_out(victim, config.block_size, num_free_cpu_blocks):
        return swap_out(victim), PreemptionMode.SWAP
    if mode is PreemptionMode.RESTART:
        return restart(victim), PreemptionMode.RESTART
    return recompute(victim), PreemptionMode.RECOMPUTE


Released = tuple[RequestState, PreemptionMode, int, int, PrefixCacheState | None]
"""``release_victim``'s result: the victim after, the mode, free GPU and CPU blocks, the pool."""


def victim_released(  # noqa: PLR0917  (release_victim's arguments, as its contract names them)
    victim: RequestState,
    held: int,
    config: SchedulerConfig,
    free: int,
    free_cpu: int,
    cache: PrefixCacheState | None,
    others: tuple[RequestState, ...],
    released: Released,
) -> bool:
    """``release_victim``'s contract: the GPU pool gets back exactly what the victim held
    alone (all ``cdiv(held, bs)`` blocks with caching off; with it on, its block ids no
    other running request holds, and it holds none after), and the CPU pool gives
    exactly the blocks of a swap's kept computed tokens (``table_blocks``: with the blocks
    it holds ahead, vllm-v1/spec-rejected-blocks-kept)."""
    after, mode, free_after, free_cpu_after, _ = released
    bs = config.block_size
    if cache is None:
        alone = table_blocks(held, victim.num_computed_tokens, victim.num_blocks_ahead, bs)
    else:
        alone = len(set(victim.block_ids) - holders(others).keys())
    swapped = blocks_held(after.num_computed_tokens, bs) if mode is PreemptionMode.SWAP else 0
    return (
        free_after == free + alone
        and (cache is None or after.block_ids == ())
        and free_cpu_after >= 0
        and free_cpu_after + swapped == free_cpu
    )


def release_victim(
    victim: RequestState,
    held: int,
    config: SchedulerConfig,
    *,
    free: int,
    free_cpu: int,
    cache: PrefixCacheState | None = None,
    others: tuple[RequestState, ...] = (),
) -> Released:
    """R6 with its block accounting: preempt a running ``victim`` whose GPU blocks hold
    ``held`` tokens when ``free`` GPU and ``free_cpu`` CPU blocks are free; return it
    after, the mode used, the free counts after and the block pool after.

    ``held`` is its computed count, plus its chunk of this step when that chunk is
    undone (vllm-v1/priority-victim-any-running). With prefix caching off all its
    ``cdiv(held, bs)`` GPU blocks are given back; with it on (``cache``, PC6, PC7) its
    ``block_ids`` that none of ``others`` (the other running requests) holds join the
    free queue, and it holds none after. A swapped victim takes the CPU blocks for its
    (kept) computed tokens, which it fits by ``preempt``'s choice. Blocks are
    conserved: what the GPU pool gets back and the CPU pool gives are exactly what the
    victim held alone before and holds after.

    pre: 0 <= victim.num_computed_tokens <= held
    pre: victim.num_blocks_ahead >= 0
    pre: free >= 0 and free_cpu >= 0
    pre: cache is None or free == len(cache.free_queue)
    pre: len(set(victim.block_ids)) == len(victim.block_ids)
    post: victim_released(victim, held, config, free, free_cpu, cache, others, __return__)
    """
    bs = config.block_size
    after, mode = preempt(victim, config, free_cpu)
    if cache is None:
        free += table_blocks(held, victim.num_computed_tokens, victim.num_blocks_ahead, bs)
    else:  # PC6, PC7: shared blocks stay with their other holders
        cache = release_blocks(config, cache, victim.block_ids, holders(others))
        free = len(cache.free_queue)
        after = replace(after, block_ids=())
    if mode is PreemptionMode.SWAP:
        free_cpu -= blocks_held(after.num_computed_tokens, bs)
    return after, mode, free, free_cpu, cache


# --- phase A: running requests (R5) ---------------------------------------------------


def choose_victim(policy: Policy, running: tuple[RequestState, ...], i: int) -> int:
    """R5 step 3: the index in ``running`` of the victim when ``running[i]`` needs blocks.

    The candidates are ``running[i:]``: the current request and the ones after it,
    never one already scheduled in this step; the victim is the one the policy names.

    pre: 0 <= i < len(running)
    post: i <= __return__ < len(running)
    """
    return i + select_victim(policy, running[i:])


def victim_by_profile(
    config: SchedulerConfig, policy: Policy, running: tuple[RequestState, ...], i: int, k: int
) -> bool:
    """``profile_victim``'s contract: ``running[k]`` is the victim the profile names when
    ``running[i]`` needs blocks: nano-vllm, the next request (the current one if last);
    vllm-v1 with ``priority``, the lowest priority, latest arrival of all of
    ``running``; otherwise the policy's victim among ``running[i:]``."""
    if not 0 <= k < len(running):
        return False
    if victim_next(config):
        return k == min(i + 1, len(running) - 1)
    if victim_among_all_running(config):
        return is_latest_priority(running, k)
    return i <= k and k - i == policy.select_victim(running[i:])


def profile_victim(
    config: SchedulerConfig, policy: Policy, running: tuple[RequestState, ...], i: int
) -> int:
    """R5 step 3 by profile: the index in ``running`` of the victim for ``running[i]``.

    kvsched: ``choose_victim``. nano-vllm/victim-next: the candidate after ``running[i]``,
    or ``running[i]`` when it is the last. vllm-v1/priority-victim-any-running: the
    ``priority`` victim among the whole of ``running``, which may be a request already
    scheduled in this step (an index below ``i``).

    pre: 0 <= i < len(running)
    post: victim_by_profile(config, policy, running, i, __return__)
    """
    if victim_next(config):
        return i + next_victim(len(running) - i)
    if victim_among_all_running(config):
        return priority_victim(running)
    return choose_victim(policy, running, i)


def _ids(requests: tuple[RequestState, ...]) -> list[str]:
    return [r.request_id for r in requests]


def newest_victims(before: StepDraft, after: StepDraft) -> bool:
    """Which requests phase A preempts, where the victim is the last candidate (``lifo``
    and ``reserve``'s ``lifo_victim``) among ``running[i:]`` (every profile but
    nano-vllm/victim-next and vllm-v1/priority-victim-any-running): the newest running
    requests, newest first (candidates are never scheduled ones, and a request whose
    victim is itself ends phase A)."""
    config = before.state.config
    policy = get_policy(config.policy)
    if policy.select_victim is not lifo_victim or victim_next(config):
        return True
    if victim_among_all_running(config):
        return True
    victims = [p.request_id for p in after.preempted[len(before.preempted) :]]
    return victims == _ids(before.state.running)[::-1][: len(victims)]


def running_served(before: StepDraft, after: StepDraft) -> bool:
    """Phase A's contract: the victims by policy (``newest_victims``); the chunks are the
    head of ``running``, in order; each request running before is running or preempted;
    the recomputed victims are at the front of ``waiting``, the last preempted first,
    the swapped ones at the tail of ``swapped``, in preemption order; and
    ``draft_violations``."""
    scheduled = [c.request_id for c in after.scheduled]
    swap = [p.request_id for p in after.preempted if p.mode is PreemptionMode.SWAP]
    back = [p.request_id for p in reversed(after.preempted) if p.mode is not PreemptionMode.SWAP]
    return (
        newest_victims(before, after)
        and scheduled == _ids(after.state.running[: len(scheduled)])
        and len(after.state.running) + len(after.preempted) == len(before.state.running)
        and _ids(after.state.waiting) == back + _ids(before.state.waiting)
        and _ids(after.state.swapped) == _ids(before.state.swapped) + swap
        and draft_violations(before, after) == ()
    )


def schedule_running(draft: StepDraft) -> StepDraft:
    """Phase A (R5): serve ``running`` from the head, preempting when blocks run out.

    Walk ``running`` from the head, index ``i``, while ``i < len(running)`` and
    ``budget > 0``:

    1. ``n = min(num_tokens - computed, budget)`` (a decode is 1 token; a request in the
       middle of a chunked prefill takes the rest of its prompt, capped by the budget,
       and first by the step's ``long_prefill_cap`` under vllm-v1/long-prefill-cap;
       under vllm-v1/spec-drafts-scheduled its drafts count in ``num_tokens``, and the
       chunk ends at ``max_model_len - 1`` at most);
    2. ``need = cdiv(computed + n, bs) - cdiv(computed, bs)`` (less the blocks it holds
       ahead, vllm-v1/spec-rejected-blocks-kept);
    3. while ``need > free`` (vllm-v0/append-touches-last-block: while fewer blocks are
       free than the chunk writes into, ``blocks_to_run``): the policy picks a victim
       among the candidates ``running[i:]`` (never one already scheduled in this step)
       and it is preempted (R6); if the victim is the current request itself, phase A
       ends;
    4. otherwise schedule chunk ``(running[i], n)`` and go on with ``i + 1``.

    Requests left when the budget runs out are not scheduled in this step.

    By profile (``spec.profiles``): under nano-vllm/decode-unbudgeted the walk ignores
    the budget and stops once ``max_num_seqs`` requests are scheduled; the victim is
    ``profile_victim``'s, and under vllm-v1/priority-victim-any-running a victim already
    scheduled in this step has its chunk undone (its tokens back in the budget, its
    blocks freed, the keys the chunk gave them dropped first: vllm-v1/undone-chunk-unkeyed,
    out of the plan) and the walk goes on with the same request. Victims go
    to the front of ``waiting`` one by one as they are preempted (so under ``lifo``
    the victims of one step stay in admission order there), or, swapped, to the tail
    of ``swapped``.

    Phase A is the first phase: it starts from a state between steps and the whole
    budget.

    pre: check_state(draft.state)
    pre: draft.budget == draft.state.config.max_num_batched_tokens
    pre: draft.scheduled == () and draft.preempted == () and draft.swapped_in == ()
    pre: draft.long_prefill_cap == long_prefill_cap(draft.state)
    post: running_served(draft, __return__)
    """
    state = draft.state
    config = state.config
    policy = get_policy(config.policy)
    bs = config.block_size
    cache = state.prefix_cache
    unbudgeted = decode_unbudgeted(config)
    running = list(state.running)
    chunks: list[ScheduledChunk] = []
    preempted: list[Preemption] = []
    to_waiting: list[RequestState] = []  # in preemption order; each goes to the front
    to_swapped: list[RequestState] = []
    free = state.num_free_gpu_blocks
    free_cpu = state.num_free_cpu_blocks
    budget = draft.budget
    undone: list[str] = []
    i = 0
    phase_over = False
    while not phase_over and i < len(running):
        if unbudgeted:
            if i >= config.max_num_seqs:
                break
        elif budget == 0:
            break
        request = running[i]
        if in_flight_reaches_the_end(config, request):  # vllm-v1/async-max-tokens
            i += 1
            continue
        computed = request.num_computed_tokens
        ahead = request.num_blocks_ahead
        remaining = num_tokens_with_placeholders(request) - computed
        if request.spec_token_ids:  # vllm-v1/spec-drafts-scheduled
            remaining = capped_to_model_len(
                config, request, remaining + len(request.spec_token_ids)
            )
        n = remaining if unbudgeted else running_chunk(remaining, budget, draft.long_prefill_cap)
        need = blocks_to_grow(computed, n, ahead, bs)
        while blocks_to_run(config, computed, n, ahead) > free:
            k = profile_victim(config, policy, tuple(running), i)
            victim = running.pop(k)
            held = victim.num_computed_tokens
            if k < i:  # vllm-v1/priority-victim-any-running: a victim behind the walk
                i -= 1
            # Its chunk, if it has one, is undone (found by id: a request phase A walked
            # past, vllm-v1/async-max-tokens, has none).
            j = next((j for j, c in enumerate(chunks) if c.request_id == victim.request_id), -1)
            if j >= 0:
                chunk = chunks.pop(j)
                undone.append(chunk.request_id)
                budget += chunk.num_tokens
                held += chunk.num_tokens
                if cache is not None:  # vllm-v1/undone-chunk-unkeyed (V11)
                    cache = unkey_undone_chunk(
                        cache,
                        victim.block_ids,
                        start=chunk.start,
                        end=chunk.start + chunk.num_tokens,
                        block_size=bs,
                    )
            after, mode, free, free_cpu, cache = release_victim(
                victim,
                held,
                config,
                free=free,
                free_cpu=free_cpu,
                cache=cache,
                others=tuple(running),
            )
            preempted.append(Preemption(request_id=victim.request_id, mode=mode))
            if mode is PreemptionMode.SWAP:
                to_swapped.append(after)
            else:
                to_waiting.append(after)
            if victim is request:
                phase_over = True
                break
        if not phase_over:
            chunks.append(
                ScheduledChunk(request_id=request.request_id, start=computed, num_tokens=n)
            )
            if not unbudgeted:
                budget -= n
            free -= need
            if cache is not None:  # PC8: the chunk's blocks by PC5, their keys by PC2
                cache, block_ids = grow(
                    config,
                    cache,
                    request_tokens(request),
                    request.block_ids,
                    start=computed,
                    end=computed + n,
                )
                running[i] = replace(request, block_ids=block_ids)
            i += 1
    if not preempted and cache is None:
        new_state = replace(state, num_free_gpu_blocks=free)
    else:
        new_state = replace(
            state,
            running=tuple(running),
            waiting=(*reversed(to_waiting), *state.waiting),
            swapped=(*state.swapped, *to_swapped),
            num_free_gpu_blocks=free,
            num_free_cpu_blocks=free_cpu,
            prefix_cache=cache,
        )
    return replace(
        draft,
        state=new_state,
        budget=budget,
        scheduled=(*draft.scheduled, *chunks),
        preempted=(*draft.preempted, *preempted),
        undone=(*draft.undone, *undone),
    )


# --- phase B: swapping in (R7) ---------------------------------------------------------


def chunk_fits(  # noqa: PLR0917  (prefill_fit's arguments, as its contract names them)
    request: RequestState,
    config: SchedulerConfig,
    start: int,
    num_hit: int,
    budget: int,
    free: int,
    cap: int,
    n: int,
) -> bool:
    """``prefill_fit``'s contract, in token slots: no chunk (``n == 0``), or one of
    ``1..min(budget, remaining)`` tokens (and at most the step's ``cap``,
    vllm-v1/long-prefill-cap, unless 0) whose end fits the slots of the hit's blocks and
    the free ones."""
    return n == 0 or (
        1 <= n <= budget
        and (cap == 0 or n <= cap)
        and start + n <= request.num_tokens
        and start + n <= (num_hit + free) * config.block_size
    )


def running_chunk(remaining: int, budget: int, cap: int) -> int:
    """R5 step 1: a running request's chunk, its ``remaining`` tokens cut first to the
    step's ``cap`` (vllm-v1/long-prefill-cap; 0: none), then to the budget.

    pre: remaining >= 1 and budget >= 1 and cap >= 0
    post: 1 <= __return__ <= min(remaining, budget) and (cap == 0 or __return__ <= cap)
    """
    return min(capped(remaining, cap), budget)


def prefill_fit(
    request: RequestState,
    config: SchedulerConfig,
    *,
    start: int,
    num_hit: int,
    budget: int,
    free: int,
    cap: int = 0,
) -> int:
    """R7 steps 2-3, R8 steps 2-3 and PC4: the chunk a swapped or waiting request gets, or 0.

    The chunk starts at ``start``: a swapped request's computed count, a waiting one's
    cache hit of ``num_hit`` blocks, ``num_hit * bs`` tokens (0 with caching off).
    ``n = chunk_for_prefill(num_tokens - start, budget, chunked)``, the remainder cut
    first to the step's ``cap`` (vllm-v1/long-prefill-cap); it does not fit (0)
    if ``n > budget`` (an unchunked prefill larger than what is left) or if the
    ``cdiv(start + n, bs) - num_hit`` blocks it takes exceed ``free`` (a swapped one
    gets back the blocks of its computed prefix too; a hit's blocks exist already, and
    the caller leaves out of ``free`` those of them that sit in the free queue, PC4).

    pre: budget >= 1 and free >= 0 and cap >= 0
    pre: 0 <= num_hit * config.block_size <= start < request.num_tokens
    post: chunk_fits(request, config, start, num_hit, budget, free, cap, __return__)
    """
    remaining = capped(request.num_tokens - start, cap)
    n = chunk_for_prefill(remaining, budget, config.enable_chunked_prefill)
    if n > budget or blocks_held(start + n, config.block_size) - num_hit > free:
        return 0
    return n


def swapped_in_head_first(before: StepDraft, after: StepDraft) -> bool:
    """Phase B's contract: ``draft_violations``; the swap-ins are the head of ``swapped``,
    in order; and (R7, head-of-line) the first swapped request left did not fit."""
    new = after.swapped_in[len(before.swapped_in) :]
    return (
        draft_violations(before, after) == ()
        and list(new) == _ids(before.state.swapped[: len(new)])
        and swapped_head_blocked(after)
    )


def swapped_head_blocked(after: StepDraft) -> bool:
    """R7 on what is left after phase B, in a step that preempted nothing: the head of
    ``swapped`` (if any) lacks a seat, the budget (its whole remainder, with chunked
    prefill off) or the slots of the GPU blocks left free."""
    state, config = after.state, after.state.config
    if after.preempted or not state.swapped:
        return True
    head = state.swapped[0]
    remaining = head.num_tokens - head.num_computed_tokens
    n = min(remaining, after.budget) if config.enable_chunked_prefill else remaining
    return (
        len(state.running) >= config.max_num_seqs
        or after.budget == 0
        or n > after.budget
        or head.num_computed_tokens + n > state.num_free_gpu_blocks * config.block_size
    )


def swap_in_requests(draft: StepDraft) -> StepDraft:
    """Phase B (R7): bring swapped requests back, head first, while they fit.

    Only if nothing was preempted in this step. Walk ``swapped`` from the head and stop
    at the first request that does not fit (head-of-line):

    1. stop if ``len(running) >= max_num_seqs`` or ``budget == 0``;
    2. ``remaining = num_tokens - computed``; ``n = min(remaining, budget)`` with chunked
       prefill on, else ``n = remaining``, and stop if ``n > budget``;
    3. stop if ``cdiv(computed + n, bs) > free`` (vllm-v0/watermark: ``> free -
       watermark``);
    4. else its CPU blocks are freed, it gets ``cdiv(computed + n, bs)`` GPU blocks (its
       K/V is copied back into the first ``cdiv(computed, bs)``), it goes to the tail of
       ``running``, its id is appended to ``swapped_in`` and chunk (r, n) is scheduled.

    Its input is a mid-step value: blocks conserved with the chunks scheduled so far
    holding theirs, and what is left of the budget.

    pre: kv_conserved_mid_step(draft.state, draft.scheduled)
    pre: 0 <= draft.budget <= draft.state.config.max_num_batched_tokens
    post: swapped_in_head_first(draft, __return__)
    """
    state = draft.state
    if draft.preempted or not state.swapped:
        return draft
    config = state.config
    bs = config.block_size
    free = state.num_free_gpu_blocks
    free_cpu = state.num_free_cpu_blocks
    budget = draft.budget
    room = config.max_num_seqs - len(state.running)
    reserve = reserved_blocks(config)  # vllm-v0/watermark
    moved: list[RequestState] = []
    chunks: list[ScheduledChunk] = []
    for request in state.swapped:
        if len(moved) >= room or budget == 0:
            break
        computed = request.num_computed_tokens
        n = prefill_fit(
            request,
            config,
            start=computed,
            num_hit=0,
            budget=budget,
            free=max(free - reserve, 0),
        )
        if n == 0:
            break
        gpu_blocks = blocks_held(computed + n, bs)
        free_cpu += blocks_held(computed, bs)
        free -= gpu_blocks
        budget -= n
        moved.append(request)
        chunks.append(ScheduledChunk(request_id=request.request_id, start=computed, num_tokens=n))
    if not moved:
        return draft
    new_state = replace(
        state,
        running=(*state.running, *moved),
        swapped=state.swapped[len(moved) :],
        num_free_gpu_blocks=free,
        num_free_cpu_blocks=free_cpu,
    )
    return replace(
        draft,
        state=new_state,
        budget=budget,
        scheduled=(*draft.scheduled, *chunks),
        swapped_in=(*draft.swapped_in, *(r.request_id for r in moved)),
    )


# --- phase C: admitting waiting requests (R8) ------------------------------------------


def waiting_admitted(before: StepDraft, after: StepDraft) -> bool:
    """Phase C's contract: nothing is admitted after a preemption or while a request is
    swapped; the admitted are the first requests of the policy's order (head-of-line: a
    request that does not fit stops phase C, none after it is tried); ``waiting`` keeps
    its order minus the admitted; and ``draft_violations``."""
    admitted = {c.request_id for c in after.scheduled}
    new = [c.request_id for c in after.scheduled[len(before.scheduled) :]]
    order = _ids(get_policy(before.state.config.policy).order_waiting(before.state.waiting))
    idle = bool(before.preempted or before.state.swapped)
    return (
        (after == before or not idle)
        and new == order[: len(new)]
        and _ids(after.state.waiting)
        == [i for i in _ids(before.state.waiting) if i not in admitted]
        and draft_violations(before, after) == ()
    )


def admit_waiting(draft: StepDraft) -> StepDraft:
    """Phase C (R8): admit waiting requests in the policy's order while they fit.

    Only if nothing was preempted in this step (anti-thrash, vLLM V1) and ``swapped``
    is empty (swapped requests are served before new work, vLLM V0). Walk the waiting
    requests in the policy's order (R9); stop at the first that does not fit:

    1. stop if ``len(running) >= max_num_seqs`` (nano-vllm/seq-limit-per-step: if this
       step admitted ``max_num_seqs`` already) or ``budget == 0``;
    2. ``n = min(num_tokens, budget)`` with chunked prefill on, else ``n = num_tokens``,
       and stop if ``n > budget``; under vllm-v1/long-prefill-cap ``num_tokens`` is first
       cut to the step's cap (so a capped prompt is chunked even with chunked prefill off);
    3. stop if ``cdiv(n, bs) > free`` (vllm-v0/watermark: ``> free - watermark``), or
       (vllm-v1/full-sequence-admission) if
       ``cdiv(num_tokens, bs) > free`` (with a cache hit: less the hit blocks, plus
       those of them that are free), or if the policy's admission gate refuses it
       (nano-vllm/admission-tests-len-seq: also if ``num_tokens > budget``);
    4. else it leaves ``waiting``, goes to the tail of ``running``, and chunk (r, n) is
       scheduled (a preempted request re-prefills prompt + kept outputs).

    With prefix caching on, the chunk starts after the request's cache hit ``h``
    (PC3, PC4): ``n`` is taken from ``num_tokens - h``, step 3 counts the new blocks
    plus the hit blocks that are free, and the request's computed count becomes ``h``.

    Under vllm-v1/spec-padded-new-decode a one-token chunk may be padded to ``1 + K``
    (``spec.speculative.pads``): the padded chunk must fit the budget, or admission
    stops there, and its blocks must fit as any chunk's.

    ``waiting`` keeps its stored order, minus the admitted requests. The gate sees the
    mid-step state with the requests admitted before it in this step. Its input is a
    mid-step value, as for ``swap_in_requests``.

    pre: kv_conserved_mid_step(draft.state, draft.scheduled)
    pre: 0 <= draft.budget <= draft.state.config.max_num_batched_tokens
    post: waiting_admitted(draft, __return__)
    """
    state = draft.state
    if draft.preempted or state.swapped or not state.waiting:
        return draft
    config = state.config
    policy = get_policy(config.policy)
    bs = config.block_size
    cache = state.prefix_cache
    free = state.num_free_gpu_blocks
    budget = draft.budget
    running = list(state.running)
    admitted: set[str] = set()
    chunks: list[ScheduledChunk] = []
    seats = config.max_num_seqs - (len(running) if running_capped(config) else 0)
    reserve = reserved_blocks(config)  # vllm-v0/watermark
    # vllm-v1/spec-padded-new-decode reads what phase A scheduled.
    prefill_scheduled = running_scheduled = False
    if speculative(config):
        by_id = _running_by_id(state)
        prefill_scheduled = any(not by_id[c.request_id].decoding for c in draft.scheduled)
        running_scheduled = bool(draft.scheduled)
    for candidate in policy.order_waiting(state.waiting):
        request = candidate
        if len(chunks) >= seats or budget == 0:
            break
        if stale_output_in_flight(request):  # vllm-v1/async-stale-output
            continue
        if not whole_sequence_admissible(config, request, budget, free):
            break
        hit: tuple[int, ...] = ()
        evictable = 0
        if cache is not None:  # PC3, and PC4: the hit blocks that sit in the free queue
            hit = longest_hit(cache, request_tokens(request), bs)
            evictable = num_evictable(cache, hit)
        start = len(hit) * bs
        room = max(free - evictable - reserve, 0)
        pad = pads(
            config,
            start=start,
            num_tokens=request.num_tokens - start,
            prefill_scheduled=prefill_scheduled,
            running_scheduled=running_scheduled,
        )
        if pad:  # vllm-v1/spec-padded-new-decode: padded, or not admitted at all
            n = 1 + config.num_speculative_tokens
            if n > budget:
                break
            if cdiv(start + n, bs) - len(hit) > room:
                n = 0
        else:
            n = prefill_fit(
                request,
                config,
                start=start,
                num_hit=len(hit),
                budget=budget,
                free=room,
                cap=draft.long_prefill_cap,
            )
        if n == 0 or not full_sequence_fits(
            config, request, free, num_hit=len(hit), num_evictable=evictable
        ):
            break
        gpu_blocks = cdiv(start + n, bs) - len(hit)
        # The default gate never refuses; skip building the view it would ignore.
        if policy.can_admit is not always_admit and not policy.can_admit(
            _admission_view(state, running, admitted, free, cache), request, n
        ):
            break
        free -= gpu_blocks + evictable
        budget -= n
        if cache is not None:  # PC4: the hit is touched before new blocks are taken, PC2
            cache, block_ids = grow(
                config, cache, request_tokens(request), hit, start=start, end=start + n
            )
            request = replace(candidate, num_computed_tokens=start, block_ids=block_ids)
        if pad:
            request = padded(request, config)
        running.append(request)
        admitted.add(request.request_id)
        chunks.append(ScheduledChunk(request_id=request.request_id, start=start, num_tokens=n))
    if not chunks:
        return draft
    new_state = _admission_view(state, running, admitted, free, cache)
    return replace(draft, state=new_state, budget=budget, scheduled=(*draft.scheduled, *chunks))


def _admission_view(
    state: SchedulerState,
    running: list[RequestState],
    admitted: set[str],
    free: int,
    cache: PrefixCacheState | None,
) -> SchedulerState:
    """The mid-step state after admitting ``admitted`` (now at the tail of ``running``)."""
    return replace(
        state,
        running=tuple(running),
        waiting=tuple(r for r in state.waiting if r.request_id not in admitted),
        num_free_gpu_blocks=free,
        prefix_cache=cache,
    )


# --- phases A-C together ---------------------------------------------------------------


def step_planned(state: SchedulerState, state_mid: SchedulerState, plan: StepPlan) -> bool:
    """``schedule``'s contract: the plan within ``step_token_limit``, of this step, nothing
    sampled or finished yet, no swap-in after a preemption (but under transformers, which
    swaps in after offloading); blocks conserved with the chunks holding theirs; no
    request lost or duplicated."""
    return (
        plan_tokens(plan) <= step_token_limit(state.config)
        and plan.step == state.num_steps
        and plan.sampled == ()
        and plan.finished == ()
        and (not (plan.preempted and plan.swapped_in) or offloads_starved(state.config))
        and kv_conserved_mid_step(state_mid, plan.scheduled)
        and live_ids_sorted(state_mid) == live_ids_sorted(state)
    )


def queued(state_mid: SchedulerState, plan: StepPlan) -> SchedulerState:
    """**vllm-v1/async-batch-queue**: the step ``plan`` joins the steps in flight, with
    the requests its chunks make sample (the model runner's output), and the finished
    requests are no longer news (``schedule`` clears ``finished_req_ids``,
    ``v1/core/sched/scheduler.py:1645-1650``).

    post: __return__.in_flight == (*state_mid.in_flight, __return__.in_flight[-1])
    """
    by_id = _running_by_id(state_mid)
    batch = InFlightBatch(
        step=plan.step,
        scheduled=plan.scheduled,
        arrivals=tuple(by_id[c.request_id].request.arrival for c in plan.scheduled),
        sampling_ids=tuple(
            c.request_id
            for c in plan.scheduled
            if samples(by_id[c.request_id], c.start, c.num_tokens)
        ),
    )
    return replace(state_mid, in_flight=(*state_mid.in_flight, batch), has_finished_requests=False)


def schedule(state: SchedulerState) -> tuple[SchedulerState, StepPlan]:
    """Phases A-C of a step: decide what runs and allocate its blocks (R5-R8).

    The plan has ``step = state.num_steps`` and empty ``sampled`` / ``finished``.

    Under nano-vllm/prefill-first, and vllm-v0/prefill-first when nothing is swapped
    (``admits_first``), phase C runs first, with the whole budget; if it admitted anyone
    the step is that prefill alone, else phase A runs (a decode step). Under vllm-v0 a
    step that starts with requests swapped runs A and B only (``admits_after_swap_in``).
    Under transformers/offload-starved the three phases are one walk followed by
    offloads (``spec.offload.schedule_offloading``); under tokenspeed they are its plan
    (``spec.reserve.schedule_reserving``).

    The returned state is an **intermediate value**, not a state between steps: the
    blocks of every scheduled chunk are already taken and the queues are as decided,
    but no ``num_computed_tokens`` has advanced and ``num_steps`` has not moved, so a
    scheduled request owns ``cdiv(computed + n, bs)`` blocks rather than the
    ``cdiv(computed, bs)`` of R2 and ``state_violations`` does not apply to it. Pass it
    only to ``sampling_request_ids`` and ``complete_step``.

    pre: check_state(state)
    post: step_planned(state, *__return__)
    """
    if offloads_starved(state.config):
        # Imported here: spec.offload builds on this module's release_victim.
        from spec.offload import schedule_offloading  # noqa: PLC0415

        return schedule_offloading(state)
    if reserves_generation(state.config):
        return schedule_reserving(state)
    if state.config.async_scheduling and not has_requests(state):
        return state, StepPlan.of(step=state.num_steps)  # vllm-v1/async-batch-queue
    draft = first_draft(state)
    if admits_first(state):
        admitted = admit_waiting(draft)
        draft = admitted if admitted.scheduled else schedule_running(draft)
    else:
        draft = swap_in_requests(schedule_running(draft))
        if admits_after_swap_in(state.config):
            draft = admit_waiting(draft)
    plan = StepPlan.of(
        step=state.num_steps,
        scheduled=draft.scheduled,
        preempted=draft.preempted,
        swapped_in=draft.swapped_in,
    )
    if state.config.async_scheduling:
        return queued(draft.state, plan), plan
    return draft.state, plan


# --- phase D: sampled tokens and finishing (R10) ---------------------------------------


def stops_for(
    config: SchedulerConfig,
    params: SamplingParams,
    num_tokens: int,
    num_outputs: int,
    reason: FinishReason | None,
) -> bool:
    """``finish_reason``'s contract: ``length`` only when capped by length, and nothing
    goes on with ``max_tokens`` outputs."""
    capped = length_capped(config, num_tokens, num_outputs, params.max_tokens)
    return (reason is not FinishReason.LENGTH or capped) and (
        reason is not None or num_outputs < params.max_tokens
    )


def finish_reason(
    config: SchedulerConfig, params: SamplingParams, token: int, num_tokens: int, num_outputs: int
) -> FinishReason | None:
    """R10: why a request that just sampled ``token`` (now its ``num_outputs``-th) stops.

    ``num_tokens`` is its prompt + outputs, the token included. ``stop`` if the token
    is its ``eos_token_id`` and ``ignore_eos`` is false (checked first, so an EOS as the
    last allowed token is ``stop``; the EOS token is part of the output); otherwise
    ``length`` once it has ``max_tokens`` outputs, or under vllm-v1/max-model-len
    ``max_model_len`` tokens (``spec.profiles.length_capped``); else None.

    pre: num_outputs >= 1
    post: stops_for(config, params, num_tokens, num_outputs, __return__)
    """
    if not params.ignore_eos and params.eos_token_id is not None and token == params.eos_token_id:
        return FinishReason.STOP
    if length_capped(config, num_tokens, num_outputs, params.max_tokens):
        return FinishReason.LENGTH
    return None


def _sampled_into(
    config: SchedulerConfig,
    request: RequestState,
    token: int,
    before: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], FinishedRequest | None]:
    """R10 for a request that samples ``token`` after its outputs (``before``, if it
    sampled others in this step): its outputs with the token appended, and its report
    if ``finish_reason`` stops it (``complete_step``; applying a step under async
    scheduling, ``spec.pipeline``). No contract of its own: CrossHair would assume it in
    place of the body while it analyses those callers, and ``complete_step``'s contract
    is what checks it.
    """
    outputs = (*(request.output_token_ids if before is None else before), token)
    reason = finish_reason(
        config,
        request.request.params,
        token,
        len(request.request.prompt_token_ids) + len(outputs),
        len(outputs),
    )
    if reason is None:
        return outputs, None
    return outputs, FinishedRequest(
        request_id=request.request_id,
        output_token_ids=outputs,
        finish_reason=reason,
        num_preemptions=request.num_preemptions,
    )


def _run_into(
    config: SchedulerConfig, request: RequestState, run: tuple[int, ...]
) -> tuple[tuple[int, ...], FinishedRequest | None, tuple[int, ...]]:
    """R10 for a request that samples the tokens of ``run`` (one, or under
    vllm-v1/spec-verify its accepted drafts and one more), appended one at a time,
    each followed by the stop checks (``_update_request_with_output``,
    ``scheduler.py:2493-2510``): its outputs after, its report if one stops it, and the
    tokens delivered (the run, cut after the token that stopped it).
    """
    outputs = request.output_token_ids
    for k, token in enumerate(run):
        outputs, done = _sampled_into(config, request, token, outputs)
        if done is not None:
            return outputs, done, run[: k + 1]
    return outputs, None, run


def _running_by_id(state: SchedulerState) -> dict[str, RequestState]:
    return {request.request_id: request for request in state.running}


def plan_matches(state_mid: SchedulerState, plan: StepPlan) -> bool:
    """Whether ``plan`` can be what ``schedule`` returned beside ``state_mid``.

    Each chunk names a different running request, starts at its computed count and
    has between 1 and the request's remaining tokens. (The precondition of phase D.)
    """
    by_id = _running_by_id(state_mid)
    seen: set[str] = set()
    for chunk in plan.scheduled:
        request = by_id.get(chunk.request_id)
        if request is None or chunk.request_id in seen:
            return False
        seen.add(chunk.request_id)
        if chunk.start != request.num_computed_tokens:
            return False
        if not 1 <= chunk.num_tokens <= num_tokens_with_spec(request) - chunk.start:
            return False
    return True


def samples(request: RequestState, start: int, num_tokens: int) -> bool:
    """R10: a chunk samples a token when it brings ``computed`` up to ``num_tokens``
    (under async scheduling, plus the placeholders: vllm-v1/async-placeholders).

    That is when the prefill is complete, or for every decode (with its drafts, under
    vllm-v1/spec-drafts-scheduled, past ``num_tokens``).
    """
    end = num_tokens_with_placeholders(request)
    if request.spec_token_ids:  # its drafts (vllm-v1/spec-drafts-scheduled) lie past the end
        return start + num_tokens >= end
    return start + num_tokens == end


def sampling_request_ids(state_mid: SchedulerState, plan: StepPlan) -> tuple[str, ...]:
    """The scheduled requests that sample a token in this step, in plan order (R10).

    ``state_mid`` and ``plan`` are what ``schedule`` returned.

    Under async scheduling, the ids of the step whose outputs this step applies
    (``spec.pipeline.applied_sampling_ids``).

    pre: plan_matches(state_mid, plan)
    post: state_mid.config.async_scheduling or len(__return__) <= len(plan.scheduled)
    """
    if state_mid.config.async_scheduling:
        from spec.pipeline import applied_sampling_ids  # noqa: PLC0415  (it builds on this module)

        return applied_sampling_ids(state_mid, plan)
    by_id = _running_by_id(state_mid)
    return tuple(
        request_id
        for request_id, start, n in zip(
            plan.scheduled_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, strict=True
        )
        if samples(by_id[request_id], start, n)
    )


def step_completed(
    state_mid: SchedulerState,
    plan: StepPlan,
    tokens: Mapping[str, int],
    after: SchedulerState,
    done: StepPlan,
) -> bool:
    """``complete_step``'s contract: ``runs_completed`` with a run of one token per
    sampling request. Under async scheduling: ``spec.pipeline.async_step_completed``."""
    if state_mid.config.async_scheduling:
        from spec.pipeline import async_step_completed  # noqa: PLC0415  (it builds on this module)

        return async_step_completed(state_mid, plan, tokens, after, done)
    return runs_completed(state_mid, plan, _runs_of(tokens), after, done)


def runs_completed(
    state_mid: SchedulerState,
    plan: StepPlan,
    runs: Mapping[str, tuple[int, ...]],
    after: SchedulerState,
    done: StepPlan,
) -> bool:
    """``complete_verified_step``'s contract: GPU blocks conserved (free + in use after =
    free + in use with the chunks before) and free only grows; CPU pool, ``waiting`` and
    ``swapped`` untouched; outputs only appended, each sampling request's run (a
    finished one's cut after its stop); no running request left with ``max_tokens``
    outputs or its EOS (R10); one step more."""
    gpu_before = state_mid.num_free_gpu_blocks + blocks_in_use(state_mid, plan.scheduled)[0]
    untouched = (state_mid.num_free_cpu_blocks, state_mid.swapped, state_mid.waiting)
    return (
        after.num_free_gpu_blocks + blocks_in_use(after)[0] == gpu_before
        and after.num_free_gpu_blocks >= state_mid.num_free_gpu_blocks
        and (after.num_free_cpu_blocks, after.swapped, after.waiting) == untouched
        and outputs_extended(state_mid, runs, after, done.finished)
        and len(done.sampled) <= sum(len(run) for run in runs.values())
        and all(len(r.output_token_ids) < r.request.params.max_tokens for r in after.running)
        and not any(eos_sampled(r) for r in after.running)
        and after.num_steps == state_mid.num_steps + 1
    )


def _runs_of(tokens: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    return {request_id: (token,) for request_id, token in tokens.items()}


def complete_step(
    state_mid: SchedulerState, plan: StepPlan, tokens: Mapping[str, int]
) -> tuple[SchedulerState, StepPlan]:
    """Phase D (R10): apply the sampled tokens; finish requests; end the step.

    ``state_mid`` and ``plan`` are what ``schedule`` returned; ``tokens`` maps exactly
    the ids of ``sampling_request_ids(state_mid, plan)`` to their sampled token, else
    ``SampledTokensError`` (and nothing changes). It is ``complete_verified_step`` with
    a run of one token each (under speculative decoding: every draft rejected).

    Under async scheduling the step is ``spec.pipeline.complete_async_step``'s instead.

    pre: plan_matches(state_mid, plan)
    post: step_completed(state_mid, plan, tokens, *__return__)
    raises: SampledTokensError
    """
    if state_mid.config.async_scheduling:
        from spec.pipeline import complete_async_step  # noqa: PLC0415  (it builds on this module)

        return complete_async_step(state_mid, plan, tokens)
    return complete_verified_step(state_mid, plan, _runs_of(tokens))


def complete_verified_step(
    state_mid: SchedulerState, plan: StepPlan, runs: Mapping[str, tuple[int, ...]]
) -> tuple[SchedulerState, StepPlan]:
    """Phase D (R10, vllm-v1/spec-verify), synchronous: apply each sampling request's
    run of tokens; finish requests; end the step.

    ``runs`` maps exactly the ids of ``sampling_request_ids(state_mid, plan)`` to the
    tokens each sampled: without drafts one; with ``d`` drafts scheduled
    (``spec.speculative.drafts_scheduled``) 1 to ``d + 1``, all but the last the drafts
    accepted (``valid_run``), else ``SampledTokensError`` (and nothing changes).

    For each scheduled chunk, in plan order: ``computed += n``. If now ``computed >=
    num_tokens``, the request samples its run: ``computed`` goes back by the drafts
    rejected (``d - (len(run) - 1)``; its blocks stay, ``num_blocks_ahead``,
    vllm-v1/spec-rejected-blocks-kept), its drafts are cleared, and the tokens are
    appended to its outputs and to the plan's ``sampled`` one at a time, each followed
    by ``finish_reason``: EOS first (reason ``stop``, the token is kept), then
    ``max_tokens`` outputs or ``max_model_len`` tokens (``length``); a stop drops the
    rest of the run. A finished request leaves ``running``, all its GPU blocks are
    freed, and it is appended to the plan's ``finished`` (R3). ``num_steps`` goes up by
    one, even for an empty step. Under transformers, tokenspeed and speculative
    decoding a request that sampled is decoding (``RequestState.decoding``); under
    transformers/admission-frozen a finished request unfreezes admission.

    pre: not state_mid.config.async_scheduling
    pre: plan_matches(state_mid, plan)
    post: runs_completed(state_mid, plan, runs, *__return__)
    raises: SampledTokensError
    """
    config = state_mid.config
    bs = config.block_size
    by_id = _running_by_id(state_mid)
    updated: dict[str, RequestState | None] = {}
    sampled_ids: list[str] = []
    sampled_token_ids: list[int] = []
    finished: list[FinishedRequest] = []
    num_sampling = 0
    freed = 0
    for request_id, start, n in zip(
        plan.scheduled_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, strict=True
    ):
        request = by_id[request_id]
        end = start + n
        if end < request.num_tokens:
            updated[request_id] = replace(request, num_computed_tokens=end)
            continue
        run = runs.get(request_id)
        drafts = drafts_scheduled(request, start, n) if request.spec_token_ids else ()
        if run is None or not valid_run(drafts, tuple(run)):
            raise _tokens_mismatch(state_mid, plan, runs)
        num_sampling += 1
        computed = end - (len(drafts) - (len(run) - 1))
        outputs, done, delivered = _run_into(config, request, tuple(run))
        sampled_ids.extend(request_id for _ in delivered)
        sampled_token_ids.extend(delivered)
        if done is None:
            updated[request_id] = RequestState(
                request=request.request,
                output_token_ids=outputs,
                num_computed_tokens=computed,
                num_preemptions=request.num_preemptions,
                block_ids=request.block_ids,
                decoding=tracks_decoding(config),
                num_blocks_ahead=blocks_ahead_after(request, start, n, computed, bs)
                if drafts or request.num_blocks_ahead
                else 0,
            )
        else:
            updated[request_id] = None
            freed += gpu_blocks_owned(config, request, end)
            finished.append(done)
    if num_sampling != len(runs):
        raise _tokens_mismatch(state_mid, plan, runs)
    running = tuple(
        new for new in (updated.get(r.request_id, r) for r in state_mid.running) if new is not None
    )
    cache = state_mid.prefix_cache
    if cache is not None:
        # PC6: finished requests give up their blocks one after the other, in plan order.
        still_held = holders(state_mid.running)
        for done in finished:
            blocks = by_id[done.request_id].block_ids
            still_held.subtract(blocks)
            cache = release_blocks(config, cache, blocks, still_held)
        freed = len(cache.free_queue) - state_mid.num_free_gpu_blocks
    new_state = replace(
        state_mid,
        running=running,
        num_free_gpu_blocks=state_mid.num_free_gpu_blocks + freed,
        num_steps=state_mid.num_steps + 1,
        prefix_cache=cache,
        admission_frozen=admission_frozen_after(state_mid.admission_frozen, False, bool(finished)),
        ids_held=held_after_finish(config, tuple(f.request_id for f in finished)),
    )
    return new_state, replace(
        plan,
        sampled_ids=tuple(sampled_ids),
        sampled_token_ids=tuple(sampled_token_ids),
        finished=tuple(finished),
    )


def _tokens_mismatch(
    state_mid: SchedulerState, plan: StepPlan, tokens: Mapping[str, object]
) -> SampledTokensError:
    expected = sampling_request_ids(state_mid, plan)
    return SampledTokensError(
        f"step {plan.step}: tokens {dict(tokens)} but the sampling requests are "
        f"{sorted(expected)} (with the drafts their chunks ran: "
        f"{_scheduled_drafts(state_mid, plan)})"
    )


def _scheduled_drafts(state_mid: SchedulerState, plan: StepPlan) -> dict[str, tuple[int, ...]]:
    by_id = _running_by_id(state_mid)
    return {
        c.request_id: drafts
        for c in plan.scheduled
        if (drafts := drafts_scheduled(by_id[c.request_id], c.start, c.num_tokens))
    }


def oracle_tokens(
    state_mid: SchedulerState, plan: StepPlan, next_token: TokenOracle
) -> dict[str, int]:
    """The tokens a pure oracle samples: ``next_token(prompt + outputs so far)`` each.

    pre: plan_matches(state_mid, plan)
    post: tuple(__return__) == sampling_request_ids(state_mid, plan)
    """
    by_id = {r.request_id: r for r in (*state_mid.running, *state_mid.waiting)}
    tokens: dict[str, int] = {}
    for request_id in sampling_request_ids(state_mid, plan):
        request = by_id[request_id]
        tokens[request_id] = next_token(
            (*request.request.prompt_token_ids, *request.output_token_ids)
        )
    return tokens


def oracle_runs(
    state_mid: SchedulerState, plan: StepPlan, next_token: TokenOracle
) -> dict[str, tuple[int, ...]]:
    """What a greedy model that samples ``next_token`` returns for each sampling request
    of a synchronous step: its drafts verified (``spec.speculative.verify``), or one
    token for a chunk that ran none.

    pre: not state_mid.config.async_scheduling
    pre: plan_matches(state_mid, plan)
    post: tuple(__return__) == sampling_request_ids(state_mid, plan)
    """
    by_id = _running_by_id(state_mid)
    runs: dict[str, tuple[int, ...]] = {}
    for request_id, start, n in zip(
        plan.scheduled_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, strict=True
    ):
        request = by_id[request_id]
        if samples(request, start, n):
            runs[request_id] = verify(
                request_tokens(request), drafts_scheduled(request, start, n), next_token
            )
    return runs


def stepped(state: SchedulerState, after: SchedulerState, plan: StepPlan) -> bool:
    """``step``'s contract: ``after`` valid (every invariant, both pools conserved); the
    step valid (``check_plan``: R1-R10); the step counters and the token limit; and Rule
    P (``progress_violations``): no request waits in a step that could take it back.
    Under async scheduling each of them reads the rules of ``spec.pipeline``."""
    return (
        check_state(after)
        and check_plan(state, plan, after)
        and plan.step == state.num_steps
        and after.num_steps == state.num_steps + 1
        and plan_tokens(plan) <= step_token_limit(state.config)
        and progress_violations(state, plan) == ()
    )


def step(
    state: SchedulerState,
    tokens: Mapping[str, int] | TokenOracle,
    drafter: Drafter | None = None,
) -> tuple[SchedulerState, StepPlan]:
    """One whole step: ``schedule`` (phases A-C), then ``complete_step`` (phase D).

    ``tokens`` is either a mapping from exactly the sampling requests' ids to their
    sampled token (else ``SampledTokensError`` and nothing changes), or a pure oracle
    ``next_token(prompt + outputs so far) -> token`` called once per sampling request;
    under speculative decoding the oracle verifies each request's drafts as a greedy
    model would (``oracle_runs``), and ``drafter`` then proposes the next drafts
    (``spec.speculative.update_draft_token_ids``; without one, none are proposed).

    pre: check_state(state)
    post: stepped(state, *__return__)
    raises: SampledTokensError
    """
    state_mid, plan = schedule(state)
    if isinstance(tokens, Mapping):
        after, done = complete_step(state_mid, plan, tokens)
    elif speculative(state.config):
        after, done = complete_verified_step(state_mid, plan, oracle_runs(state_mid, plan, tokens))
    else:
        after, done = complete_step(state_mid, plan, oracle_tokens(state_mid, plan, tokens))
    if drafter is None:
        return after, done
    return update_draft_token_ids(after, done, drafter), done
