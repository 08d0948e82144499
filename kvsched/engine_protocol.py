"""The engine surface the command line drives (``impl.LLMEngine`` satisfies it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from impl.engine import EngineMetrics
from spec.types import SamplingParams, SchedulerState, StepPlan


class Engine(Protocol):
    metrics: EngineMetrics

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> StepPlan: ...

    def has_unfinished_requests(self) -> bool: ...

    def observe(self) -> SchedulerState: ...
