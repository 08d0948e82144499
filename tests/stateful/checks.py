"""The machine's named checks that read more than the lockstep comparison: a step's plan
on the spec's own rules, our scheduler's pools and block tables, the outputs after a
drain. Each fails with ``InvariantViolation`` under its name (tests/stateful/failures.py).
"""

from __future__ import annotations

import impl
import spec
from impl.block_manager import cdiv
from impl.scheduler import Scheduler
from spec.pipeline import applied_from
from spec.profiles import gpu_blocks_owned, model_len
from spec.types import FinishedRequest, FinishReason, SchedulerConfig, SchedulerState, StepPlan
from tests.oracles.pool import engine_pool_violations, spec_pool_violations
from tests.stateful.failures import InvariantViolation, fail, require


def check_step(
    before: SchedulerState, real_before: SchedulerState, plan: StepPlan, after: SchedulerState
) -> None:
    """``plan_valid`` (``spec.plan_violations``), ``no_idle_wait`` (Rule P on each side's
    own state before the step, so a starvation both sides share is caught too:
    docs/semantics.md) and ``step_progress`` (a step with live requests does something)."""
    violations = spec.plan_violations(before, plan, after)
    if violations:
        fail("plan_valid", f"step {before.num_steps}: {'; '.join(violations)}")
    for side, state in (("spec", before), ("real", real_before)):
        waits = spec.progress_violations(state, plan)
        if waits:
            fail("no_idle_wait", f"{side}: {'; '.join(waits)}")
    # Under async scheduling a step may only apply the step in flight (vllm-v1/async-*).
    applied = before.config.async_scheduling and applied_from(before, plan) is not None
    require(
        bool(plan.scheduled or plan.preempted or applied)
        or not spec.has_unfinished_requests(before),
        "step_progress",
        lambda: f"step {before.num_steps} did nothing with requests live",
    )


def kv_within_capacity(scheduler: Scheduler) -> None:
    """No OOM: used <= capacity on both real pools."""
    for name, pool in (("GPU", scheduler.gpu), ("CPU", scheduler.cpu)):
        if not 0 <= pool.num_used_blocks <= pool.num_blocks:
            fail(
                "kv_within_capacity",
                f"{name} uses {pool.num_used_blocks} of {pool.num_blocks} blocks",
            )


def blocks_conserved(scheduler: Scheduler) -> None:
    """free + owned == total on both pools, owned counted from the real block tables (a
    block shared under prefix caching counts once); no table holds a block twice; each
    running request has ``cdiv(computed, block_size)`` blocks (its reserve under
    tokenspeed/reserve-generation: ``spec.profiles.gpu_blocks_owned``)."""
    pools = (
        ("GPU", scheduler.gpu, [seq.block_table for seq in scheduler.running]),
        ("CPU", scheduler.cpu, [seq.cpu_block_table for seq in scheduler.swapped]),
    )
    shared = scheduler.config.enable_prefix_caching
    for name, pool, tables in pools:
        owned = [block for table in tables for block in table]
        if any(len(set(table)) != len(table) for table in tables) or (
            len(set(owned)) != len(owned) and not (shared and name == "GPU")
        ):
            fail("blocks_conserved", f"{name} block owned twice: {tables}")
        owned = list(dict.fromkeys(owned))  # PC1: a shared block counts once
        if pool.num_free_blocks + len(owned) != pool.num_blocks:
            fail(
                "blocks_conserved",
                f"{name}: free {pool.num_free_blocks} + owned {len(owned)} != {pool.num_blocks}",
            )
        try:
            pool.check()
        except impl.BlockAllocationError as error:
            raise InvariantViolation("blocks_conserved", f"{name}: {error}") from error
    config = scheduler.config
    drafts = config.num_speculative_tokens
    bs = config.block_size
    for seq in scheduler.running:
        if drafts:
            # vllm-v1/spec-rejected-blocks-kept: the blocks of at most K rejected drafts
            # stay (how many exactly is the lockstep's comparison with the spec's count).
            held = len(seq.block_table)
            if not cdiv(seq.num_computed, bs) <= held <= cdiv(seq.num_computed + drafts, bs):
                fail(
                    "blocks_conserved",
                    f"{seq!r} has {held} GPU blocks for {seq.num_computed} tokens and at "
                    f"most {drafts} rejected drafts",
                )
            continue
        # R2 by profile: under tokenspeed/reserve-generation the request's reserve.
        owns = gpu_blocks_owned(config, seq.to_state(), seq.num_computed)
        if len(seq.block_table) != owns:
            fail(
                "blocks_conserved",
                f"{seq!r} has {len(seq.block_table)} GPU blocks for {seq.num_computed} tokens",
            )


def real_self_check(scheduler: Scheduler) -> None:
    try:
        scheduler.check_invariants()
    except AssertionError as error:
        raise InvariantViolation("real_self_check", repr(error)) from error


def pools_empty_after_drain(state: SchedulerState, scheduler: Scheduler | None) -> None:
    """The drained-pool invariant (tests/oracles/pool.py) on the spec's state and, where
    the subject is our scheduler, on its pools: every block free once, nothing
    referenced, the keys whole and behind the unkeyed blocks in the free queue."""
    wrong = spec_pool_violations(state)
    if scheduler is not None:
        wrong += engine_pool_violations(scheduler)
    require(not wrong, "pools_empty_after_drain", lambda: "; ".join(wrong))


def outputs_match_solo(
    config: SchedulerConfig,
    prompt: tuple[int, ...],
    finished: FinishedRequest,
    solo: tuple[int, ...],
) -> None:
    """A finished request's outputs are its solo outputs; an aborted one's a prefix."""
    length = model_len(config)
    if length is not None:  # vllm-v1/max-model-len: a solo run stops there too
        # (vllm-v0's prompt of max_model_len tokens at its first output)
        solo = solo[: max(length - len(prompt), 1)]
    outputs = finished.output_token_ids
    if finished.finish_reason is FinishReason.ABORTED:
        ok = outputs == solo[: len(outputs)]
    else:
        ok = outputs == solo
    if not ok:
        fail(
            "outputs_match_solo",
            f"{finished.request_id!r} ({finished.finish_reason}, "
            f"{finished.num_preemptions} preemptions) produced {outputs}, alone {solo}",
        )
