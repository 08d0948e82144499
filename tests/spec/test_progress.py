"""The progress rule (``spec.progress_violations``): no preempted request waits idle.

Random runs check it on every spec step (tests/spec/scenarios.py ``checked_step``);
these tests show that it holds on the spec's own plans and that it flags the
starvation the drain bound cannot see: a step that could take a swapped (or waiting)
request back and does not.
"""

from __future__ import annotations

from spec import PreemptionMode, SchedulerState, StepPlan, progress_violations
from tests.spec.helpers import checked_step, config, new_state


def first_step_where(
    state: SchedulerState, wanted: str, max_steps: int = 200
) -> tuple[SchedulerState, StepPlan]:
    """The state before, and the plan of, the first step whose plan has a ``wanted``
    chunk (``"swapped_in"`` or ``"admitted"``) in a step that preempts nothing."""
    for _ in range(max_steps):
        running = {r.request_id for r in state.running}
        after, plan = checked_step(state)
        assert progress_violations(state, plan) == ()
        admitted = [rid for rid in plan.scheduled_ids if rid not in running]
        wanted_here = (wanted == "swapped_in" and plan.swapped_in) or (
            wanted == "admitted" and len(admitted) > len(plan.swapped_in)
        )
        if wanted_here and not plan.preempted and state.running:
            return state, plan
        state = after
    raise AssertionError(f"no step with {wanted} within {max_steps} steps")


def without(plan: StepPlan, dropped: set[str]) -> StepPlan:
    """``plan``'s decisions minus the chunks of ``dropped``: what a starving step does."""
    return StepPlan.of(
        step=plan.step,
        scheduled=[c for c in plan.scheduled if c.request_id not in dropped],
        preempted=plan.preempted,
        swapped_in=[rid for rid in plan.swapped_in if rid not in dropped],
    )


def swap_state() -> SchedulerState:
    cfg = config(
        12,
        block_size=2,
        max_num_batched_tokens=8,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=24,
    )
    return new_state(cfg, ("a", 6, 12), ("b", 6, 12), ("c", 4, 3))


def test_swapped_request_held_back_while_running_requests_run_is_flagged() -> None:
    before, plan = first_step_where(swap_state(), "swapped_in")
    head = before.swapped[0].request_id
    starving = without(plan, {head})
    found = progress_violations(before, starving)
    assert found and head in found[0] and "swapped" in found[0]


def test_waiting_request_held_back_is_flagged() -> None:
    before, plan = first_step_where(
        new_state(config(64, max_num_batched_tokens=4), ("a", 4, 6), ("b", 4, 6)), "admitted"
    )
    running = {r.request_id for r in before.running}
    late = [rid for rid in plan.scheduled_ids if rid not in running]
    found = progress_violations(before, without(plan, {late[0]}))
    assert found and late[0] in found[0] and "waiting" in found[0]


def test_a_step_that_preempts_is_not_judged() -> None:
    """Anti-thrash (R7/R8): a preempting step takes nothing back, so it is exempt."""
    state = swap_state()
    for _ in range(200):
        after, plan = checked_step(state)
        if plan.preempted and state.swapped:
            break
        state = after
    else:
        raise AssertionError("no preempting step with swapped requests")
    idle = StepPlan.of(step=plan.step, scheduled=(), preempted=plan.preempted)
    assert progress_violations(state, idle) == ()
