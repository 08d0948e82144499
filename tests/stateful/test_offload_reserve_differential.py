"""The spec against ``impl.Scheduler`` (toy model) under the transformers and tokenspeed
profiles (tests/stateful/subjects/transformers_cb.py, tokenspeed.py): the engine's
offload-after-schedule and reserve-the-generation steps (impl/offload_step.py,
impl/reserve_step.py) held to the spec's, with faults and bad requests, which the peers
do not have."""

from __future__ import annotations

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.tokenspeed import TOKENSPEED_SCHEDULER
from tests.stateful.subjects.transformers_cb import TRANSFORMERS_SCHEDULER

TransformersSchedulerDifferential = machine_for(TRANSFORMERS_SCHEDULER)
TokenSpeedSchedulerDifferential = machine_for(TOKENSPEED_SCHEDULER)


def test_transformers_scheduler_differential() -> None:
    run_machine(TransformersSchedulerDifferential)


def test_tokenspeed_scheduler_differential() -> None:
    run_machine(TokenSpeedSchedulerDifferential)
