"""Small builders and checked runners shared by the spec tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from spec import (
    FinishedRequest,
    HashOracle,
    PreemptionMode,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOracle,
    add_request,
    init_state,
    plan_violations,
    state_violations,
    step,
)

ORACLE = HashOracle(vocab_size=1000)


def config(
    num_gpu_blocks: int,
    *,
    block_size: int = 1,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    enable_chunked_prefill: bool = True,
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
    num_cpu_blocks: int = 0,
    policy: str = "lifo",
) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode,
        num_cpu_blocks=num_cpu_blocks,
        policy=policy,
    )


def prompt(length: int, first: int = 1) -> tuple[int, ...]:
    return tuple(range(first, first + length))


def add(
    state: SchedulerState,
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    *,
    eos_token_id: int | None = None,
    ignore_eos: bool = False,
    priority: int = 0,
) -> SchedulerState:
    params = SamplingParams(
        max_tokens=max_tokens, eos_token_id=eos_token_id, ignore_eos=ignore_eos, priority=priority
    )
    return add_request(state, request_id, prompt(prompt_len, 10 * len(request_id)), params)


def new_state(cfg: SchedulerConfig, *requests: tuple[str, int, int]) -> SchedulerState:
    """A fresh state with ``(id, prompt_len, max_tokens)`` requests added in order."""
    state = init_state(cfg)
    for request_id, prompt_len, max_tokens in requests:
        state = add(state, request_id, prompt_len, max_tokens)
    return state


def checked_step(
    state: SchedulerState, tokens: Mapping[str, int] | TokenOracle = ORACLE
) -> tuple[SchedulerState, StepPlan]:
    """``step``, asserting the state and step invariants."""
    after, plan = step(state, tokens)
    problems = state_violations(after) + plan_violations(state, plan, after)
    assert not problems, problems
    return after, plan


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    """The plan's chunks as ``(id, start, num_tokens)``."""
    return [(c.request_id, c.start, c.num_tokens) for c in plan.scheduled]


def ids(requests: Sequence[RequestState | FinishedRequest]) -> list[str]:
    return [r.request_id for r in requests]


@dataclasses.dataclass(frozen=True)
class RunFigures:
    """What a run cost: the figures the seed tutorial's comparison uses."""

    steps: int
    preemptions: int
    scheduled_tokens: int  # KV positions computed, re-prefills included
    recomputed_tokens: int  # positions computed again after a preemption lost them
    sampled_tokens: int  # tokens sampled, including ones later discarded by restart
    max_running: int

    def line(self) -> str:
        return (
            f"{self.steps} steps, {self.preemptions} preemptions, "
            f"{self.scheduled_tokens} tokens computed ({self.recomputed_tokens} recomputed), "
            f"{self.sampled_tokens} tokens sampled, at most {self.max_running} running"
        )


def figures(plans: Sequence[StepPlan], max_running: int = 0) -> RunFigures:
    high_water: dict[str, int] = {}
    recomputed = 0
    for plan in plans:
        for chunk in plan.scheduled:
            seen = high_water.get(chunk.request_id, 0)
            end = chunk.start + chunk.num_tokens
            recomputed += max(0, min(seen, end) - chunk.start)
            high_water[chunk.request_id] = max(seen, end)
    return RunFigures(
        steps=len(plans),
        preemptions=sum(len(p.preempted) for p in plans),
        scheduled_tokens=sum(c.num_tokens for p in plans for c in p.scheduled),
        recomputed_tokens=recomputed,
        sampled_tokens=sum(len(p.sampled) for p in plans),
        max_running=max_running,
    )
