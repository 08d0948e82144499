"""Transactional steps: a forward or a swap copy that raises rolls the step back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pytest

from impl import LLMEngine
from impl.scheduler_output import SchedulerOutput
from model import LlamaForCausalLM
from spec.types import FinishedRequest, PreemptionMode, StepPlan
from tests.drain import StepBound, drain_bound
from tests.impl.conftest import SoloFn
from tests.impl.helpers import SEED_PARAMS, seed_config, seed_prompts


class InjectedFault(RuntimeError):
    pass


def add_seed_requests(engine: LLMEngine) -> None:
    for i, prompt in enumerate(seed_prompts()):
        engine.add_request(f"r{i}", prompt, SEED_PARAMS)


def metrics_without_time(engine: LLMEngine) -> dict[str, Any]:
    values = asdict(engine.metrics)
    del values["step_time_s"]
    return values


def run_plans(engine: LLMEngine) -> list[StepPlan]:
    return step_expecting_faults(engine, [])


def tries(engine: LLMEngine) -> StepBound:
    """A drain's budget where each step may fail once before its retry succeeds."""
    return StepBound(2 * drain_bound(engine.observe()))


def outputs_of(plans: list[StepPlan]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for plan in plans for f in plan.finished}


def fail_when(
    real: Callable[[SchedulerOutput], list[int]],
    condition: Callable[[SchedulerOutput], bool],
    *,
    run_first: bool,
) -> tuple[Callable[[SchedulerOutput], list[int]], list[int]]:
    """Wrap ``execute``: where ``condition`` holds (once per step), optionally run the
    real forward first (so it writes K/V), then raise."""
    failed_steps: list[int] = []

    def execute(out: SchedulerOutput) -> list[int]:
        if condition(out) and out.step not in failed_steps:
            failed_steps.append(out.step)
            if run_first:
                real(out)
            raise InjectedFault(f"fault in step {out.step}")
        return real(out)

    return execute, failed_steps


