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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from spec.invariants import (  # noqa: F401  (used by the PEP 316 contracts)
    blocks_in_use,
    check_plan,
    check_state,
    eos_sampled,
    kv_conserved_mid_step,
    live_ids_sorted,
    outputs_extended,
)
from spec.kv import blocks_held, blocks_needed, cdiv, chunk_for_prefill
from spec.policies import Policy, always_admit, get_policy, select_victim
from spec.types import (
    FinishedRequest,
    FinishReason,
    Preemption,
    PreemptionMode,
    RequestState,
    SampledToken,
    SampledTokensError,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)

TokenOracle = Callable[[tuple[int, ...]], int]
"""A pure next-token function: ``next_token(prompt + outputs so far) -> token id``."""


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


def draft_violations(before: StepDraft, after: StepDraft) -> tuple[str, ...]:
    """What each of phases A-C must keep, one readable line per broken rule.

    - R2 in the middle of a step: ``kv_conserved_mid_step(after.state, after.scheduled)``
      (blocks conserved with every chunk holding its blocks; at most ``max_num_seqs``
      running);
    - R5: the plan only grows (earlier chunks, victims and swap-ins are kept); every new
      chunk has ``1 <= n <= num_tokens - computed`` tokens, starts at its request's
      computed count and names a running request; the budget goes down by exactly the
      new chunks' tokens and stays ``>= 0``;
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
    if after.budget != before.budget - sum(c.num_tokens for c in new) or after.budget < 0:
        found.append(f"R5: budget {before.budget} -> {after.budget} for {len(new)} new chunks")
    running = {r.request_id: r for r in after.state.running}
    for chunk in new:
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
    return sum(chunk.num_tokens for chunk in plan.scheduled)


# --- preemption (R6) -------------------------------------------------------------------


def can_swap_out(victim: RequestState, block_size: int, num_free_cpu_blocks: int) -> bool:
    """R6 swap: whether the victim's ``cdiv(computed, bs)`` blocks fit the free CPU blocks.

    pre: block_size >= 1
    pre: victim.num_computed_tokens >= 0
    post: __return__ == (blocks_held(victim.num_computed_tokens, block_size) <= num_free_cpu_blocks)
    """
    return blocks_held(victim.num_computed_tokens, block_size) <= num_free_cpu_blocks


def swap_out(victim: RequestState) -> RequestState:
    """R6 swap: the victim keeps ``computed`` and its outputs; its blocks move to the CPU.

    post: __return__.num_computed_tokens == victim.num_computed_tokens
    post: __return__.output_token_ids == victim.output_token_ids
    post: __return__.num_preemptions == victim.num_preemptions + 1
    """
    return replace(victim, num_preemptions=victim.num_preemptions + 1)


def recompute(victim: RequestState) -> RequestState:
    """R6 recompute: ``computed = 0``, outputs kept; it re-prefills prompt + outputs.

    post: __return__.num_computed_tokens == 0
    post: __return__.output_token_ids == victim.output_token_ids
    post: __return__.num_preemptions == victim.num_preemptions + 1
    """
    return replace(victim, num_computed_tokens=0, num_preemptions=victim.num_preemptions + 1)


def restart(victim: RequestState) -> RequestState:
    """R6 restart: ``computed = 0`` and the outputs are discarded (the seed tutorial).

    post: __return__.num_computed_tokens == 0
    post: __return__.output_token_ids == ()
    post: __return__.num_preemptions == victim.num_preemptions + 1
    """
    return replace(
        victim,
        output_token_ids=(),
        num_computed_tokens=0,
        num_preemptions=victim.num_preemptions + 1,
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

    post: __return__[0].num_preemptions == victim.num_preemptions + 1
    post: __return__[1] == config.preemption_mode or __return__[1] == PreemptionMode.RECOMPUTE
    post: __return__[1] != PreemptionMode.SWAP or __return__[0].num_computed_tokens == victim.num_computed_tokens
    post: __return__[1] == PreemptionMode.SWAP or __return__[0].num_computed_tokens == 0
    """  # noqa: E501
    mode = config.preemption_mode
    if mode is PreemptionMode.SWAP and can_swap_out(victim, config.block_size, num_free_cpu_blocks):
        return swap_out(victim), PreemptionMode.SWAP
    if mode is PreemptionMode.RESTART:
        return restart(victim), PreemptionMode.RESTART
    return recompute(victim), PreemptionMode.RECOMPUTE


