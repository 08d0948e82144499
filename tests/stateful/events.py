"""The coverage events of a step, computed from the spec's states (both sides were just
found to agree on them), so they say what the rules of docs/semantics.md did, not what the
system under test reports: ``before`` the step, ``mid`` (after its decisions,
``spec.schedule``), its ``plan`` and the state ``after`` it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import spec
from spec.kv import cdiv, chunk_for_prefill
from spec.pipeline import applied_batch
from spec.prefix_cache import longest_hit, num_evictable, request_tokens
from spec.profiles import (
    capped,
    in_flight_reaches_the_end,
    long_prefill_cap,
    speculative,
    stale_output_in_flight,
)
from spec.scheduler import first_draft, schedule_running
from spec.speculative import PAD, drafts_scheduled, num_accepted
from spec.types import (
    FinishReason,
    PreemptionMode,
    RequestState,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
    watermark_blocks,
)
from tests.stateful.coverage import (
    GATE_HIT_EVENT,
    UNDONE_PREFILL_EVENT,
    UNDONE_VICTIM_EVENT,
    WATERMARK_EVENT,
)
from tests.stateful.nano_cache import nano_cache_events
from tests.stateful.offload_reserve_events import STEP_RULES, offload_reserve_events


def abort_label(queue: str, request: RequestState) -> str:
    if queue == "running":
        if request.num_tokens - request.num_computed_tokens > 1:
            return "abort: running mid-prefill"
        return "abort: running (decoding)"
    if queue == "waiting" and request.num_preemptions > 0:
        return "abort: waiting after a preemption"
    return f"abort: {queue}"


def preempts_only_by_v0s_count(before: SchedulerState, plan: StepPlan) -> bool:
    """Whether phase A preempted under vllm-v0/append-touches-last-block where R5's own
    count (the blocks a chunk takes) would not have: the same state under kvsched."""
    if not plan.preempted:
        return False
    config = replace(before.config, semantics=Semantics.KVSCHED, max_model_len=None)
    return not schedule_running(first_draft(replace(before, config=config))).preempted


def watermark_refused(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> bool:
    """Whether vllm-v0/watermark held back the head phase B or C stopped at: its blocks
    were free, but not with the watermark's left over (seats and budget permitting)."""
    config = before.config
    watermark = watermark_blocks(config.num_gpu_blocks)
    if not watermark or plan.preempted:
        return False
    bs = config.block_size
    admitted = any(r.request_id in plan.scheduled_ids for r in before.waiting)
    if before.swapped:  # phase B ran last, on mid's pool
        head, state = (mid.swapped[0], mid) if mid.swapped else (None, mid)
    elif admitted:  # a prefill step: phase C ran alone, mid is what it left
        head, state = (mid.waiting[0], mid) if mid.waiting else (None, mid)
    else:  # phase C ran first, on the whole pool, and admitted nobody
        head, state = (before.waiting[0], before) if before.waiting else (None, before)
    if head is None or len(state.running) >= config.max_num_seqs:
        return False
    used = sum(plan.num_scheduled_tokens) if state is mid else 0
    n = head.num_tokens - head.num_computed_tokens
    need = cdiv(head.num_computed_tokens + n, bs)
    free = state.num_free_gpu_blocks
    return n <= config.max_num_batched_tokens - used and need <= free < need + watermark


def undone_chunks(before: SchedulerState) -> tuple[str, ...]:
    """The victims whose chunk phase A of this step undid (the spec's draft says)."""
    return schedule_running(first_draft(before)).undone


