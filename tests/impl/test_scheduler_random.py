"""Random operation sequences on the torch-free scheduler.

Properties checked without any reference implementation: R1/R2 invariants after
every operation (``check_invariants``), the plan's own consistency (budget, chunk
positions, sampling, finishing), exact rollback (a twin scheduler that never fails
makes the same plans and reaches the same state), aborts freeing exactly the
request's blocks, and a bounded drain.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from impl.block_manager import BlockManager, cdiv
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from spec.types import (
    FinishReason,
    InvalidRequestError,
    KVCacheExhaustedError,
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
)
from tests.drain import drain_within


class Boom(RuntimeError):
    pass


def token_for(request_id: str, output_index: int) -> int:
    """A deterministic stub model: the token depends on (request, output index) only."""
    return (sum(map(ord, request_id)) * 7 + output_index * 3) % 11


def sampler(out: SchedulerOutput) -> list[int]:
    return [token_for(s.request_id, s.num_tokens - s.num_prompt_tokens) for s in out.samples()]


def failing_sampler(out: SchedulerOutput) -> list[int]:
    sampler(out)
    raise Boom("injected fault")


def random_config(seed: int) -> SchedulerConfig:
    """Configurations under KV pressure: several requests fit, not all of them."""
    rng = random.Random(seed)
    return SchedulerConfig(
        num_gpu_blocks=rng.randint(4, 12),
        block_size=rng.choice([1, 1, 2, 3]),
        max_num_batched_tokens=rng.randint(2, 16),
        max_num_seqs=rng.randint(2, 6),
        enable_chunked_prefill=rng.random() < 0.7,
        preemption_mode=rng.choice(list(PreemptionMode)),
        num_cpu_blocks=rng.choice([0, 2, 4, 8, 16]),
        policy=rng.choice(["lifo", "priority", "fewest-outputs"]),
    )


# Hypothesis' own configurations reach the edges (1 block, budget 1, one sequence);
# the seeded ones keep the cache under pressure so that preemption is common.
configs = st.one_of(
    st.builds(
        SchedulerConfig,
        num_gpu_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 1, 2, 3]),
        max_num_batched_tokens=st.integers(1, 16),
        max_num_seqs=st.integers(1, 6),
        enable_chunked_prefill=st.booleans(),
        preemption_mode=st.sampled_from(list(PreemptionMode)),
        num_cpu_blocks=st.integers(0, 8),
        policy=st.sampled_from(["lifo", "priority", "fewest-outputs"]),
    ),
    st.integers(0, 2**32 - 1).map(random_config),
)


def random_operations(seed: int, length: int = 60) -> list[tuple[object, ...]]:
    """Mostly valid adds, some aborts, many steps (a fifth of them fail first)."""
    rng = random.Random(seed)
    operations: list[tuple[object, ...]] = []
    for _ in range(length):
        roll = rng.random()
        if roll < 0.4:
            invalid = rng.random() < 0.05
            operations.append(
                (
                    "add",
                    rng.randrange(12),
                    0 if invalid and rng.random() < 0.5 else rng.randint(1, 6),
                    0 if invalid else rng.randint(1, 8),
                    rng.randrange(3),
                    rng.choice([None, None, 3, 5]),
                )
            )
        elif roll < 0.47:
            operations.append(("abort", rng.randrange(14)))
        else:
            operations.append(("step", rng.random() < 0.2))
    return operations


ops = st.integers(0, 2**32 - 1).map(random_operations)


def free_lists(s: Scheduler) -> tuple[list[int], list[int]]:
    assert isinstance(s.gpu, BlockManager)  # these tests run with prefix caching off
    return list(s.gpu._free), list(s.cpu._free)


def check_plan(before: SchedulerState, plan: StepPlan, s: Scheduler) -> None:
    config = s.config
    assert plan.step == before.num_steps
    assert s.num_steps == before.num_steps + 1
    total = sum(c.num_tokens for c in plan.scheduled)
    assert total <= config.max_num_batched_tokens
    ids = [c.request_id for c in plan.scheduled]
    assert len(set(ids)) == len(ids), "a request scheduled twice"
    preempted = {p.request_id for p in plan.preempted}
    assert preempted.isdisjoint(ids)
    assert set(plan.swapped_in) <= set(ids)
    if plan.preempted:
        assert not plan.swapped_in
    computed_before = {
        r.request_id: r.num_computed_tokens
        for r in (*before.running, *before.swapped, *before.waiting)
    }
    tokens_before = {
        r.request_id: r.num_tokens for r in (*before.running, *before.swapped, *before.waiting)
    }
    sampled = {t.request_id: t.token_id for t in plan.sampled}
    for c in plan.scheduled:
        assert c.num_tokens >= 1
        assert c.start == computed_before[c.request_id]
        reaches_end = c.start + c.num_tokens == tokens_before[c.request_id]
        assert reaches_end == (c.request_id in sampled)
        assert c.start + c.num_tokens <= tokens_before[c.request_id]
    for f in plan.finished:
        assert f.request_id in sampled
        assert f.output_token_ids[-1] == sampled[f.request_id]
    assert len(s.running) <= config.max_num_seqs


@settings(max_examples=150, deadline=None)
@given(config=configs, operations=ops)
def test_random_operations_keep_invariants_and_roll_back_exactly(
    config: SchedulerConfig, operations: Sequence[tuple[object, ...]]
) -> None:
    s = Scheduler(config, vocab_size=16)
    twin = Scheduler(config, vocab_size=16)  # never fails
    for op in operations:
        kind = op[0]
        if kind == "add":
            _, rid, plen, max_tokens, priority, eos = op
            params = SamplingParams(
                max_tokens=int(max_tokens),  # type: ignore[call-overload]
                priority=int(priority),  # type: ignore[call-overload]
                eos_token_id=eos,  # type: ignore[arg-type]
            )
            prompt = [(i * 5 + 1) % 16 for i in range(int(plen))]  # type: ignore[call-overload]
            before = s.observe()
            try:
                s.add_request(f"r{rid}", prompt, params)
            except InvalidRequestError as err:
                assert s.observe() == before
                with pytest.raises(type(err)):
                    twin.add_request(f"r{rid}", prompt, params)
            else:
                twin.add_request(f"r{rid}", prompt, params)
        elif kind == "abort":
            rid = f"r{op[1]}"
            before = s.observe()
            live = {r.request_id: r for r in (*before.waiting, *before.running, *before.swapped)}
            if rid not in live:
                with pytest.raises(UnknownRequestError):
                    s.abort_request(rid)
                assert s.observe() == before
                continue
            state = live[rid]
            finished = s.abort_request(rid)
            assert twin.abort_request(rid) == finished
            assert finished.finish_reason is FinishReason.ABORTED
            assert finished.output_token_ids == state.output_token_ids
            owned = cdiv(state.num_computed_tokens, config.block_size)
            after = s.observe()
            in_running = any(r.request_id == rid for r in before.running)
            in_swapped = any(r.request_id == rid for r in before.swapped)
            assert after.num_free_gpu_blocks == before.num_free_gpu_blocks + owned * in_running
            assert after.num_free_cpu_blocks == before.num_free_cpu_blocks + owned * in_swapped
        else:
            before = s.observe()
            if op[1]:
                lists = free_lists(s)
                with pytest.raises(Boom):
                    s.step(failing_sampler)
                assert s.observe() == before
                assert free_lists(s) == lists
                s.check_invariants()
            plan = s.step(sampler)
            assert plan == twin.step(sampler)
            check_plan(before, plan, s)
            for p in plan.preempted:
                event(f"preempted: {p.mode}" + (" (step failed first)" if op[1] else ""))
            if plan.swapped_in:
                event("swapped in" + (" (step failed first)" if op[1] else ""))
        s.check_invariants()
        assert s.observe() == twin.observe()
        assert free_lists(s) == free_lists(twin)
    # Bounded drain: every accepted request finishes.
    bound = drain_within(s.observe())
    while s.has_unfinished_requests():
        before = s.observe()
        bound.tick(before)
        plan = s.step(sampler)
        check_plan(before, plan, s)
        s.check_invariants()
    assert s.gpu.num_free_blocks == config.num_gpu_blocks
    assert s.cpu.num_free_blocks == config.num_cpu_blocks


@settings(max_examples=60, deadline=None)
@given(config=configs, operations=ops)
def test_no_preemption_scheduler_raises_and_changes_nothing(
    config: SchedulerConfig, operations: Sequence[tuple[object, ...]]
) -> None:
    s = Scheduler(config, enable_preemption=False)
    for op in operations:
        if op[0] == "add":
            _, rid, plen, max_tokens, _, _ = op
            with contextlib.suppress(InvalidRequestError):
                s.add_request(
                    f"r{rid}",
                    [1] * int(plen),  # type: ignore[call-overload]
                    SamplingParams(max_tokens=int(max_tokens)),  # type: ignore[call-overload]
                )
        elif op[0] == "step":
            before = s.observe()
            lists = free_lists(s)
            try:
                plan = s.step(sampler)
            except KVCacheExhaustedError as err:
                assert s.observe() == before
                assert free_lists(s) == lists
                assert err.capacity == config.num_gpu_blocks
                assert err.used + err.needed > err.capacity
                assert f"used {err.used}" in str(err)
            else:
                assert plan.preempted == ()
        s.check_invariants()
