"""The seed's control group: an engine that never preempts."""

from __future__ import annotations

from impl.engine import LLMEngine


class NoPreemptionEngine(LLMEngine):
    """The same batching as ``LLMEngine``, but never a preemption.

    Where ``LLMEngine`` would preempt (R5.3), ``step()`` raises
    ``KVCacheExhaustedError`` and changes nothing: ``used`` is the GPU blocks in use
    at that point of the step, ``needed`` the blocks the request must grow by,
    ``capacity`` is ``num_gpu_blocks``. Admission (R8) and R4 are unchanged.
    """

    enable_preemption = False