def release_victim(
    victim: RequestState, config: SchedulerConfig, free: int, free_cpu: int
) -> tuple[RequestState, PreemptionMode, int, int]:
    """R6 with its block accounting: preempt a running ``victim`` when ``free`` GPU and
    ``free_cpu`` CPU blocks are free; return it after, the mode used, and the free
    counts after.

    All its ``cdiv(computed, bs)`` GPU blocks are given back; a swapped victim takes
    the CPU blocks for its (kept) computed tokens, which it fits by ``preempt``'s choice.
    Blocks are conserved: what the GPU pool gets back and the CPU pool gives are exactly
    what the victim held before and holds after.

    pre: victim.num_computed_tokens >= 0
    pre: free >= 0 and free_cpu >= 0
    post: __return__[2] == free + blocks_held(victim.num_computed_tokens, config.block_size)
    post: __return__[3] >= 0 and __return__[3] + (blocks_held(__return__[0].num_computed_tokens, config.block_size) if __return__[1] is PreemptionMode.SWAP else 0) == free_cpu
    """  # noqa: E501
    bs = config.block_size
    free += blocks_held(victim.num_computed_tokens, bs)
    after, mode = preempt(victim, config, free_cpu)
    if mode is PreemptionMode.SWAP:
        free_cpu -= blocks_held(after.num_computed_tokens, bs)
    return after, mode, free, free_cpu


# --- phase A: running requests (R5) ---------------------------------------------------


def choose_victim(policy: Policy, running: tuple[RequestState, ...], i: int) -> int:
    """R5 step 3: the index in ``running`` of the victim when ``running[i]`` needs blocks.

    The candidates are ``running[i:]``: the current request and the ones after it,
    never one already scheduled in this step; the victim is the one the policy names.

    pre: 0 <= i < len(running)
    post: i <= __return__ < len(running)
    post: __return__ == i + policy.select_victim(running[i:])
    """
    return i + select_victim(policy, running[i:])


def schedule_running(draft: StepDraft) -> StepDraft:
    """Phase A (R5): serve ``running`` from the head, preempting when blocks run out.

    Walk ``running`` from the head, index ``i``, while ``i < len(running)`` and
    ``budget > 0``:

    1. ``n = min(num_tokens - computed, budget)`` (a decode is 1 token; a request in the
       middle of a chunked prefill takes the rest of its prompt, capped by the budget);
    2. ``need = cdiv(computed + n, bs) - cdiv(computed, bs)``;
    3. while ``need > free``: the policy picks a victim among the candidates
       ``running[i:]`` (never one already scheduled in this step) and it is preempted
       (R6); if the victim is the current request itself, phase A ends;
    4. otherwise schedule chunk ``(running[i], n)`` and go on with ``i + 1``.

    Requests left when the budget runs out are not scheduled in this step. Victims go
    to the front of ``waiting`` one by one as they are preempted (so under ``lifo``
    the victims of one step stay in admission order there), or, swapped, to the tail
    of ``swapped``.

    Phase A is the first phase: it starts from a state between steps and the whole
    budget.

    pre: check_state(draft.state)
    pre: draft.budget == draft.state.config.max_num_batched_tokens
    pre: draft.scheduled == () and draft.preempted == () and draft.swapped_in == ()
    post: (draft_violations(draft, __return__) == ()) and ([c.request_id for c in __return__.scheduled] == [r.request_id for r in __return__.state.running[: len(__return__.scheduled)]] and len(__return__.state.running) + len(__return__.preempted) == len(draft.state.running)) and ([r.request_id for r in __return__.state.waiting] == [p.request_id for p in reversed(__return__.preempted) if p.mode is not PreemptionMode.SWAP] + [r.request_id for r in draft.state.waiting] and [r.request_id for r in __return__.state.swapped] == [r.request_id for r in draft.state.swapped] + [p.request_id for p in __return__.preempted if p.mode is PreemptionMode.SWAP])
    """  # noqa: E501
    state = draft.state
    config = state.config
    policy = get_policy(config.policy)
    bs = config.block_size
    running = list(state.running)
    chunks: list[ScheduledChunk] = []
    preempted: list[Preemption] = []
    to_waiting: list[RequestState] = []  # in preemption order; each goes to the front
    to_swapped: list[RequestState] = []
    free = state.num_free_gpu_blocks
    free_cpu = state.num_free_cpu_blocks
    budget = draft.budget
    i = 0
    phase_over = False
    while not phase_over and i < len(running) and budget > 0:
        request = running[i]
        computed = request.num_computed_tokens
        n = min(request.num_tokens - computed, budget)
        need = blocks_needed(computed, n, bs)
        while need > free:
            k = choose_victim(policy, tuple(running), i)
            victim = running.pop(k)
            after, mode, free, free_cpu = release_victim(victim, config, free, free_cpu)
            preempted.append(Preemption(request_id=victim.request_id, mode=mode))
            if mode is PreemptionMode.SWAP:
                to_swapped.append(after)
            else:
                to_waiting.append(after)
            if k == i:
                phase_over = True
                break
        if not phase_over:
            chunks.append(
                ScheduledChunk(request_id=request.request_id, start=computed, num_tokens=n)
            )
            budget -= n
            free -= need
            i += 1
    if not preempted:
        new_state = replace(state, num_free_gpu_blocks=free)
    else:
        new_state = replace(
            state,
            running=tuple(running),
            waiting=(*reversed(to_waiting), *state.waiting),
            swapped=(*state.swapped, *to_swapped),
            num_free_gpu_blocks=free,
            num_free_cpu_blocks=free_cpu,
        )
    return replace(
        draft,
        state=new_state,
        budget=budget,
        scheduled=(*draft.scheduled, *chunks),
        preempted=(*draft.preempted, *preempted),
    )


