"""The mutable engine: scheduler, block manager, KV pools and model runner.

It implements docs/semantics.md (R1-R11) independently of ``spec/``: it imports only
the shared plain types of ``spec.types``. The scheduler and block manager need no
torch; ``LLMEngine`` and ``NoPreemptionEngine`` (which import ``model``) are loaded
on first use so that ``from impl import Scheduler`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import impl._clash  # noqa: F401  (first: names a shadowed spec/impl/model)
from impl.block_manager import BlockAllocationError, BlockManager
from impl.policies import POLICIES, Policy, make_policy
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from impl.engine import EngineMetrics, LLMEngine
    from impl.no_preemption import NoPreemptionEngine

__all__ = [
    "POLICIES",
    "BlockAllocationError",
    "BlockManager",
    "EngineMetrics",
    "LLMEngine",
    "NoPreemptionEngine",
    "Policy",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "make_policy",
]

_LAZY = {
    "EngineMetrics": "impl.engine",
    "LLMEngine": "impl.engine",
    "NoPreemptionEngine": "impl.no_preemption",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'impl' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
