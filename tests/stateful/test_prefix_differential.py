"""Our scheduler and engine with prefix caching on and shared-prefix workloads
(tests/stateful/subjects/scheduler.py, engine.py: ``PREFIX_SCHEDULER``, ``PREFIX_ENGINE``)."""

from __future__ import annotations

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.engine import PREFIX_ENGINE, single_thread
from tests.stateful.subjects.scheduler import PREFIX_SCHEDULER

PrefixSchedulerDifferential = machine_for(PREFIX_SCHEDULER)
PrefixEngineDifferential = machine_for(PREFIX_ENGINE)


def test_prefix_scheduler_differential() -> None:
    run_machine(PrefixSchedulerDifferential)


def test_prefix_engine_differential() -> None:
    with single_thread():
        run_machine(PrefixEngineDifferential)