# --- phase B: swapping in (R7) ---------------------------------------------------------


def prefill_fit(request: RequestState, budget: int, free: int, config: SchedulerConfig) -> int:
    """R7 steps 2-3 and R8 steps 2-3: the chunk a swapped or waiting request gets, or 0.

    ``n = chunk_for_prefill(num_tokens - computed, budget, chunked)``; it does not fit
    (0) if ``n > budget`` (an unchunked prefill larger than what is left) or if its
    ``cdiv(computed + n, bs)`` GPU blocks (a waiting request has ``computed == 0``; a
    swapped one gets back the blocks of its computed prefix too) exceed ``free``.

    pre: budget >= 1 and free >= 0
    pre: 0 <= request.num_computed_tokens < request.num_tokens
    post: __return__ == 0 or (1 <= __return__ <= min(budget, request.num_tokens - request.num_computed_tokens) and blocks_held(request.num_computed_tokens + __return__, config.block_size) <= free)
    """  # noqa: E501
    computed = request.num_computed_tokens
    n = chunk_for_prefill(request.num_tokens - computed, budget, config.enable_chunked_prefill)
    if n > budget or blocks_held(computed + n, config.block_size) > free:
        return 0
    return n


def swap_in_requests(draft: StepDraft) -> StepDraft:
    """Phase B (R7): bring swapped requests back, head first, while they fit.

    Only if nothing was preempted in this step. Walk ``swapped`` from the head and stop
    at the first request that does not fit (head-of-line):

    1. stop if ``len(running) >= max_num_seqs`` or ``budget == 0``;
    2. ``remaining = num_tokens - computed``; ``n = min(remaining, budget)`` with chunked
       prefill on, else ``n = remaining``, and stop if ``n > budget``;
    3. stop if ``cdiv(computed + n, bs) > free``;
    4. else its CPU blocks are freed, it gets ``cdiv(computed + n, bs)`` GPU blocks (its
       K/V is copied back into the first ``cdiv(computed, bs)``), it goes to the tail of
       ``running``, its id is appended to ``swapped_in`` and chunk (r, n) is scheduled.

    Its input is a mid-step value: blocks conserved with the chunks scheduled so far
    holding theirs, and what is left of the budget.

    pre: kv_conserved_mid_step(draft.state, draft.scheduled)
    pre: 0 <= draft.budget <= draft.state.config.max_num_batched_tokens
    post: (draft_violations(draft, __return__) == ()) and (__return__.swapped_in == draft.swapped_in + tuple(r.request_id for r in draft.state.swapped[: len(__return__.swapped_in) - len(draft.swapped_in)]))
    """  # noqa: E501
    state = draft.state
    if draft.preempted or not state.swapped:
        return draft
    config = state.config
    bs = config.block_size
    free = state.num_free_gpu_blocks
    free_cpu = state.num_free_cpu_blocks
    budget = draft.budget
    room = config.max_num_seqs - len(state.running)
    moved: list[RequestState] = []
    chunks: list[ScheduledChunk] = []
    for request in state.swapped:
        if len(moved) >= room or budget == 0:
            break
        n = prefill_fit(request, budget, free, config)
        if n == 0:
            break
        computed = request.num_computed_tokens
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


