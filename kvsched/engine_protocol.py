"""The engine surface the command line drives (``impl.LLMEngine`` satisfies it).

``scheduler`` is read for its counters only (``kvsched.drive.sample``: queue lengths,
free blocks, the waiting head), which cost O(1) where ``observe()`` walks every live
request. Imported for types only, so that importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from spec.types import SamplingParams, SchedulerState, StepPlan

if TYPE_CHECKING:
    from impl.engine import EngineMetrics
    from impl.scheduler import Scheduler


class Engine(Protocol):
    metrics: EngineMetrics
    scheduler: Scheduler

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> StepPlan: ...

    def has_unfinished_requests(self) -> bool: ...

    def observe(self) -> SchedulerState: ...
