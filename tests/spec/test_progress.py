"""The progress rule (``spec.progress_violations``): no preempted request waits idle.

Random runs check it on every spec step (tests/spec/scenarios.py ``checked_step``);
these tests show that it holds on the spec's own plans and that it flags the
starvation the drain bound cannot see: a step that could take a swapped (or waiting)
request back and does not.
"""

from __future__ import annotations

from spec import (
    PreemptionMode,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    add_request,
    has_unfinished_requests,
    init_state,
    progress_violations,
)
from spec.prefix_cache import longest_hit
from spec.types import Semantics
from tests.drain import drain_within
from tests.oracles.pool import spec_pool_violations
from tests.spec.helpers import add, checked_step, config, new_state, prompt


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


# --- with prefix caching on: "fits" is PC4's test on the pool the earlier chunks left ----


def cached(
    num_gpu_blocks: int,
    max_num_batched_tokens: int,
    chunked: bool = False,
    mode: PreemptionMode = PreemptionMode.RECOMPUTE,
) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=2,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=True,
        preemption_mode=mode,
    )


def test_a_head_that_fits_only_by_a_hit_keyed_in_the_same_step_is_flagged() -> None:
    """Only the tokens after the hit are charged, and the hit is looked up in the pool
    as the earlier admissions left it: ``c`` hits the blocks ``b`` keyed in this step."""
    state = init_state(cached(16, 8))
    for rid in ("b", "c"):
        state = add_request(state, rid, prompt(6), SamplingParams(max_tokens=2))
    _, plan = checked_step(state)
    assert progress_violations(state, plan) == ()
    assert [(c.request_id, c.start, c.num_tokens) for c in plan.scheduled] == [
        ("b", 0, 6),
        ("c", 4, 2),
    ]
    # At the step's start c has no hit and its 6 tokens exceed the 2 left by b.
    assert state.prefix_cache is not None and state.prefix_cache.cached == ()
    found = progress_violations(state, without(plan, {"c"}))
    assert found and "'c'" in found[0] and "2 tokens" in found[0]


def test_a_hit_reclaimed_by_an_earlier_admission_no_longer_counts() -> None:
    """``z`` would fit the pool at the step's start with its 2-block hit; ``y``, admitted
    first, reclaims one hit block and takes the free blocks, so ``z`` does not fit and
    waiting is no violation (a rule judging the start-of-step pool would flag it)."""
    state = add_request(init_state(cached(4, 64)), "x", prompt(8), SamplingParams(max_tokens=1))
    state, _ = checked_step(state)
    assert not state.running and state.prefix_cache is not None
    assert state.prefix_cache.free_queue == (3, 2, 1, 0)  # PC6: last block first
    state = add_request(state, "y", prompt(6, 50), SamplingParams(max_tokens=1))
    state = add_request(state, "z", prompt(6), SamplingParams(max_tokens=1))
    assert state.prefix_cache is not None
    hit_at_start = longest_hit(state.prefix_cache, prompt(6), 2)
    assert hit_at_start == (0, 1)  # needs 1 new block + 2 free hit blocks <= 4 free
    _, plan = checked_step(state)
    assert plan.scheduled_ids == ("y",)
    assert progress_violations(state, plan) == ()


def judged_shared_prefix_run(cfg: SchedulerConfig, max_tokens: int) -> int:
    """Six requests sharing a 4-token prefix, drained with Rule P asserted on every step;
    returns how many steps left a request waiting (the steps the rule had to judge)."""
    state = init_state(cfg)
    for i in range(6):
        tokens = (*prompt(4), *prompt(1 + i % 3, 40 + i))
        state = add_request(state, f"r{i}", tokens, SamplingParams(max_tokens=max_tokens))
    judged = 0
    bound = drain_within(state)
    while has_unfinished_requests(state):
        bound.tick(state)
        before = state
        state, plan = checked_step(before)
        assert progress_violations(before, plan) == ()
        judged += bool(before.waiting)
    assert spec_pool_violations(state) == []
    return judged


def test_spec_runs_with_prefix_caching_keep_rule_p() -> None:
    """Shared prefixes under memory pressure, in both preemption modes, several budgets."""
    judged = 0
    for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.RESTART):
        for budget, chunked in ((6, True), (16, False), (64, True)):
            judged += judged_shared_prefix_run(cached(10, budget, chunked, mode), 6)
    assert judged >= 10


# --- nano-vllm: phase C comes first, so only this step's admissions came before ----------


def nano(num_gpu_blocks: int, caching: bool = False) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=2,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
        enable_prefix_caching=caching,
        semantics=Semantics.NANO_VLLM,
    )


def test_nano_vllm_prefill_step_holding_back_a_fitting_request_is_flagged() -> None:
    state = new_state(nano(16), ("a", 4, 3), ("b", 4, 3))
    _, plan = checked_step(state)
    assert plan.scheduled_ids == ("a", "b") and progress_violations(state, plan) == ()
    found = progress_violations(state, without(plan, {"b"}))
    assert found and "'b'" in found[0]


def test_nano_vllm_decode_step_while_the_head_fits_the_whole_pool_is_flagged() -> None:
    """A step that admits nobody decodes; phase C ran first, on the whole pool."""
    state, _ = checked_step(new_state(nano(16), ("a", 4, 3)))
    state = add(state, "b", 4, 3)
    _, plan = checked_step(state)
    assert plan.scheduled_ids == ("b",) and progress_violations(state, plan) == ()
    decode = StepPlan.of(
        step=plan.step, scheduled=(ScheduledChunk(request_id="a", start=4, num_tokens=1),)
    )
    found = progress_violations(state, decode)
    assert found and "'b'" in found[0]


def test_nano_vllm_runs_keep_rule_p() -> None:
    """Tight pools: decode steps preempt (victim-next) and victims wait at the front."""
    judged = 0
    for blocks in (6, 8, 12):
        state = new_state(nano(blocks), *((f"r{i}", 3 + i % 4, 5) for i in range(6)))
        bound = drain_within(state)
        while has_unfinished_requests(state):
            bound.tick(state)
            before = state
            state, plan = checked_step(before)
            assert progress_violations(before, plan) == ()
            judged += bool(before.waiting)
    assert judged >= 10


def test_nano_vllm_runs_with_its_cache_keep_rule_p() -> None:
    """Shared prefixes: hits, last-key-wins and the whole-sequence gate (N7, N8)."""
    judged = sum(judged_shared_prefix_run(nano(blocks, caching=True), 5) for blocks in (6, 8, 12))
    assert judged >= 10