def admit_waiting(draft: StepDraft) -> StepDraft:
    """Phase C (R8): admit waiting requests in the policy's order while they fit.

    Only if nothing was preempted in this step (anti-thrash, vLLM V1) and ``swapped``
    is empty (swapped requests are served before new work, vLLM V0). Walk the waiting
    requests in the policy's order (R9); stop at the first that does not fit:

    1. stop if ``len(running) >= max_num_seqs`` or ``budget == 0``;
    2. ``n = min(num_tokens, budget)`` with chunked prefill on, else ``n = num_tokens``,
       and stop if ``n > budget``;
    3. stop if ``cdiv(n, bs) > free``, or if the policy's admission gate refuses it;
    4. else it leaves ``waiting``, goes to the tail of ``running``, and chunk (r, n) is
       scheduled (a preempted request re-prefills prompt + kept outputs).

    ``waiting`` keeps its stored order, minus the admitted requests. The gate sees the
    mid-step state with the requests admitted before it in this step. Its input is a
    mid-step value, as for ``swap_in_requests``.

    pre: kv_conserved_mid_step(draft.state, draft.scheduled)
    pre: 0 <= draft.budget <= draft.state.config.max_num_batched_tokens
    post: (draft_violations(draft, __return__) == ()) and ([r.request_id for r in __return__.state.waiting] == [r.request_id for r in draft.state.waiting if r.request_id not in {c.request_id for c in __return__.scheduled}] and (__return__ == draft or not (draft.preempted or draft.state.swapped)))
    """  # noqa: E501
    state = draft.state
    if draft.preempted or state.swapped or not state.waiting:
        return draft
    config = state.config
    policy = get_policy(config.policy)
    bs = config.block_size
    free = state.num_free_gpu_blocks
    budget = draft.budget
    running = list(state.running)
    admitted: set[str] = set()
    chunks: list[ScheduledChunk] = []
    for request in policy.order_waiting(state.waiting):
        if len(running) >= config.max_num_seqs or budget == 0:
            break
        n = prefill_fit(request, budget, free, config)
        if n == 0:
            break
        gpu_blocks = cdiv(n, bs)
        # The default gate never refuses; skip building the view it would ignore.
        if policy.can_admit is not always_admit and not policy.can_admit(
            _admission_view(state, running, admitted, free), request, n
        ):
            break
        free -= gpu_blocks
        budget -= n
        running.append(request)
        admitted.add(request.request_id)
        chunks.append(ScheduledChunk(request_id=request.request_id, start=0, num_tokens=n))
    if not chunks:
        return draft
    new_state = _admission_view(state, running, admitted, free)
    return replace(draft, state=new_state, budget=budget, scheduled=(*draft.scheduled, *chunks))


def _admission_view(
    state: SchedulerState, running: list[RequestState], admitted: set[str], free: int
) -> SchedulerState:
    """The mid-step state after admitting ``admitted`` (now at the tail of ``running``)."""
    return replace(
        state,
        running=tuple(running),
        waiting=tuple(r for r in state.waiting if r.request_id not in admitted),
        num_free_gpu_blocks=free,
    )


# --- phases A-C together ---------------------------------------------------------------


