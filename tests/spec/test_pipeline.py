"""Async scheduling (vllm-v1/async-*, spec.pipeline): one small scenario per rule, with
the exact expected plans, and a property: under a greedy oracle every request gets the
same outputs and finish reason with async scheduling on as with it off, every step
valid (state, plan and Rule P). tests/peers/test_vllm_engine_order.py holds the same
scenarios against vLLM's own ``AsyncScheduler`` in lockstep."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from spec import (
    ConfigError,
    ConstantOracle,
    FinishReason,
    HashOracle,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    abort_request,
    add_request,
    complete_step,
    drain_step_bound,
    has_unfinished_requests,
    init_state,
    live_request_ids,
    progress_violations,
    schedule,
    step,
)
from spec.invariants import plan_violations, state_violations
from spec.oracle import TokenOracle
from spec.types import Semantics
from tests.spec.helpers import chunks

ORACLE = HashOracle(vocab_size=8)


def vllm(**fields: int | bool) -> SchedulerConfig:
    values: dict[str, int | bool] = {
        "num_gpu_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "async_scheduling": True,
        **fields,
    }
    return SchedulerConfig(semantics=Semantics.VLLM_V1, **values)  # type: ignore[arg-type]


def params(max_tokens: int, eos: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, eos_token_id=eos, ignore_eos=eos is None)


def checked(state: SchedulerState, oracle: TokenOracle = ORACLE) -> tuple[SchedulerState, StepPlan]:
    after, plan = step(state, oracle)
    problems = (
        state_violations(after)
        + plan_violations(state, plan, after)
        + progress_violations(state, plan)
    )
    assert not problems, problems
    return after, plan


def run(state: SchedulerState, oracle: TokenOracle = ORACLE, max_steps: int = 60) -> list[StepPlan]:
    plans: list[StepPlan] = []
    while has_unfinished_requests(state):
        assert len(plans) < max_steps, "no drain"
        state, plan = checked(state, oracle)
        plans.append(plan)
    return plans


def with_requests(
    config: SchedulerConfig, *requests: tuple[str, tuple[int, ...], SamplingParams]
) -> SchedulerState:
    state = init_state(config)
    for rid, prompt, p in requests:
        state = add_request(state, rid, prompt, p)
    return state


def test_async_scheduling_is_a_vllm_v1_setting() -> None:
    with pytest.raises(ConfigError, match="async_scheduling is a vllm-v1 setting"):
        SchedulerConfig(num_gpu_blocks=4, async_scheduling=True)


def test_a_decode_is_scheduled_on_its_placeholder_and_applied_a_step_later() -> None:
    """vllm-v1/async-placeholders, -batch-queue: step 0 prefills and applies nothing;
    step 1 schedules the decode on top of the placeholder (computed 3 == num_tokens),
    then applies step 0's token."""
    state = with_requests(vllm(), ("r0", (1, 2, 3), params(3)))
    state, plan0 = checked(state)
    assert chunks(plan0) == [("r0", 0, 3)] and plan0.sampled == ()
    (r0,) = state.running
    assert (r0.num_computed_tokens, r0.num_output_placeholders, r0.num_in_flight_tokens) == (
        3,
        1,
        3,
    )
    assert len(state.in_flight) == 1
    state, plan1 = checked(state)
    assert chunks(plan1) == [("r0", 3, 1)]
    assert plan1.sampled_ids == ("r0",)
    (r0,) = state.running
    assert (r0.num_computed_tokens, r0.num_output_placeholders, len(r0.output_token_ids)) == (
        4,
        1,
        1,
    )


def test_no_step_is_scheduled_past_max_tokens() -> None:
    """vllm-v1/async-max-tokens: max_tokens 2: the decode of step 1 samples the last
    token, so step 2 schedules nothing for r0 and only applies step 1. Two empty steps
    drain the queue (-batch-queue: the finish is news for one ``schedule``)."""
    plans = run(with_requests(vllm(), ("r0", (1, 2, 3), params(2))))
    assert [chunks(p) for p in plans] == [[("r0", 0, 3)], [("r0", 3, 1)], [], [], []]
    assert [f.finish_reason for f in plans[2].finished] == [FinishReason.LENGTH]


