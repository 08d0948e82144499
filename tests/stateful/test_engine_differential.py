"""The spec against the whole ``impl.LLMEngine`` with the tiny Llama in float64
(tests/stateful/subjects/engine.py)."""

from __future__ import annotations

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.engine import ENGINE, single_thread

EngineDifferential = machine_for(ENGINE)


def test_engine_differential() -> None:
    with single_thread():
        run_machine(EngineDifferential)