def schedule(state: SchedulerState) -> tuple[SchedulerState, StepPlan]:
    """Phases A-C of a step: decide what runs and allocate its blocks (R5-R8).

    The plan has ``step = state.num_steps`` and empty ``sampled`` / ``finished``.

    The returned state is an **intermediate value**, not a state between steps: the
    blocks of every scheduled chunk are already taken and the queues are as decided,
    but no ``num_computed_tokens`` has advanced and ``num_steps`` has not moved, so a
    scheduled request owns ``cdiv(computed + n, bs)`` blocks rather than the
    ``cdiv(computed, bs)`` of R2 and ``state_violations`` does not apply to it. Pass it
    only to ``sampling_request_ids`` and ``complete_step``.

    pre: check_state(state)
    post: (plan_tokens(__return__[1]) <= state.config.max_num_batched_tokens and __return__[1].step == state.num_steps and __return__[1].sampled == () and __return__[1].finished == () and (not __return__[1].preempted or __return__[1].swapped_in == ())) and (kv_conserved_mid_step(__return__[0], __return__[1].scheduled) and live_ids_sorted(__return__[0]) == live_ids_sorted(state))
    """  # noqa: E501
    draft = StepDraft(state=state, budget=state.config.max_num_batched_tokens)
    draft = admit_waiting(swap_in_requests(schedule_running(draft)))
    plan = StepPlan(
        step=state.num_steps,
        scheduled=draft.scheduled,
        preempted=draft.preempted,
        swapped_in=draft.swapped_in,
    )
    return draft.state, plan


# --- phase D: sampled tokens and finishing (R10) ---------------------------------------


def finish_reason(params: SamplingParams, token: int, num_outputs: int) -> FinishReason | None:
    """R10: why a request that just sampled ``token`` (now its ``num_outputs``-th) stops.

    ``stop`` if the token is its ``eos_token_id`` and ``ignore_eos`` is false (checked
    first, so an EOS as the last allowed token is ``stop``; the EOS token is part of
    the output); otherwise ``length`` once it has ``max_tokens`` outputs; else None.

    pre: num_outputs >= 1
    post: __return__ != FinishReason.LENGTH or num_outputs >= params.max_tokens
    post: __return__ is not None or num_outputs < params.max_tokens
    """
    if not params.ignore_eos and params.eos_token_id is not None and token == params.eos_token_id:
        return FinishReason.STOP
    if num_outputs >= params.max_tokens:
        return FinishReason.LENGTH
    return None


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
        if not 1 <= chunk.num_tokens <= request.num_tokens - chunk.start:
            return False
    return True


def samples(request: RequestState, chunk: ScheduledChunk) -> bool:
    """R10: a chunk samples a token when it brings ``computed`` up to ``num_tokens``.

    That is when the prefill is complete, or for every decode.
    """
    return chunk.start + chunk.num_tokens == request.num_tokens


def sampling_request_ids(state_mid: SchedulerState, plan: StepPlan) -> tuple[str, ...]:
    """The scheduled requests that sample a token in this step, in plan order (R10).

    ``state_mid`` and ``plan`` are what ``schedule`` returned.

    pre: plan_matches(state_mid, plan)
    post: len(__return__) <= len(plan.scheduled)
    """
    by_id = _running_by_id(state_mid)
    return tuple(
        chunk.request_id for chunk in plan.scheduled if samples(by_id[chunk.request_id], chunk)
    )