def long_prefill_cap_events(
    before: SchedulerState, mid: SchedulerState, plan: StepPlan
) -> Iterator[str]:
    """vllm-v1/long-prefill-cap's events: a chunk cut to the step's cap though more of
    its request was left (with chunked prefill off too), the adaptive floor above the
    threshold, and a lone request's chunk left longer than the threshold."""
    cap = long_prefill_cap(before)
    config = before.config
    threshold = config.long_prefill_token_threshold
    if not cap:
        if threshold and any(chunk.num_tokens > threshold for chunk in plan.scheduled):
            yield "vllm-v1/long-prefill-cap: a lone request's chunk over the threshold, uncut"
        return
    if cap > threshold:
        yield "vllm-v1/long-prefill-cap: the adaptive floor raised the cap"
    running = {r.request_id: r for r in mid.running}
    for chunk in plan.scheduled:
        if chunk.num_tokens == cap < running[chunk.request_id].num_tokens - chunk.start:
            yield "vllm-v1/long-prefill-cap: a chunk cut to the cap"
            if not config.enable_chunked_prefill:
                yield "vllm-v1/long-prefill-cap: a prompt chunked with chunked prefill off"


#: vllm-v1/async-*'s events (spec.pipeline), the first four required of the vLLM machine.
ASYNC_PREEMPT_EVENT = "vllm-v1/async-stale-output: a victim preempted with its step in flight"
ASYNC_EOS_EVENT = "vllm-v1/async-discard: an EOS applied with the request's next step in flight"
ASYNC_ABORT_EVENT = "vllm-v1/async-discard: an abort with the request's step in flight"
ASYNC_MAX_TOKENS_EVENT = "vllm-v1/async-max-tokens: phase A walked past a request at its end"
ASYNC_DELIVERED_EVENT = "vllm-v1/async-stale-output: a stale output delivered while it waits"
ASYNC_STALE_STOP_EVENT = "vllm-v1/async-stale-output: a stale stop finished a waiting victim"
ASYNC_STALE_SKIP_EVENT = "vllm-v1/async-stale-output: admission walked past a stale request"
ASYNC_DROPPED_EVENT = "vllm-v1/async-discard: the output of a request gone dropped"

#: What our machines (spec vs engine) require where vllm-v1 configs draw async
#: scheduling (impl/pipeline.py): a preemption, an EOS and an abort each with a step in
#: flight, a stale output delivered, and phase A walking past a request its step in
#: flight ends.
ASYNC_EVENTS = frozenset(
    {
        "config: async scheduling",
        ASYNC_PREEMPT_EVENT,
        ASYNC_EOS_EVENT,
        ASYNC_ABORT_EVENT,
        ASYNC_MAX_TOKENS_EVENT,
        ASYNC_DELIVERED_EVENT,
    }
)


