"""The spec against the whole ``impl.LLMEngine`` with the tiny Llama in float64
(tests/stateful/subjects/engine.py): every profile but vllm-v0's, and vllm-v1 with
speculative decoding in every example (``SPECULATIVE_ENGINE``)."""

from __future__ import annotations

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.engine import ENGINE, SPECULATIVE_ENGINE, single_thread

EngineDifferential = machine_for(ENGINE)
SpeculativeEngineDifferential = machine_for(SPECULATIVE_ENGINE)


def test_engine_differential() -> None:
    with single_thread():
        run_machine(EngineDifferential)


def test_speculative_engine_differential() -> None:
    with single_thread():
        run_machine(SpeculativeEngineDifferential)