def complete_step(
    state_mid: SchedulerState, plan: StepPlan, tokens: Mapping[str, int]
) -> tuple[SchedulerState, StepPlan]:
    """Phase D (R10): apply the sampled tokens; finish requests; end the step.

    ``state_mid`` and ``plan`` are what ``schedule`` returned; ``tokens`` maps exactly
    the ids of ``sampling_request_ids(state_mid, plan)`` to their sampled token, else
    ``SampledTokensError`` (and nothing changes).

    For each scheduled chunk, in plan order: ``computed += n``. If now
    ``computed == num_tokens``, the request samples one token, appended to its outputs
    and to the plan's ``sampled``. Then it finishes (``finish_reason``): EOS first
    (reason ``stop``, the token is kept), then ``max_tokens`` outputs (``length``). A
    finished request leaves ``running``, its ``cdiv(computed, bs)`` GPU blocks are
    freed, and it is appended to the plan's ``finished`` (R3). ``num_steps`` goes up by
    one, even for an empty step.

    pre: plan_matches(state_mid, plan)
    post: (__return__[0].num_free_gpu_blocks + blocks_in_use(__return__[0])[0] == state_mid.num_free_gpu_blocks + blocks_in_use(state_mid, plan.scheduled)[0] and __return__[0].num_free_gpu_blocks >= state_mid.num_free_gpu_blocks and (__return__[0].num_free_cpu_blocks, __return__[0].swapped, __return__[0].waiting) == (state_mid.num_free_cpu_blocks, state_mid.swapped, state_mid.waiting)) and (outputs_extended(state_mid, tokens, __return__[0], __return__[1].finished) and len(__return__[1].sampled) == len(tokens)) and (all(len(r.output_token_ids) < r.request.params.max_tokens and not eos_sampled(r) for r in __return__[0].running) and __return__[0].num_steps == state_mid.num_steps + 1)
    raises: SampledTokensError
    """  # noqa: E501
    by_id = _running_by_id(state_mid)
    bs = state_mid.config.block_size
    updated: dict[str, RequestState | None] = {}
    sampled: list[SampledToken] = []
    finished: list[FinishedRequest] = []
    freed = 0
    for chunk in plan.scheduled:
        request = by_id[chunk.request_id]
        computed = chunk.start + chunk.num_tokens
        if computed < request.num_tokens:
            updated[chunk.request_id] = replace(request, num_computed_tokens=computed)
            continue
        token = tokens.get(chunk.request_id)
        if token is None:
            raise _tokens_mismatch(state_mid, plan, tokens)
        outputs = (*request.output_token_ids, token)
        sampled.append(SampledToken(request_id=chunk.request_id, token_id=token))
        reason = finish_reason(request.request.params, token, len(outputs))
        if reason is None:
            updated[chunk.request_id] = RequestState(
                request=request.request,
                output_token_ids=outputs,
                num_computed_tokens=computed,
                num_preemptions=request.num_preemptions,
            )
        else:
            updated[chunk.request_id] = None
            freed += blocks_held(computed, bs)
            finished.append(
                FinishedRequest(
                    request_id=chunk.request_id,
                    output_token_ids=outputs,
                    finish_reason=reason,
                    num_preemptions=request.num_preemptions,
                )
            )
    if len(sampled) != len(tokens):
        raise _tokens_mismatch(state_mid, plan, tokens)
    running = tuple(
        new for new in (updated.get(r.request_id, r) for r in state_mid.running) if new is not None
    )
    new_state = replace(
        state_mid,
        running=running,
        num_free_gpu_blocks=state_mid.num_free_gpu_blocks + freed,
        num_steps=state_mid.num_steps + 1,
    )
    return new_state, replace(plan, sampled=tuple(sampled), finished=tuple(finished))


def _tokens_mismatch(
    state_mid: SchedulerState, plan: StepPlan, tokens: Mapping[str, int]
) -> SampledTokensError:
    expected = sampling_request_ids(state_mid, plan)
    return SampledTokensError(
        f"step {plan.step}: tokens for {sorted(tokens)} but the sampling requests are "
        f"{sorted(expected)}"
    )


def oracle_tokens(
    state_mid: SchedulerState, plan: StepPlan, next_token: TokenOracle
) -> dict[str, int]:
    """The tokens a pure oracle samples: ``next_token(prompt + outputs so far)`` each.

    pre: plan_matches(state_mid, plan)
    post: tuple(__return__) == sampling_request_ids(state_mid, plan)
    """
    by_id = _running_by_id(state_mid)
    tokens: dict[str, int] = {}
    for request_id in sampling_request_ids(state_mid, plan):
        request = by_id[request_id]
        tokens[request_id] = next_token(
            (*request.request.prompt_token_ids, *request.output_token_ids)
        )
    return tokens


def step(
    state: SchedulerState, tokens: Mapping[str, int] | TokenOracle
) -> tuple[SchedulerState, StepPlan]:
    """One whole step: ``schedule`` (phases A-C), then ``complete_step`` (phase D).

    ``tokens`` is either a mapping from exactly the sampling requests' ids to their
    sampled token (else ``SampledTokensError`` and nothing changes), or a pure oracle
    ``next_token(prompt + outputs so far) -> token`` called once per sampling request.

    pre: check_state(state)
    post: (check_state(__return__[0])) and (check_plan(state, __return__[1], __return__[0]) and __return__[1].step == state.num_steps and __return__[0].num_steps == state.num_steps + 1 and plan_tokens(__return__[1]) <= state.config.max_num_batched_tokens)
    raises: SampledTokensError
    """  # noqa: E501
    state_mid, plan = schedule(state)
    if isinstance(tokens, Mapping):
        return complete_step(state_mid, plan, tokens)
    return complete_step(state_mid, plan, oracle_tokens(state_mid, plan, tokens))
