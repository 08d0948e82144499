"""Undo ``schedule()`` exactly, from the journal in its ``SchedulerOutput``.

Each of phases A-C is undone in reverse order of its operations, so the queues, block
tables, request fields and both free lists (their order included) return to their
values before the step. The engine calls this when the forward or sampling fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from impl.block_manager import cdiv
from impl.scheduler_output import PreemptionRecord, SchedulerOutput
from impl.sequence import SequenceStatus

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED


def rollback(sched: Scheduler, out: SchedulerOutput) -> None:
    """Undo ``schedule()`` exactly, in reverse order of its operations.

    Queues, block tables, request fields and both free lists (including their
    order) return to their values before ``schedule()``. K/V *contents* are the
    engine's business: a victim's freed GPU blocks may have been overwritten by
    the failed forward, and the engine restores them from a snapshot.
    """
    running = sched.running
    gpu = sched.gpu
    bs = sched.block_size
    num_running_chunks = len(out.num_scheduled) - len(out.swapped_in) - out.num_admitted
    for _ in range(out.num_admitted):  # phase C, last admitted first
        seq = running.pop()
        if sched.tracks_running:
            sched.policy.on_leave(seq)
        gpu.shrink(seq.block_table, 0)
        seq.num_computed = 0  # admitted after a prefix-cache hit, it started past 0
        seq.spec_token_ids = []  # a padded admission's (a waiting request has none)
        seq.status = _WAITING
        sched.waiting.unpop(seq)
    out.num_admitted = 0
    for seq, cpu_blocks in reversed(out.swapped_in):  # phase B
        popped = running.pop()
        assert popped is seq, "rollback out of order"
        if sched.tracks_running:
            sched.policy.on_leave(seq)
        gpu.shrink(seq.block_table, 0)
        sched.cpu.unfree(cpu_blocks)
        seq.cpu_block_table = cpu_blocks
        seq.status = _SWAPPED
        sched.swapped.appendleft(seq)
    out.swapped_in.clear()
    # Phase A: chunk allocations and preemptions, interleaved as they happened.
    # A victim whose chunk was undone (vllm-v1/priority-victim-any-running) comes back
    # with its grown block table and its chunk counted again, so that the chunks are
    # shrunk in the reverse order they were grown.
    preempted = out.preempted
    chunk_seqs = out.scheduled
    del chunk_seqs[num_running_chunks:]
    k = num_running_chunks
    while True:
        while preempted and preempted[-1].num_scheduled_before == k:
            record = preempted.pop()
            unpreempt(sched, record)
            if record.undone_chunk:
                chunk_seqs.insert(record.undone_chunk_index, record.seq)
                if sched.num_speculative_tokens:
                    out.tables_before.insert(record.undone_chunk_index, record.undone_table_before)
                k += 1
        if k == 0:
            break
        seq = chunk_seqs[k - 1]
        before = out.tables_before  # speculative decoding: the blocks it held ahead stay
        gpu.shrink(seq.block_table, before[k - 1] if before else cdiv(seq.num_computed, bs))
        k -= 1
    assert not preempted, "rollback out of order"
    out.num_scheduled.clear()
    out.tables_before.clear()
    out.scheduled = []
    out.swap_out.clear()
    out.swap_in.clear()
    out.num_samples = 0
    sched.num_cached_tokens = out.num_cached_tokens_before
    gpu.undo()  # a caching pool's journal: free queue order, reference counts, keys


def unpreempt(sched: Scheduler, record: PreemptionRecord) -> None:
    seq = record.seq
    if seq.status is _SWAPPED:
        popped = sched.swapped.pop()
        assert popped is seq, "rollback out of order"
        cpu_blocks = seq.cpu_block_table
        seq.cpu_block_table = []
        sched.cpu.unallocate(cpu_blocks)
    else:
        sched.waiting.unpush_front(seq)
        if record.dropped_outputs:
            seq.token_ids.extend(record.dropped_outputs)
            seq.num_tokens = len(seq.token_ids)
    sched.gpu.unfree(record.gpu_blocks)
    seq.block_table = record.gpu_blocks
    seq.num_computed = record.num_computed
    seq.recomputed_until = record.recomputed_until
    seq.num_output_placeholders = record.num_output_placeholders
    seq.num_stale_output_tokens = record.num_stale_output_tokens
    seq.spec_token_ids = record.spec_token_ids
    seq.decoding = record.decoding
    seq.num_preemptions -= 1
    seq.status = _RUNNING
    sched.running.insert(record.running_index, seq)
    if sched.tracks_running:
        sched.policy.on_run(seq)
