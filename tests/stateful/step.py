"""One differential step: both sides step, and their plans and states must agree."""

from __future__ import annotations

from dataclasses import replace

import spec
from spec.kv import cdiv, chunk_for_prefill
from spec.scheduler import StepDraft, schedule_running
from spec.types import (
    FinishReason,
    PreemptionMode,
    SampledTokensError,
    SchedulerState,
    Semantics,
    StepPlan,
)
from tests.stateful.base import MachineBase
from tests.stateful.diffs import DECISIONS, plan_diff, state_diff
from tests.stateful.failures import InjectedFault, InvariantViolation, fail, require


def victim_chunk_undone(before: SchedulerState) -> bool:
    """Whether phase A of this step undid a victim's chunk (the spec's draft says)."""
    budget = before.config.max_num_batched_tokens
    return bool(schedule_running(StepDraft(state=before, budget=budget)).undone)


def full_sequence_gate_refused(mid: SchedulerState, plan: StepPlan, admitted: list[str]) -> bool:
    """Whether phase C stopped at a request whose chunk fit but whose whole sequence did
    not (vllm-v1/full-sequence-admission), with budget and a seat left."""
    config = mid.config
    budget = config.max_num_batched_tokens - sum(plan.num_scheduled_tokens)
    if plan.preempted or not mid.waiting or budget == 0:
        return False
    if len(mid.running) >= config.max_num_seqs:
        return False
    head = spec.get_policy(config.policy).order_waiting(mid.waiting)[0]
    n = chunk_for_prefill(head.num_tokens, budget, config.enable_chunked_prefill)
    bs = config.block_size
    free = mid.num_free_gpu_blocks
    return n <= budget and cdiv(n, bs) <= free < cdiv(head.num_tokens, bs)


