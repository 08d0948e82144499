"""Each invariant can fail: deliberately broken states and steps are reported.

A valid state (requests waiting, running, mid-prefill and swapped) and a valid step
are broken one field at a time; ``state_violations`` / ``plan_violations`` must name
the rule that broke.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from spec import (
    FinishedRequest,
    FinishReason,
    Preemption,
    PreemptionMode,
    SampledToken,
    ScheduledChunk,
    SchedulerState,
    StepPlan,
    check_plan,
    check_state,
    init_state,
    plan_violations,
    state_violations,
    step,
)
from tests.spec.helpers import ORACLE, add, checked_step, config


def valid_state() -> SchedulerState:
    """waiting: w; running: a (decoding), b (decoding), m (mid-prefill); swapped: s."""
    cfg = config(
        16,
        block_size=2,
        max_num_batched_tokens=10,
        max_num_seqs=4,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=8,
    )
    state = init_state(cfg)
    for rid, prompt_len in (("s", 3), ("a", 2), ("b", 3), ("m", 9)):
        state = add(state, rid, prompt_len, 5, eos_token_id=999)
    state, _ = checked_step(state)
    state = replace(
        state,
        running=state.running[1:],
        swapped=(state.running[0],),
        num_free_gpu_blocks=state.num_free_gpu_blocks + 2,
        num_free_cpu_blocks=state.num_free_cpu_blocks - 2,
    )
    state = add(state, "w", 4, 3)
    assert state_violations(state) == ()
    assert [r.request_id for r in state.running] == ["a", "b", "m"]
    assert state.running[2].num_computed_tokens < 9  # m is mid-prefill
    return state


def broken_states() -> dict[str, tuple[SchedulerState, str]]:
    """name -> (broken state, the rule tag its violation must start with)."""
    state = valid_state()
    a, b, m = state.running
    (s,) = state.swapped
    (w,) = state.waiting
    big = replace(a.request, params=replace(a.request.params, max_tokens=100))
    return {
        "request in two queues": (replace(state, waiting=(*state.waiting, a)), "R1"),
        "same request twice in one queue": (replace(state, running=(a, b, m, a)), "R1"),
        "leaked GPU block": (
            replace(state, num_free_gpu_blocks=state.num_free_gpu_blocks - 1),
            "R2",
        ),
        "free GPU count too high": (
            replace(state, num_free_gpu_blocks=state.num_free_gpu_blocks + 1),
            "R2",
        ),
        "leaked CPU block": (
            replace(state, num_free_cpu_blocks=state.num_free_cpu_blocks - 1),
            "R2",
        ),
        "negative free count": (
            replace(state, num_free_gpu_blocks=-1, running=(*state.running, w, w)),
            "R2",
        ),
        "over max_num_seqs": (
            replace(state, config=replace(state.config, max_num_seqs=2)),
            "R8",
        ),
        "computed > num_tokens": (
            replace(
                state,
                running=(replace(a, num_computed_tokens=a.num_tokens + 1), b, m),
                num_free_gpu_blocks=state.num_free_gpu_blocks - 1,
            ),
            "R2",
        ),
        "computed == num_tokens between steps": (
            replace(state, running=(replace(a, num_computed_tokens=a.num_tokens), b, m)),
            "R2",
        ),
        "running with nothing computed": (
            replace(
                state,
                running=(replace(a, num_computed_tokens=0), b, m),
                num_free_gpu_blocks=state.num_free_gpu_blocks + 1,
            ),
            "R2",
        ),
        "waiting with computed tokens": (
            replace(state, waiting=(replace(w, num_computed_tokens=2),)),
            "R2",
        ),
        "swapped with nothing computed": (
            replace(
                state,
                swapped=(replace(s, num_computed_tokens=0),),
                num_free_cpu_blocks=state.num_free_cpu_blocks + 2,
            ),
            "R2",
        ),
        "outputs reached max_tokens": (
            replace(state, waiting=(replace(w, output_token_ids=(1, 2, 3)),)),
            "R10",
        ),
        "EOS among the outputs": (
            replace(state, running=(replace(a, output_token_ids=(999,)), b, m)),
            "R10",
        ),
        "request that can never fit": (
            replace(state, running=(replace(a, request=big), b, m)),
            "R4",
        ),
        "arrival not below next_arrival": (replace(state, next_arrival=2), "R4"),
        "two requests with one arrival": (
            replace(
                state, waiting=(replace(w, request=replace(w.request, arrival=a.request.arrival)),)
            ),
            "R4",
        ),
        "unregistered policy": (
            replace(state, config=replace(state.config, policy="round-robin")),
            "R9",
        ),
    }


BROKEN_STATES = broken_states()


def test_the_valid_state_and_its_next_step_are_valid() -> None:
    state = valid_state()
    assert check_state(state)
    after, plan = step(state, ORACLE)
    assert check_plan(state, plan, after)
    assert check_state(after)


@pytest.mark.parametrize("name", list(BROKEN_STATES))
def test_broken_state_is_reported(name: str) -> None:
    state, rule = BROKEN_STATES[name]
    problems = state_violations(state)
    assert problems, name
    assert any(p.startswith(rule) for p in problems), problems
    assert not check_state(state)


# --- broken steps ------------------------------------------------------------------------


def valid_step() -> tuple[SchedulerState, StepPlan, SchedulerState]:
    before = valid_state()
    after, plan = step(before, ORACLE)
    assert plan_violations(before, plan, after) == ()
    return before, plan, after


def preempting_step() -> tuple[SchedulerState, StepPlan, SchedulerState]:
    """A step that preempts: 6 slots, three 2-token prompts, then one decode step."""
    state = add(add(add(add(init(), "a", 2, 4), "b", 2, 4), "c", 2, 4), "w", 1, 1)
    state, _ = checked_step(state)
    after, plan = step(state, ORACLE)
    assert [p.request_id for p in plan.preempted] == ["c"]
    assert plan_violations(state, plan, after) == ()
    return state, plan, after


def init() -> SchedulerState:
    return init_state(config(6))


def with_plan(
    plan: StepPlan,
    *,
    scheduled: tuple[ScheduledChunk, ...] | None = None,
    sampled: tuple[SampledToken, ...] | None = None,
) -> StepPlan:
    """``plan`` with other chunks or sampled tokens."""
    return StepPlan.of(
        step=plan.step,
        scheduled=plan.scheduled if scheduled is None else scheduled,
        preempted=plan.preempted,
        swapped_in=plan.swapped_in,
        sampled=plan.sampled if sampled is None else sampled,
        finished=plan.finished,
    )


def broken_steps() -> dict[str, tuple[SchedulerState, StepPlan, SchedulerState, str]]:
    before, plan, after = valid_step()
    first = plan.scheduled[0]
    over = replace(before, config=replace(before.config, max_num_batched_tokens=1))
    p_before, p_plan, p_after = preempting_step()
    w = p_before.waiting[0]
    return {
        "plan over budget": (over, plan, replace(after, config=over.config), "R5"),
        "request scheduled twice": (
            before,
            with_plan(plan, scheduled=(*plan.scheduled, first)),
            after,
            "R5",
        ),
        "chunk not starting at computed": (
            before,
            with_plan(plan, scheduled=(replace(first, start=first.start + 1), *plan.scheduled[1:])),
            after,
            "R5",
        ),
        "empty chunk": (
            before,
            with_plan(
                plan,
                scheduled=(*plan.scheduled, ScheduledChunk(request_id="w", start=0, num_tokens=0)),
            ),
            after,
            "R5",
        ),
        "chunk past num_tokens": (
            before,
            with_plan(plan, scheduled=(replace(first, num_tokens=50), *plan.scheduled[1:])),
            after,
            "R5",
        ),
        "lost request": (before, plan, replace(after, waiting=()), "R1"),
        "duplicated request": (
            before,
            plan,
            replace(after, waiting=(*after.waiting, after.running[0])),
            "R1",
        ),
        "sampled without completing": (
            before,
            with_plan(plan, sampled=(*plan.sampled, SampledToken(request_id="m", token_id=1))),
            after,
            "R10",
        ),
        "finished with the wrong reason": (
            before,
            replace(
                plan,
                finished=(
                    FinishedRequest(
                        request_id="a",
                        output_token_ids=(),
                        finish_reason=FinishReason.STOP,
                        num_preemptions=0,
                    ),
                ),
            ),
            after,
            "R10",
        ),
        "wrong step number": (before, replace(plan, step=5), after, "step"),
        "step counter not advanced": (
            before,
            plan,
            replace(after, num_steps=before.num_steps),
            "step",
        ),
        "admission in a step that preempted": (
            p_before,
            with_plan(
                p_plan,
                scheduled=(
                    *p_plan.scheduled,
                    ScheduledChunk(request_id="w", start=0, num_tokens=1),
                ),
            ),
            p_after,
            "R7/R8",
        ),
        "preempted request also scheduled": (
            p_before,
            replace(
                p_plan,
                preempted=(Preemption(request_id="a", mode=PreemptionMode.RECOMPUTE),),
            ),
            p_after,
            "R6",
        ),
        "victim put at the tail of waiting": (
            p_before,
            p_plan,
            replace(p_after, waiting=(*p_after.waiting[1:], p_after.waiting[0])),
            "R6/R8",
        ),
        "victim kept its computed tokens": (
            p_before,
            p_plan,
            replace(
                p_after,
                waiting=(replace(p_after.waiting[0], num_computed_tokens=2), *p_after.waiting[1:]),
            ),
            "R6/R10",
        ),
        "swapped_in not from swapped": (before, replace(plan, swapped_in=("a",)), after, "R7"),
        "waiting request silently dropped": (
            p_before,
            p_plan,
            replace(p_after, waiting=tuple(r for r in p_after.waiting if r != w)),
            "R1",
        ),
    }


BROKEN_STEPS = broken_steps()


@pytest.mark.parametrize("name", list(BROKEN_STEPS))
def test_broken_step_is_reported(name: str) -> None:
    before, plan, after, rule = BROKEN_STEPS[name]
    problems = plan_violations(before, plan, after)
    assert problems, name
    assert any(p.startswith(rule) for p in problems), problems
    assert not check_plan(before, plan, after)