def test_the_drain_bound_is_exact_for_a_lone_request() -> None:
    """spec.drain_step_bound under async: ``H + n + 2``. A lone request that never
    samples EOS takes its head steps (prefill, then one decode per further output),
    its lag step (walked past, its finish applied) and the batch queue's two-step tail,
    from the start and from every state between steps on the way."""
    state = with_requests(vllm(), ("r0", (1, 2, 3, 4, 5), params(4)))
    bounds: list[int] = []
    taken = 0
    while has_unfinished_requests(state):
        bounds.append(drain_step_bound(state))
        state, _ = checked(state)
        taken += 1
    assert bounds == list(range(taken, 0, -1)) == [7, 6, 5, 4, 3, 2, 1]


@pytest.mark.parametrize("seed", range(40))
def test_lifo_drains_within_the_bound_from_every_state(seed: int) -> None:
    """The LIFO drain bound under async (docs/semantics.md, "Liveness under the
    profiles"): from every state after the last arrival, the drain takes at most
    ``spec.drain_step_bound`` steps."""
    config, requests = _workload(random.Random(seed))
    config = replace(config, policy="lifo", async_scheduling=True)
    state = init_state(config)
    pending = sorted(requests)
    starts: list[tuple[int, int]] = []  # (step, bound) from each state after the arrivals
    steps = 0
    while pending or has_unfinished_requests(state):
        while pending and pending[0][0] <= steps:
            _, rid, prompt, p = pending.pop(0)
            state = add_request(state, rid, prompt, p)
        if not pending:
            starts.append((steps, drain_step_bound(state)))
        state, _ = checked(state)
        steps += 1
        assert steps < 500, "no drain"
    over = [(start, bound, steps - start) for start, bound in starts if steps - start > bound]
    assert not over, over


def test_an_eos_in_flight_costs_one_discarded_step() -> None:
    """vllm-v1/async-discard: the EOS of step 0 is applied in step 1, after step 1
    scheduled r0 again; step 2 applies step 1, whose output for r0 is dropped."""
    state = with_requests(vllm(), ("r0", (1, 2, 3), params(5, eos=0)))
    plans = run(state, ConstantOracle(0))
    assert [chunks(p) for p in plans][:3] == [[("r0", 0, 3)], [("r0", 3, 1)], []]
    assert [(f.request_id, f.finish_reason) for f in plans[1].finished] == [
        ("r0", FinishReason.STOP)
    ]
    assert plans[2].sampled == () and plans[2].finished == ()


def test_a_victim_gets_its_stale_output_and_waits_for_it() -> None:
    """vllm-v1/async-stale-output (vLLM's async-preempt-in-flight trace): r1 is preempted
    in step 1 with its step-0 token in flight; that token is delivered to the waiting
    r1, and r1 comes back with it (3 tokens re-prefilled) once r0's blocks are free."""
    config = vllm(num_gpu_blocks=3, block_size=2, max_num_batched_tokens=8, max_model_len=6)
    state = with_requests(config, ("r0", (1, 2, 3), params(2)), ("r1", (4, 5), params(3)))
    state, _ = checked(state)
    state, plan1 = checked(state)
    assert [p.request_id for p in plan1.preempted] == ["r1"]
    assert "r1" in plan1.sampled_ids
    (r1,) = state.waiting
    assert len(r1.output_token_ids) == 1 and r1.num_stale_output_tokens == 0
    plans = run(state)
    first = next(i for i, p in enumerate(plans) if "r1" in p.scheduled_ids)
    assert chunks(plans[first]) == [("r1", 0, 3)]


def test_admission_walks_past_a_request_with_stale_output() -> None:
    """vllm-v1/async-stale-output, admission: a waiting request whose stale tokens are
    still in flight is skipped and the next one admitted; it keeps its place. (With
    vLLM's queue of two the stale output is applied in the very step that preempted,
    which admits nobody, so this state is built by hand: the rule is for deeper queues.)"""
    fresh = with_requests(vllm(), ("r0", (1, 2), params(4)), ("r1", (3, 4), params(4)))
    r0, r1 = fresh.waiting
    r0 = replace(r0, num_in_flight_tokens=1, num_stale_output_tokens=1)
    mid, plan = schedule(replace(fresh, waiting=(r0, r1)))
    assert plan.scheduled_ids == ("r1",)
    assert [r.request_id for r in mid.waiting] == ["r0"]