def step_expecting_faults(engine: LLMEngine, failed_steps: list[int]) -> list[StepPlan]:
    """Step to the end; every injected fault must leave observe() and the metrics as
    they were before the step; the retry then goes on."""
    plans = []
    bound = tries(engine)
    while engine.has_unfinished_requests():
        before = engine.observe()
        bound.tick(before)
        metrics = metrics_without_time(engine)
        failures = len(failed_steps)
        try:
            plans.append(engine.step())
        except InjectedFault:
            assert len(failed_steps) == failures + 1
            assert engine.observe() == before
            assert metrics_without_time(engine) == metrics
            engine.scheduler.check_invariants()
    return plans


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_forward_fault_after_writing_kv_in_preempting_steps(
    mode: PreemptionMode, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    clean = LLMEngine(seed_config(mode), model=model64)
    add_seed_requests(clean)
    clean_plans = run_plans(clean)

    engine = LLMEngine(seed_config(mode), model=model64)
    add_seed_requests(engine)
    # Fail every step that preempts, after the forward has written its K/V (into
    # blocks that the victims gave up, which the rollback must restore).
    execute, failed = fail_when(
        engine.model_runner.execute, lambda out: bool(out.preempted), run_first=True
    )
    setattr(engine.model_runner, "execute", execute)  # noqa: B010 (a test double)
    plans = step_expecting_faults(engine, failed)
    assert len(failed) == sum(1 for plan in clean_plans if plan.preempted) > 0
    assert plans == clean_plans
    assert metrics_without_time(engine) == metrics_without_time(clean)
    results = outputs_of(plans)
    for i, prompt in enumerate(seed_prompts()):
        assert results[f"r{i}"].output_token_ids == solo(prompt, SEED_PARAMS)


def test_forward_fault_in_every_step_once(model64: LlamaForCausalLM) -> None:
    config = seed_config(PreemptionMode.RECOMPUTE, block_size=2, num_gpu_blocks=12)
    clean = LLMEngine(config, model=model64)
    add_seed_requests(clean)
    clean_plans = run_plans(clean)

    engine = LLMEngine(config, model=model64)
    add_seed_requests(engine)
    execute, failed = fail_when(engine.model_runner.execute, lambda out: True, run_first=True)
    setattr(engine.model_runner, "execute", execute)  # noqa: B010 (a test double)
    plans = step_expecting_faults(engine, failed)
    assert len(failed) == len(clean_plans)
    assert plans == clean_plans


def test_forward_fault_before_the_forward_and_a_fault_that_stays(
    model64: LlamaForCausalLM,
) -> None:
    engine = LLMEngine(seed_config(PreemptionMode.RECOMPUTE), model=model64)
    add_seed_requests(engine)
    engine.step()
    real = engine.model_runner.execute

    def broken(out: SchedulerOutput) -> list[int]:
        raise InjectedFault("device lost")

    setattr(engine.model_runner, "execute", broken)  # noqa: B010
    before = engine.observe()
    for _ in range(3):
        with pytest.raises(InjectedFault):
            engine.step()
        assert engine.observe() == before
    assert engine.metrics.steps == 1
    setattr(engine.model_runner, "execute", real)  # noqa: B010
    plan = engine.step()
    assert plan.step == 1


@pytest.mark.parametrize("copy", ["swap_out", "swap_in"])
@pytest.mark.parametrize("run_first", [False, True])
def test_swap_copy_fault_rolls_back(
    copy: str, run_first: bool, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    mode = PreemptionMode.SWAP
    clean = LLMEngine(seed_config(mode), model=model64)
    add_seed_requests(clean)
    clean_plans = run_plans(clean)

    engine = LLMEngine(seed_config(mode), model=model64)
    add_seed_requests(engine)
    real = getattr(engine.cache_engine, copy)
    calls: list[int] = []

    def faulty(mapping: list[tuple[int, int]]) -> None:
        calls.append(len(mapping))
        if len(calls) % 2 == 1:  # every copy fails once, then succeeds on the retry
            if run_first:
                real(mapping)
            raise InjectedFault(f"{copy} failed")
        real(mapping)

    setattr(engine.cache_engine, copy, faulty)
    plans = []
    faults = 0
    bound = tries(engine)
    while engine.has_unfinished_requests():
        before = engine.observe()
        bound.tick(before)
        try:
            plans.append(engine.step())
        except InjectedFault:
            faults += 1
            assert engine.observe() == before
            engine.scheduler.check_invariants()
    assert faults > 0
    assert plans == clean_plans
    results = outputs_of(plans)
    for i, prompt in enumerate(seed_prompts()):
        assert results[f"r{i}"].output_token_ids == solo(prompt, SEED_PARAMS)


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.RESTART])
def test_victim_kept_after_rollback_reads_restored_kv(
    mode: PreemptionMode, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    """After a failed preempting step the victim is running again with its blocks. If
    the caller then frees room (aborts), the retry does not preempt it and it decodes
    from the K/V that the failed forward overwrote: the rollback must have restored it.
    """
    engine = LLMEngine(seed_config(mode), model=model64)
    add_seed_requests(engine)
    engine.step()  # r0..r3 admitted: 4 x 5 blocks, free 0
    real = engine.model_runner.execute
    execute, failed = fail_when(real, lambda out: bool(out.preempted), run_first=True)
    setattr(engine.model_runner, "execute", execute)  # noqa: B010 (a test double)
    before = engine.observe()
    with pytest.raises(InjectedFault):
        engine.step()  # r3 was the victim; r0..r2 wrote into its old blocks
    assert failed == [1]
    assert engine.observe() == before
    setattr(engine.model_runner, "execute", real)  # noqa: B010
    for rid in ("r0", "r1", "r2"):
        engine.abort_request(rid)
    plans = run_plans(engine)
    results = outputs_of(plans)
    prompts = seed_prompts()
    assert set(results) == {f"r{i}" for i in range(3, 8)}
    for i in range(3, 8):
        assert results[f"r{i}"].output_token_ids == solo(prompts[i], SEED_PARAMS)
