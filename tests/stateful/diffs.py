"""Readable differences between the real side's values and the spec's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from spec.types import SchedulerState, StepPlan

#: A plan's fields decided by phases A-C (compared before any token is involved).
DECISIONS: Final = ("step", "scheduled", "preempted", "swapped_in")
ALL_FIELDS: Final = (*DECISIONS, "sampled", "finished")


def plan_diff(real: StepPlan, reference: StepPlan, fields: Sequence[str] = ALL_FIELDS) -> str:
    parts = []
    for name in fields:
        a, b = getattr(real, name), getattr(reference, name)
        if a != b:
            parts.append(f"{name}: real {a!r} != spec {b!r}")
    return "; ".join(parts) or "(equal)"


def state_diff(real: SchedulerState, reference: SchedulerState) -> str:
    parts = []
    for name in (
        "num_free_gpu_blocks",
        "num_free_cpu_blocks",
        "waiting",
        "running",
        "swapped",
        "next_arrival",
        "num_steps",
        "config",
    ):
        a, b = getattr(real, name), getattr(reference, name)
        if a != b:
            parts.append(f"{name}: real {a!r} != spec {b!r}")
    return "; ".join(parts) or "(equal)"
