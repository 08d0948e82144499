"""Property tests: random configs and event sequences (Hypothesis, pure toy oracle).

Configs: ``block_size`` in {1, 2, 4, 16}, GPU pools of at most about 40 tokens (so
preemption happens), all preemption modes, all policies, chunked prefill on and off.
Events: adds (some empty, some with ``max_tokens`` 0, some duplicates, some that can
never fit), aborts (of live and unknown ids) and steps.
"""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from spec import (
    POLICIES,
    FinishReason,
    drain_step_bound,
    has_unfinished_requests,
)
from tests.spec.scenarios import (
    Played,
    Scenario,
    drain_played,
    play,
    random_scenario,
    run_alone,
    scenarios,
)

NON_LIFO_FACTOR = 4  # other policies must drain within this multiple of the LIFO bound


def finish(played: Played, scenario: Scenario) -> tuple[int, int]:
    """Drain; return ``(bound, steps taken)``. LIFO must drain within the bound."""
    bound = drain_step_bound(played.state)
    lifo = scenario.config.policy == "lifo"
    limit = bound if lifo else NON_LIFO_FACTOR * bound
    taken = drain_played(played, scenario, limit)
    assert not has_unfinished_requests(played.state), (
        f"{scenario.config.policy}: not drained within {limit} steps (bound {bound})"
    )
    return bound, taken


def check_every_request_reported_once(played: Played) -> None:
    assert len(played.reported) == len(played.accepted)
    assert not played.live
    state = played.state
    assert state.num_free_gpu_blocks == state.config.num_gpu_blocks
    assert state.num_free_cpu_blocks == state.config.num_cpu_blocks


@given(scenarios())
def test_random_runs_keep_every_invariant_and_drain(scenario: Scenario) -> None:
    """Invariants and step checks after every transition; inputs never change;
    every accepted request is reported exactly once; LIFO drains within the bound."""
    played = play(scenario)
    finish(played, scenario)
    check_every_request_reported_once(played)
    plans = [entry[1] for entry in played.trace if isinstance(entry, tuple) and entry[0] == "step"]
    modes = sorted({p.mode.value for plan in plans for p in plan.preempted})
    event(f"preemption modes used: {modes}")
    event(f"swapped in: {any(plan.swapped_in for plan in plans)}")
    event(f"finished requests: {min(len(played.completed), 5)}+")


@given(scenarios())
def test_same_inputs_same_outputs(scenario: Scenario) -> None:
    first = play(scenario)
    second = play(scenario)
    assert first.trace == second.trace
    assert first.state == second.state


@given(scenarios())
def test_preemption_never_changes_outputs(scenario: Scenario) -> None:
    """The oracle is a function of the prefix: whatever was preempted, restarted,
    swapped or chunked, each request's outputs equal those it gets alone."""
    played = play(scenario)
    finish(played, scenario)
    for add, done in played.completed:
        alone = run_alone(scenario.config, add, scenario.oracle)
        assert done.output_token_ids == alone.output_token_ids, add
        assert done.finish_reason == alone.finish_reason
        assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@given(scenarios(policies=("lifo",)), st.integers(0, 10**6))
def test_drain_bound_holds_from_intermediate_states(scenario: Scenario, cut: int) -> None:
    """Cut the event list anywhere: from that state LIFO drains within the bound."""
    if scenario.events:
        cut %= len(scenario.events)
        scenario = dataclasses.replace(scenario, events=scenario.events[:cut])
    played = play(scenario)
    finish(played, scenario)


@given(st.data())
def test_values_are_frozen(data: st.DataObject) -> None:
    scenario = data.draw(scenarios())
    state = play(scenario).state
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.num_steps = 7  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.config.num_gpu_blocks = 7  # type: ignore[misc]
    assert isinstance(state.waiting, tuple)
    assert isinstance(state.running, tuple)
    assert isinstance(state.swapped, tuple)


def _ratio_line(policy: str, what: str, ratios: list[float]) -> str:
    deciles = statistics.quantiles(ratios, n=10)
    return (
        f"{policy:15s} {what}: min {min(ratios):.2f}, p10 {deciles[0]:.2f}, "
        f"median {statistics.median(ratios):.2f}, p90 {deciles[-1]:.2f}, "
        f"max {max(ratios):.2f} ({len(ratios)} drains)"
    )


@pytest.mark.parametrize("burst", [False, True], ids=["random-events", "burst"])
def test_drain_bound_ratio_report(burst: bool) -> None:
    """Seeded random scenarios: how loose the drain bound is (LIFO), and how the other
    policies compare with it. ``burst``: 3-8 requests arrive at once, then drain.
    Run with ``-rP`` to see the figures."""
    lines = []
    preemptions = 0
    for policy in sorted(POLICIES):
        rng = random.Random(20240611)
        ratios: list[float] = []
        for _ in range(150):
            num_events = rng.randint(3, 8) if burst else 40
            scenario = random_scenario(rng, policy, num_events, burst=burst)
            played = play(scenario)
            if not has_unfinished_requests(played.state):
                continue
            bound, taken = finish(played, scenario)
            preemptions += sum(
                len(entry[1].preempted)
                for entry in played.trace
                if isinstance(entry, tuple) and entry[0] == "step"
            )
            ratios.append(bound / taken if policy == "lifo" else taken / bound)
        lines.append(
            _ratio_line(policy, "bound/actual" if policy == "lifo" else "actual/bound", ratios)
        )
        if policy == "lifo":
            assert min(ratios) >= 1.0
    assert preemptions > 0
    print(f"\n{'burst' if burst else 'random events'}, {preemptions} preemptions:")
    print("\n".join(lines))