class Stepping(MachineBase):
    # --- a differential step ----------------------------------------------------------------

    def do_step(self) -> StepPlan | None:
        """One step on both sides: its plan, or None if an injected fault rolled it back."""
        before = self.spec.state
        mid, draft = self.spec.schedule()
        snapshot = self.fault_snapshot()
        try:
            plan = self.real_step()
        except InjectedFault:
            observed = self.real_observe()
            require(
                observed == before,
                "fault_rolls_back",
                lambda: f"after a failed step {before.num_steps}: {state_diff(observed, before)}",
            )
            for invariant, value in self.fault_snapshot().items():
                require(
                    value == snapshot[invariant],
                    invariant,
                    lambda: f"after a failed step {before.num_steps}: changed",
                )
            self.faults_fired += 1
            self.record.stats.rejected_steps += 1
            if draft.preempted:
                self.note("fault: in a step that preempted")
            if any(p.mode is PreemptionMode.SWAP for p in draft.preempted):
                self.note("fault: in a step that swapped out")
            if draft.swapped_in:
                self.note("fault: in a step that swapped in")
            return None
        except InvariantViolation:
            raise
        except Exception as error:
            raise InvariantViolation(
                "no_crash", f"step {before.num_steps}: the real side raised {error!r}"
            ) from error
        decided = replace(plan, sampled_ids=(), sampled_token_ids=(), finished=())
        require(
            decided == draft,
            "plan_matches_spec",
            lambda: f"step {before.num_steps}: {plan_diff(plan, draft, DECISIONS)}",
        )
        tokens = self.spec_tokens(mid, draft, plan)
        try:
            reference = self.spec.commit(mid, draft, tokens)
        except SampledTokensError as error:
            raise InvariantViolation("plan_matches_spec", str(error)) from error
        require(
            plan == reference,
            "plan_matches_spec",
            lambda: f"step {before.num_steps}: {plan_diff(plan, reference)}",
        )
        after = self.spec.state
        violations = spec.plan_violations(before, plan, after)
        if violations:
            fail("plan_valid", f"step {before.num_steps}: {'; '.join(violations)}")
        require(
            bool(plan.scheduled or plan.preempted) or not spec.has_unfinished_requests(before),
            "step_progress",
            lambda: f"step {before.num_steps} did nothing with requests live",
        )
        self.after_step(mid, plan)
        self.record_step(before, mid, plan)
        return plan

    def record_profile_rules(
        self, before: SchedulerState, mid: SchedulerState, plan: StepPlan
    ) -> None:
        """Events for the profile rules that made a difference in this step (the spec's
        view; both sides were just found to agree on it)."""
        config = before.config
        admitted = [r.request_id for r in before.waiting if r.request_id in plan.scheduled_ids]
        if config.semantics is Semantics.VLLM_V1:
            for finished in plan.finished:
                outputs = len(finished.output_token_ids)
                request = next(r for r in mid.running if r.request_id == finished.request_id)
                if (
                    finished.finish_reason is FinishReason.LENGTH
                    and outputs < request.request.params.max_tokens
                ):
                    self.note("vllm-v1/max-model-len: length at max_model_len")
            if plan.preempted and victim_chunk_undone(before):
                self.note("vllm-v1/priority-victim-any-running: a scheduled victim's chunk undone")
            if full_sequence_gate_refused(mid, plan, admitted):
                self.note("vllm-v1/full-sequence-admission: the gate held a request back")
        else:
            if admitted and before.running:
                self.note("nano-vllm/prefill-first: a prefill-only step with requests running")
            if not admitted and sum(plan.num_scheduled_tokens) > config.max_num_batched_tokens:
                self.note("nano-vllm/decode-unbudgeted: a decode step over the token budget")
            if plan.preempted and plan.preempted[0].request_id != before.running[-1].request_id:
                self.note("nano-vllm/victim-next: a victim lifo would not have chosen")
            if len(mid.running) > config.max_num_seqs:
                self.note("nano-vllm/seq-limit-per-step: more than max_num_seqs running")

    def record_step(self, before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> None:
        config = self.config
        self.record.stats.steps += 1
        index = {r.request_id: r for r in (*before.waiting, *before.running, *before.swapped)}
        for preemption in plan.preempted:
            self.preemptions += 1
            self.note(f"preempt: {preemption.mode}")
            if (
                config.preemption_mode is PreemptionMode.SWAP
                and preemption.mode is PreemptionMode.RECOMPUTE
            ):
                self.note("preempt: swap fell back to recompute (CPU pool full)")
        if len(plan.preempted) > 1:
            self.note("preempt: several victims in one step")
        if plan.preempted and before.waiting:
            self.note("admission held back by a preemption")
        if plan.swapped_in:
            self.note("swap-in")
        for chunk in plan.scheduled:
            request = index[chunk.request_id]
            if chunk.start + chunk.num_tokens < request.num_tokens:
                self.note("chunked prefill: partial chunk")
            elif chunk.start > 0 and chunk.num_tokens > 1:
                self.note("chunked prefill: last chunk of a resumed prefill")
            if chunk.start == 0 and request.output_token_ids and chunk.num_tokens > 1:
                self.note("re-prefill of prompt + kept outputs")
        by_id = {r.request_id: r for r in mid.running}
        for sampled in plan.sampled:
            params = by_id[sampled.request_id].request.params
            if params.ignore_eos and sampled.token_id == params.eos_token_id:
                self.note("finish: EOS sampled but ignored")
        for finished in plan.finished:
            self.note(f"finish: {finished.finish_reason}")
            self.record_outcome(by_id[finished.request_id].request.arrival, finished)
        after = self.spec.state
        if len(after.running) == config.max_num_seqs and after.waiting:
            self.note("max_num_seqs reached with requests waiting")
        if config.semantics is not Semantics.KVSCHED:
            self.record_profile_rules(before, mid, plan)
        self.peak_gpu_used = max(
            self.peak_gpu_used, config.num_gpu_blocks - after.num_free_gpu_blocks
        )
        self.peak_swapped = max(self.peak_swapped, len(after.swapped))