def test_an_abort_in_flight_drops_the_output() -> None:
    """vllm-v1/async-discard: r0 aborted with its step in flight: the next step's
    applied batch has no token for it."""
    state = with_requests(vllm(), ("r0", (1, 2, 3), params(5)), ("r1", (5, 6), params(3)))
    state, _ = checked(state)
    state, _ = abort_request(state, "r0")
    assert state.has_finished_requests
    state, plan = checked(state)
    assert plan.sampled_ids == ("r1",)
    assert "r0" not in live_request_ids(state)


def test_the_tokens_must_be_the_applied_steps() -> None:
    state = with_requests(vllm(), ("r0", (1, 2, 3), params(5)))
    state, _ = checked(state)
    mid, plan = schedule(state)
    with pytest.raises(SampledTokensError, match="applied step"):
        complete_step(mid, plan, {})
    _, done = complete_step(mid, plan, {"r0": 4})
    assert done.sampled_token_ids == (4,)


def _workload(
    rng: random.Random,
) -> tuple[SchedulerConfig, list[tuple[int, str, tuple[int, ...], SamplingParams]]]:
    block_size = rng.choice([1, 2, 4])
    requests = [
        (
            rng.randint(0, 4),
            f"r{i}",
            tuple(rng.randrange(1, 50) for _ in range(rng.randint(1, 10))),
            SamplingParams(
                max_tokens=rng.randint(1, 8),
                eos_token_id=rng.choice([None, 3]),
                priority=rng.randint(0, 2),
            ),
        )
        for i in range(rng.randint(1, 6))
    ]
    need = max(-(-(len(p) + sp.max_tokens) // block_size) for _, _, p, sp in requests)
    config = SchedulerConfig(
        num_gpu_blocks=need + rng.randint(0, 4),
        block_size=block_size,
        max_num_batched_tokens=rng.randint(4, 24),
        max_num_seqs=rng.randint(1, 4),
        enable_chunked_prefill=True,
        policy=rng.choice(["lifo", "priority"]),
        enable_prefix_caching=rng.random() < 0.5,
        semantics=Semantics.VLLM_V1,
    )
    return config, requests


def _outcomes(
    config: SchedulerConfig, requests: list[tuple[int, str, tuple[int, ...], SamplingParams]]
) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
    state = init_state(config)
    pending = sorted(requests)
    outcomes: dict[str, tuple[tuple[int, ...], FinishReason]] = {}
    steps = 0
    while pending or has_unfinished_requests(state):
        while pending and pending[0][0] <= steps:
            _, rid, prompt, p = pending.pop(0)
            state = add_request(state, rid, prompt, p)
        state, plan = checked(state)
        outcomes.update(
            (f.request_id, (f.output_token_ids, f.finish_reason)) for f in plan.finished
        )
        steps += 1
        assert steps < 500, "no drain"
    return outcomes


@pytest.mark.parametrize("seed", range(40))
def test_async_outputs_equal_the_synchronous_ones(seed: int) -> None:
    """Async scheduling changes when outputs are applied, never what a greedy model
    samples nor why a request stops (vLLM #52071's class: a sync/async divergence)."""
    config, requests = _workload(random.Random(seed))
    synchronous = _outcomes(config, requests)
    assert _outcomes(replace(config, async_scheduling=True), requests) == synchronous


def test_an_id_used_again_does_not_get_the_old_requests_output() -> None:
    """The batch in flight names its requests by id and arrival: r0 aborted with its
    decode in flight and added again at once; the decode's output is dropped, and the
    new r0 (another arrival) is untouched by it."""
    state = with_requests(vllm(), ("r0", (1, 2, 3), params(5)))
    state, _ = checked(state)
    state, _ = checked(state)  # r0's decode is in flight
    assert [c.request_id for c in state.in_flight[0].scheduled] == ["r0"]
    state, _ = abort_request(state, "r0")
    state = add_request(state, "r0", (7, 6), params(2))
    state, plan = checked(state)
    assert plan.sampled == ()
    (r0,) = state.running
    assert r0.request.arrival == 1 and r0.output_token_ids == ()
