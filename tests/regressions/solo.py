"""Each request's outputs in a shared run against its run alone (the regressions' oracle)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from impl import LLMEngine
from kvsched.results import RunResult
from kvsched.runner import run_workload
from kvsched.workload import WorkloadRequest
from model import LlamaForCausalLM
from spec.types import SchedulerConfig


def assert_outputs_are_solo(
    model: LlamaForCausalLM,
    alone: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    result: RunResult,
) -> None:
    """Every request of ``result`` got the greedy outputs it gets alone (arriving at step
    0, in a float64 engine of config ``alone``)."""
    for request, outcome in zip(workload, result.outcomes, strict=True):
        solo = run_workload(
            LLMEngine(alone, model=model, dtype="float64"),
            alone,
            [dataclasses.replace(request, arrival_step=0)],
        )
        assert outcome.output == solo.outcomes[0].output, request.request_id
