"""The seed tutorial's scenario (step11_preemption) under the spec's rules.

8 requests of 5-token prompts, 8 new tokens each, 20 KV slots (``block_size=1``,
20 GPU blocks), at most 8 running, a budget far above need. The seed's engine (restart
semantics, its own accounting with a ``+1`` headroom) took 58 steps and 39
preemptions and sampled 132 tokens for the 64 needed. Run with ``-rP`` to see the
figures next to those.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spec import (
    FinishReason,
    PreemptionMode,
    SchedulerState,
    StepPlan,
    drain_step_bound,
    has_unfinished_requests,
)
from tests.drain import StepBound
from tests.spec.helpers import RunFigures, checked_step, config, figures, new_state

SEED = "seed tutorial (restart, own accounting): 58 steps, 39 preemptions, 132 tokens sampled for 64 needed"  # noqa: E501


def seed_state(mode: PreemptionMode, num_cpu_blocks: int = 0) -> SchedulerState:
    cfg = config(
        20,
        block_size=1,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        preemption_mode=mode,
        num_cpu_blocks=num_cpu_blocks,
    )
    return new_state(cfg, *((f"seq{i}", 5, 8) for i in range(8)))


def run_seed(mode: PreemptionMode, num_cpu_blocks: int = 0) -> tuple[RunFigures, int]:
    state = seed_state(mode, num_cpu_blocks)
    bound = drain_step_bound(state)
    plans: list[StepPlan] = []
    outputs: dict[str, tuple[int, ...]] = {}
    max_running = 0
    within = StepBound(bound)  # the proven bound itself: the run must hold it
    while has_unfinished_requests(state):
        within.tick(state)
        state, plan = checked_step(state)  # asserts R2: used <= capacity, every step
        plans.append(plan)
        max_running = max(max_running, len(state.running))
        for done in plan.finished:
            assert done.finish_reason is FinishReason.LENGTH
            outputs[done.request_id] = done.output_token_ids
    assert sorted(outputs) == [f"seq{i}" for i in range(8)]
    assert all(len(tokens) == 8 for tokens in outputs.values())
    assert state.num_free_gpu_blocks == 20
    return figures(plans, max_running), bound


CASES: dict[str, Callable[[], tuple[RunFigures, int]]] = {
    "recompute": lambda: run_seed(PreemptionMode.RECOMPUTE),
    "restart": lambda: run_seed(PreemptionMode.RESTART),
    "swap, 20 CPU blocks": lambda: run_seed(PreemptionMode.SWAP, 20),
    "swap, 4 CPU blocks (falls back)": lambda: run_seed(PreemptionMode.SWAP, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_seed_scenario(name: str, record_property: Callable[[str, object], None]) -> None:
    got, bound = CASES[name]()
    assert got.preemptions > 0
    record_property("figures", got.line())
    print(f"\nspec {name}: {got.line()}; drain bound {bound}\n{SEED}")


def test_seed_scenario_recompute_exact() -> None:
    """Pin the recompute figures so a change in the rules shows up here."""
    got, bound = run_seed(PreemptionMode.RECOMPUTE)
    assert (got.steps, got.preemptions, got.sampled_tokens) == (34, 12, 64)
    assert bound == 64


def test_seed_first_steps() -> None:
    """Step 0 admits 4 requests (20 slots); step 1 preempts the latest two, LIFO."""
    state = seed_state(PreemptionMode.RECOMPUTE)
    state, plan = checked_step(state)
    assert [c.request_id for c in plan.scheduled] == ["seq0", "seq1", "seq2", "seq3"]
    state, plan = checked_step(state)
    assert [p.request_id for p in plan.preempted] == ["seq3"]
    assert [c.request_id for c in plan.scheduled] == ["seq0", "seq1", "seq2"]
    assert [r.request_id for r in state.waiting][:2] == ["seq3", "seq4"]