def async_events(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> Iterator[str]:
    """vllm-v1/async-*'s events: what the step applied (``applied_batch``) and decided."""
    in_flight = {r.request_id for r in before.running if r.num_in_flight_tokens}
    if any(p.request_id in in_flight for p in plan.preempted):
        yield ASYNC_PREEMPT_EVENT
    if any(in_flight_reaches_the_end(before.config, r) for r in before.running):
        yield ASYNC_MAX_TOKENS_EVENT
    waiting = {r.request_id for r in mid.waiting}
    if any(rid in waiting for rid in plan.sampled_ids):
        yield ASYNC_DELIVERED_EVENT
    for finished in plan.finished:
        if finished.request_id in waiting:
            yield ASYNC_STALE_STOP_EVENT
        elif finished.finish_reason is FinishReason.STOP and finished.request_id in (
            plan.scheduled_ids
        ):
            yield ASYNC_EOS_EVENT
    admitted = [r.request_id for r in before.waiting if r.request_id in plan.scheduled_ids]
    order = spec.get_policy(before.config.policy).order_waiting(before.waiting)
    ids = [r.request_id for r in order]
    if admitted and any(
        stale_output_in_flight(r) and ids.index(r.request_id) < ids.index(admitted[-1])
        for r in order
    ):
        yield ASYNC_STALE_SKIP_EVENT
    applied = applied_batch(mid, plan)
    live = {r.request_id for r in (*mid.running, *mid.waiting)}
    if applied is not None and any(c.request_id not in live for c in applied.scheduled):
        yield ASYNC_DROPPED_EVENT


#: vllm-v1/spec-*'s events (spec.speculative), required of the vLLM machines where
#: their configs draw speculative decoding: each outcome of a verify step, a padded
#: admission, a preemption beside drafts, and a stop inside an accepted run.
SPEC_EVENTS = frozenset(
    {
        "config: speculative decoding",
        "vllm-v1/spec-verify: every draft accepted",
        "vllm-v1/spec-verify: no draft accepted",
        "vllm-v1/spec-verify: some drafts accepted",
        "vllm-v1/spec-drafts-scheduled: a chunk cut short of its drafts",
        "vllm-v1/spec-padded-new-decode: an admission padded",
        "vllm-v1/spec-drafts-scheduled: a preemption in a step with drafts",
        "vllm-v1/spec-verify: EOS inside an accepted run",
        "vllm-v1/spec-verify: max_tokens reached inside an accepted run",
    }
)


def spec_events(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> Iterator[str]:
    """vllm-v1/spec-*'s events: what each chunk's drafts came to."""
    runs = spec.plan_runs(plan)
    reasons = {f.request_id: f.finish_reason for f in plan.finished}
    scheduled = {r.request_id: r for r in mid.running}
    with_drafts = False
    for chunk in plan.scheduled:
        request = scheduled[chunk.request_id]
        drafts = drafts_scheduled(request, chunk.start, chunk.num_tokens)
        if len(drafts) < len(request.spec_token_ids) and PAD not in request.spec_token_ids:
            yield "vllm-v1/spec-drafts-scheduled: a chunk cut short of its drafts"
        if not drafts:
            continue
        with_drafts = True
        if PAD in drafts:
            yield "vllm-v1/spec-padded-new-decode: an admission padded"
            continue
        run = runs.get(chunk.request_id, ())
        reason = reasons.get(chunk.request_id)
        if reason is not None and run and num_accepted(drafts, run) == len(run):
            yield (
                "vllm-v1/spec-verify: EOS inside an accepted run"
                if reason is FinishReason.STOP
                else "vllm-v1/spec-verify: max_tokens reached inside an accepted run"
            )
        elif reason is None:
            accepted = len(run) - 1
            if accepted == len(drafts):
                yield "vllm-v1/spec-verify: every draft accepted"
            elif accepted == 0:
                yield "vllm-v1/spec-verify: no draft accepted"
            else:
                yield "vllm-v1/spec-verify: some drafts accepted"
    if plan.preempted and (with_drafts or any(r.spec_token_ids for r in before.running)):
        yield "vllm-v1/spec-drafts-scheduled: a preemption in a step with drafts"


def full_sequence_gate_refused(
    before: SchedulerState, mid: SchedulerState, plan: StepPlan
) -> int | None:
    """Whether phase C stopped at a request whose chunk (cut to the step's
    vllm-v1/long-prefill-cap) fit but whose whole sequence did not
    (vllm-v1/full-sequence-admission), with budget and a seat left: the blocks the
    request hit (PC3; 0 with caching off), or None if the gate held nobody back."""
    config = mid.config
    budget = config.max_num_batched_tokens - sum(plan.num_scheduled_tokens)
    if plan.preempted or not mid.waiting or budget == 0:
        return None
    if len(mid.running) >= config.max_num_seqs:
        return None
    head = spec.get_policy(config.policy).order_waiting(mid.waiting)[0]
    bs = config.block_size
    hit: tuple[int, ...] = ()
    evictable = 0
    if mid.prefix_cache is not None:  # -hits: the hit is credited, its free blocks charged
        hit = longest_hit(mid.prefix_cache, request_tokens(head), bs)
        evictable = num_evictable(mid.prefix_cache, hit)
    start = len(hit) * bs
    remaining = capped(head.num_tokens - start, long_prefill_cap(before))
    n = chunk_for_prefill(remaining, budget, config.enable_chunked_prefill)
    free = mid.num_free_gpu_blocks + len(hit) - evictable
    if n <= budget and cdiv(start + n, bs) <= free < cdiv(head.num_tokens, bs):
        return len(hit)
    return None


def step_events(
    config: SchedulerConfig, before: SchedulerState, plan: StepPlan, after: SchedulerState
) -> Iterator[str]:
    """The coverage events of one step (``before`` it, its ``plan``, the state ``after``)."""
    index = {r.request_id: r for r in (*before.waiting, *before.running, *before.swapped)}
    for preemption in plan.preempted:
        yield f"preempt: {preemption.mode}"
        if (
            config.preemption_mode is PreemptionMode.SWAP
            and preemption.mode is PreemptionMode.RECOMPUTE
        ):
            yield "preempt: swap fell back to recompute (CPU pool full)"
    if len(plan.preempted) > 1:
        yield "preempt: several victims in one step"
    if plan.preempted and before.waiting:
        yield "admission held back by a preemption"
    if plan.swapped_in:
        yield "swap-in"
    for chunk in plan.scheduled:
        request = index[chunk.request_id]
        if chunk.start + chunk.num_tokens < request.num_tokens:
            yield "chunked prefill: partial chunk"
        elif chunk.start > 0 and chunk.num_tokens > 1:
            yield "chunked prefill: last chunk of a resumed prefill"
        if chunk.start == 0 and request.output_token_ids and chunk.num_tokens > 1:
            yield "re-prefill of prompt + kept outputs"
    for sampled in plan.sampled:
        params = index[sampled.request_id].request.params
        if params.ignore_eos and sampled.token_id == params.eos_token_id:
            yield "finish: EOS sampled but ignored"
    for finished in plan.finished:
        yield f"finish: {finished.finish_reason}"
    if len(after.running) == config.max_num_seqs and after.waiting:
        yield "max_num_seqs reached with requests waiting"


def profile_events(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> Iterator[str]:
    """Events for the profile rules that made a difference in a step: ``before`` it,
    ``mid`` (after the decisions), its ``plan`` (its decisions suffice)."""
    config = before.config
    if config.semantics is Semantics.KVSCHED:
        return
    if config.semantics in STEP_RULES:
        yield from offload_reserve_events(before, mid, plan)
        return
    admitted = [r.request_id for r in before.waiting if r.request_id in plan.scheduled_ids]
    if config.semantics in (Semantics.VLLM_V1, Semantics.VLLM_V0):
        for finished in plan.finished:
            outputs = len(finished.output_token_ids)
            # (Under async scheduling a victim's stale stop finishes it from waiting.)
            request = next(
                r for r in (*mid.running, *mid.waiting) if r.request_id == finished.request_id
            )
            if (
                finished.finish_reason is FinishReason.LENGTH
                and outputs < request.request.params.max_tokens
            ):
                yield f"{config.semantics}/max-model-len: length at max_model_len"
    if config.semantics is Semantics.VLLM_V0:
        if admitted and before.running:
            yield "vllm-v0/prefill-first: a prefill-only step with requests running"
        if (
            before.swapped
            and before.waiting
            and len(plan.swapped_in) == len(before.swapped)
            and len(mid.running) < config.max_num_seqs
        ):
            yield "vllm-v0/prefill-first: no admission after every swapped request came back"
        if watermark_refused(before, mid, plan):
            yield WATERMARK_EVENT
        if preempts_only_by_v0s_count(before, plan):
            yield "vllm-v0/append-touches-last-block: a preemption R5 would not have made"
        return
    if config.semantics is Semantics.VLLM_V1:
        undone = undone_chunks(before) if plan.preempted else ()
        if undone:
            yield UNDONE_VICTIM_EVENT
        running = {r.request_id: r for r in before.running}
        if config.enable_prefix_caching and any(
            running[rid].num_tokens - running[rid].num_computed_tokens > 1 for rid in undone
        ):  # V11's second trigger needs exactly this: keys on blocks its chunk filled
            yield UNDONE_PREFILL_EVENT
        yield from long_prefill_cap_events(before, mid, plan)
        if config.async_scheduling:
            yield from async_events(before, mid, plan)
        if speculative(config):
            yield from spec_events(before, mid, plan)
        held_back = full_sequence_gate_refused(before, mid, plan)
        if held_back is not None:
            yield "vllm-v1/full-sequence-admission: the gate held a request back"
            if held_back:
                yield GATE_HIT_EVENT
    elif config.semantics is Semantics.NANO_VLLM:
        if admitted and before.running:
            yield "nano-vllm/prefill-first: a prefill-only step with requests running"
        if not admitted and sum(plan.num_scheduled_tokens) > config.max_num_batched_tokens:
            yield "nano-vllm/decode-unbudgeted: a decode step over the token budget"
        if plan.preempted and plan.preempted[0].request_id != before.running[-1].request_id:
            yield "nano-vllm/victim-next: a victim lifo would not have chosen"
        if len(mid.running) > config.max_num_seqs:
            yield "nano-vllm/seq-limit-per-step: more than max_num_seqs running"


def prefix_events(
    before: SchedulerState,
    mid: SchedulerState,
    plan: StepPlan,
    after: SchedulerState,
    *,
    victim_blocks: dict[int, frozenset[int]],
    prompts_sent_before: set[tuple[int, ...]],
) -> Iterator[str]:
    """The prefix-cache events of one step, from the spec's states: ``before`` it, ``mid``
    (after its decisions), its ``plan`` and ``after`` it. ``victim_blocks`` (arrival ->
    the blocks it gave up when last preempted) is read and updated with this step's
    victims; ``prompts_sent_before`` are the prompts of requests already finished.
    nano-vllm's cache rules' events come with them (tests/stateful/nano_cache.py).
    scripts/explore_peers.py counts them too."""
    cache_before, cache_mid = before.prefix_cache, mid.prefix_cache
    if cache_before is None or cache_mid is None:
        return
    bs = before.config.block_size
    waiting = {r.request_id: r for r in before.waiting}
    running_mid = {r.request_id: r for r in mid.running}
    keyed_before = {block for _, block in cache_before.cached}
    free_before = set(cache_before.free_queue)
    for chunk in plan.scheduled:
        request = waiting.get(chunk.request_id)
        if request is None or chunk.start == 0:
            continue
        hit = running_mid[chunk.request_id].block_ids[: chunk.start // bs]
        yield "prefix: hit"
        if chunk.start < (request.num_tokens - 1) // bs * bs:
            yield "prefix: partial hit (fewer blocks than it could hit)"
        else:
            yield "prefix: full-prompt hit (every block it may hit)"
            if request.num_tokens % bs == 0 and not request.output_token_ids:
                yield "prefix: full-prompt hit on exactly k blocks (last block recomputed)"
        if not set(hit) <= keyed_before:
            yield "prefix: hit on blocks keyed in the same step"
        if set(hit) & free_before:
            yield "prefix: hit on a free cached block"
        if set(hit) & victim_blocks.get(request.request.arrival, frozenset()):
            yield "prefix: resumed request hit its own freed blocks"
        if request.request.prompt_token_ids in prompts_sent_before:
            yield "prefix: resent prompt hit"
    if set(cache_before.cached) - set(cache_mid.cached):
        yield "prefix: cached block reclaimed"
    yield from nano_cache_events(before, mid, plan, after)
    held = [block for r in after.running for block in r.block_ids]
    if len(set(held)) < len(held):
        yield "prefix: block shared by running requests"
    for preemption in plan.preempted:
        if preemption.mode is not PreemptionMode.SWAP:
            victim = next(r for r in before.running if r.request_id == preemption.request_id)
            victim_blocks[victim.request.arrival] = frozenset(victim.block_ids)
