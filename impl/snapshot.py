"""A whole-state snapshot of the scheduler, for rolling back a step that keeps no journal.

The kvsched phases record every change of a step in its ``SchedulerOutput`` and undo
them in reverse (impl/rollback.py). The transformers and tokenspeed steps
(impl/offload_step.py, impl/reserve_step.py) instead record this snapshot of every
queue, request field, block table and free list before they start, and a rollback puts
it back whole: O(live requests + blocks) per step under those profiles.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from impl.block_manager import BlockManager

if TYPE_CHECKING:
    from impl.scheduler import Scheduler


class Snapshot:
    """Everything a step under this profile may change, to put back on rollback."""

    __slots__ = (
        "cached",
        "cpu",
        "fields",
        "frozen",
        "gpu",
        "held",
        "running",
        "swapped",
        "waiting",
    )

    def __init__(self, sched: Scheduler) -> None:
        self.running = list(sched.running)
        self.waiting = sched.waiting.stored()
        self.swapped = list(sched.swapped)
        self.fields = [
            (
                seq,
                seq.status,
                seq.num_computed,
                list(seq.block_table),
                list(seq.cpu_block_table),
                seq.num_preemptions,
                seq.recomputed_until,
                seq.decoding,
            )
            for seq in sched.requests.values()
        ]
        gpu = sched.gpu
        assert isinstance(gpu, BlockManager), "transformers: no prefix caching"
        self.gpu = gpu.snapshot()
        self.cpu = sched.cpu.snapshot()
        self.frozen = sched.admission_frozen
        self.held = sched.ids_held
        self.cached = sched.num_cached_tokens

    def restore(self, sched: Scheduler) -> None:
        sched.running[:] = self.running
        sched.waiting = sched.policy.new_waiting_queue()
        for seq in self.waiting:
            sched.waiting.push_back(seq)
        sched.swapped = deque(self.swapped)
        for seq, status, computed, table, cpu_table, preemptions, until, decoding in self.fields:
            seq.status = status
            seq.num_computed = computed
            seq.block_table[:] = table
            seq.cpu_block_table[:] = cpu_table
            seq.num_preemptions = preemptions
            seq.recomputed_until = until
            seq.decoding = decoding
        gpu = sched.gpu
        assert isinstance(gpu, BlockManager), "transformers: no prefix caching"
        gpu.restore(self.gpu)
        sched.cpu.restore(self.cpu)
        sched.admission_frozen = self.frozen
        sched.ids_held = self.held
        sched.num_cached_tokens = self.cached
