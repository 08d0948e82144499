"""The spec against ``impl.Scheduler`` with a toy model (tests/stateful/subjects/scheduler.py)."""

from __future__ import annotations

import impl
import spec
from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.scheduler import SCHEDULER

SchedulerDifferential = machine_for(SCHEDULER)


def test_policy_registries_match() -> None:
    """Both sides register the same policy names (R9); the machines draw from them, so a
    new policy is picked up by the suite without any wiring."""
    assert sorted(spec.POLICIES) == sorted(impl.POLICIES)


def test_scheduler_differential() -> None:
    run_machine(SchedulerDifferential)
