"""Shared helpers for the engine tests (no spec logic: expected values are hand-made
or come from running requests alone)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from spec.types import (
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    StepPlan,
)
from tests.drain import drain_within

SEED_PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


class SeedFigures(NamedTuple):
    """What a run of the seed's workload in ``seed_config(mode)`` does (ignoring EOS,
    with prompts of equal length: the same for any prompt tokens and model)."""

    steps: int
    preemptions_by_mode: dict[str, int]  # the modes used only
    swap_blocks: tuple[int, int]  # out, in
    recomputed_tokens: int
    scheduled_tokens: int
    sampled_tokens: int
    kv_utilization: float


#: docs/benchmarks.md, "3. The seed's workload" (``python -m bench.seed_workload``), with
#: the mean utilization of those runs (tokens in cache over the 20 slots, per step).
SEED_FIGURES = {
    PreemptionMode.RECOMPUTE: SeedFigures(34, {"recompute": 12}, (0, 0), 81, 177, 64, 0.8),
    PreemptionMode.RESTART: SeedFigures(57, {"restart": 14}, (0, 0), 105, 201, 113, 29 / 38),
    PreemptionMode.SWAP: SeedFigures(
        38, {"swap": 6, "recompute": 1}, (47, 47), 10, 106, 64, 68 / 95
    ),
}


def seed_prompts() -> list[list[int]]:
    """The seed tutorial's workload: 8 random 5-token prompts, seed 42, tokens 1..254."""
    rng = random.Random(42)
    return [[rng.randint(1, 254) for _ in range(5)] for _ in range(8)]


def seed_config(mode: PreemptionMode, **overrides: object) -> SchedulerConfig:
    """block_size 1, 20 GPU blocks (the seed's 20 KV slots), max_num_seqs 8, LIFO."""
    fields: dict[str, object] = {
        "num_gpu_blocks": 20,
        "block_size": 1,
        "max_num_seqs": 8,
        "preemption_mode": mode,
        "num_cpu_blocks": 20 if mode is PreemptionMode.SWAP else 0,
    }
    fields.update(overrides)
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def constant_sampler(token: int = 9) -> Callable[[SchedulerOutput], list[int]]:
    """A stub model: every sampling request draws ``token``."""

    def sample(out: SchedulerOutput) -> list[int]:
        return [token] * out.num_samples

    return sample


def hashed_sampler(vocab: int = 32) -> Callable[[SchedulerOutput], list[int]]:
    """A stub model whose token depends only on (request, output index), like a seeded one."""

    def sample(out: SchedulerOutput) -> list[int]:
        return [
            (sum(map(ord, seq.request_id)) * 31 + (seq.num_tokens - seq.num_prompt_tokens) * 7)
            % vocab
            for seq in out.samples()
        ]

    return sample


def drain(
    scheduler: Scheduler, sample: Callable[[SchedulerOutput], Sequence[int]]
) -> list[StepPlan]:
    plans = []
    bound = drain_within(scheduler.observe())
    while scheduler.has_unfinished_requests():
        bound.tick(scheduler.observe)
        plans.append(scheduler.step(sample))
        scheduler.check_invariants()
    return plans
