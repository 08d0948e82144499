"""One differential step: both sides step in lockstep, and the plan must be valid."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import spec
from spec.kv import cdiv, chunk_for_prefill
from spec.prefix_cache import longest_hit, num_evictable, request_tokens
from spec.scheduler import StepDraft, schedule_running
from spec.types import (
    FinishReason,
    PreemptionMode,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
    watermark_blocks,
)
from tests.stateful.base import MachineBase
from tests.stateful.coverage import WATERMARK_EVENT
from tests.stateful.failures import InjectedFault, fail, require


def preempts_only_by_v0s_count(before: SchedulerState, plan: StepPlan) -> bool:
    """Whether phase A preempted under vllm-v0/append-touches-last-block where R5's own
    count (the blocks a chunk takes) would not have: the same state under kvsched."""
    if not plan.preempted:
        return False
    config = replace(before.config, semantics=Semantics.KVSCHED, max_model_len=None)
    draft = StepDraft(state=replace(before, config=config), budget=config.max_num_batched_tokens)
    return not schedule_running(draft).preempted


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


def victim_chunk_undone(before: SchedulerState) -> bool:
    """Whether phase A of this step undid a victim's chunk (the spec's draft says)."""
    budget = before.config.max_num_batched_tokens
    return bool(schedule_running(StepDraft(state=before, budget=budget)).undone)


def full_sequence_gate_refused(mid: SchedulerState, plan: StepPlan) -> int | None:
    """Whether phase C stopped at a request whose chunk fit but whose whole sequence did
    not (vllm-v1/full-sequence-admission), with budget and a seat left: the blocks the
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
    n = chunk_for_prefill(head.num_tokens - start, budget, config.enable_chunked_prefill)
    free = mid.num_free_gpu_blocks + len(hit) - evictable
    if n <= budget and cdiv(start + n, bs) <= free < cdiv(head.num_tokens, bs):
        return len(hit)
    return None


class Stepping(MachineBase):
    # --- a differential step ----------------------------------------------------------------

    def do_step(self) -> StepPlan | None:
        """One step on both sides: its plan, or None if an injected fault rolled it back."""
        before = self.lock.state
        real_before = (self.lock.last_observed or self.lock.peer.observe()).state
        snapshot = self.fault_snapshot()
        try:
            with self.compared(f"step {before.num_steps}: the real side"):
                advance = self.lock.advance()
        except InjectedFault:
            self.check_rollback(before, snapshot)
            return None
        mid, draft, plan = advance.mid, advance.decided, advance.engine_plan
        after = self.lock.state
        violations = spec.plan_violations(before, plan, after)
        if violations:
            fail("plan_valid", f"step {before.num_steps}: {'; '.join(violations)}")
        # The progress rule on each side's own history (state before, plan), so a
        # starvation both sides share is caught too (docs/semantics.md).
        for side, state, decided_plan in (("spec", before, draft), ("real", real_before, plan)):
            waits = spec.progress_violations(state, decided_plan)
            if waits:
                fail("no_idle_wait", f"{side}: {'; '.join(waits)}")
        require(
            bool(plan.scheduled or plan.preempted) or not spec.has_unfinished_requests(before),
            "step_progress",
            lambda: f"step {before.num_steps} did nothing with requests live",
        )
        self.after_step(mid, plan)
        self.record_step(before, mid, plan)
        return plan

    def check_rollback(self, before: SchedulerState, snapshot: dict[str, object]) -> None:
        """A failed step left the real side as it was ``before`` it (and the spec, which
        never took it, agrees); what it would have decided names the fault's events."""
        with self.compared("observe", "fault_rolls_back", "after a failed step: "):
            self.lock.compare_states()
        for invariant, value in self.fault_snapshot().items():
            require(
                value == snapshot[invariant],
                invariant,
                lambda: f"after a failed step {before.num_steps}: changed",
            )
        self.faults_fired += 1
        self.record.stats.rejected_steps += 1
        _, draft = spec.schedule(before)
        if draft.preempted:
            self.note("fault: in a step that preempted")
        if any(p.mode is PreemptionMode.SWAP for p in draft.preempted):
            self.note("fault: in a step that swapped out")
        if draft.swapped_in:
            self.note("fault: in a step that swapped in")

    def record_step(self, before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> None:
        config = self.config
        after = self.lock.state
        self.record.stats.steps += 1
        self.preemptions += len(plan.preempted)
        for label in step_events(config, before, plan, after):
            self.note(label)
        by_id = {r.request_id: r for r in mid.running}
        for finished in plan.finished:
            self.record_outcome(by_id[finished.request_id].request.arrival, finished)
        for label in profile_events(before, mid, plan):
            self.note(label)
        self.peak_gpu_used = max(
            self.peak_gpu_used, config.num_gpu_blocks - after.num_free_gpu_blocks
        )
        self.peak_swapped = max(self.peak_swapped, len(after.swapped))


def profile_events(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> Iterator[str]:
    """Events for the profile rules that made a difference in a step (the spec's view;
    both sides were just found to agree on it): ``before`` it, ``mid`` (after the
    decisions, ``spec.schedule``), its ``plan``. Shared with the peer machines."""
    config = before.config
    if config.semantics is Semantics.KVSCHED:
        return
    admitted = [r.request_id for r in before.waiting if r.request_id in plan.scheduled_ids]
    if config.semantics in (Semantics.VLLM_V1, Semantics.VLLM_V0):
        for finished in plan.finished:
            outputs = len(finished.output_token_ids)
            request = next(r for r in mid.running if r.request_id == finished.request_id)
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
        if plan.preempted and victim_chunk_undone(before):
            yield "vllm-v1/priority-victim-any-running: a scheduled victim's chunk undone"
        held_back = full_sequence_gate_refused(mid, plan)
        if held_back is not None:
            yield "vllm-v1/full-sequence-admission: the gate held a request back"
            if held_back:
                yield "vllm-v1/full-sequence-admission: the gate held back a request with a hit"
    else:
        if admitted and before.running:
            yield "nano-vllm/prefill-first: a prefill-only step with requests running"
        if not admitted and sum(plan.num_scheduled_tokens) > config.max_num_batched_tokens:
            yield "nano-vllm/decode-unbudgeted: a decode step over the token budget"
        if plan.preempted and plan.preempted[0].request_id != before.running[-1].request_id:
            yield "nano-vllm/victim-next: a victim lifo would not have chosen"
        if len(mid.running) > config.max_num_seqs:
            yield "nano-vllm/seq-limit-per-step: more than max_num_seqs running"


def step_events(
    config: SchedulerConfig, before: SchedulerState, plan: StepPlan, after: SchedulerState
) -> Iterator[str]:
    """The coverage events of one step (``before`` it, its ``plan``, the state ``after``),
    shared by the differential machines and the peer machines (tests/peers)."""
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
