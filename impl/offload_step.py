"""The engine's step under transformers/offload-starved: schedule first, offload after (T2-T9).

transformers' continuous batching (5.19.0) does not preempt while it schedules: its
``FIFOScheduler`` walks the candidates (decoding running requests, then prefilling
ones, then, unless admission is frozen, the CPU-offloaded and fresh waiting requests
alternately), schedules each whose blocks fit and *skips* the rest, recording the
running ones it starved; ``prepare_next_batch`` then offloads starved requests, newest
first, to the CPU pool or by a soft reset (a recompute), requeues them at the waiting
tail oldest first and freezes admission until a request finishes. If the walk
scheduled nothing, it offloads and walks again. docs/semantics.md, "transformers
rules", states each rule; this module implements them over the scheduler's mutable
state, independently of the spec.

A step here is rolled back from a ``Snapshot`` of the whole state (impl/snapshot.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from impl.block_manager import cdiv
from impl.scheduler_output import PreemptionRecord, SchedulerOutput
from impl.sequence import Sequence, SequenceStatus
from spec.types import PreemptionMode

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED

#: FIFOScheduler's default safety_margin (0.15) as a ratio of whole numbers: the walk
#: admits more than one prefill only while free * 20 >= 3 * total.
MARGIN_NUMERATOR, MARGIN_DENOMINATOR = 3, 20


def _candidates(sched: Scheduler) -> list[Sequence]:
    """T8, T9: the running requests (decoding first, which is their order: the one that
    may be mid-prefill is the newest), then (admission not frozen, or nothing running:
    the frozen-after-abort stall is not copied) the swapped and waiting requests
    alternately, swapped first."""
    running = sched.running
    order = list(running)
    if sched.admission_frozen and running:
        return order
    swapped = list(sched.swapped)
    waiting = sched.waiting.stored()
    for k in range(max(len(swapped), len(waiting))):
        order.extend(swapped[k : k + 1])
        order.extend(waiting[k : k + 1])
    return order


def walk(sched: Scheduler, out: SchedulerOutput) -> tuple[list[tuple[Sequence, int]], bool]:
    """T2-T4, T8: schedule each candidate whose chunk's blocks are free, skip the rest.

    Returns the starved running requests with the chunk they were refused (in walk
    order) and whether any candidate did not fit.
    """
    config = sched.config
    bs = sched.block_size
    gpu = sched.gpu
    total = config.num_gpu_blocks
    margin = gpu.num_free_blocks * MARGIN_DENOMINATOR >= MARGIN_NUMERATOR * total
    budget = config.max_num_batched_tokens
    seats = config.max_num_seqs
    starved: list[tuple[Sequence, int]] = []
    failed = False
    for seq in _candidates(sched):
        if not margin and out.scheduled and not seq.decoding:
            break
        remaining = seq.num_tokens - seq.num_computed
        n = remaining if remaining < budget else budget
        if cdiv(seq.num_computed + n, bs) - len(seq.block_table) > gpu.num_free_blocks:
            failed = True
            if seq.status is _RUNNING:
                starved.append((seq, n))
            continue
        if seq.status is _SWAPPED:
            sched.swapped.remove(seq)
            out.swapped_in.append((seq, list(seq.cpu_block_table)))
            _join(sched, seq)
            sched.num_cached_tokens += seq.num_computed
        elif seq.status is _WAITING:
            sched.waiting.remove(seq)
            _join(sched, seq)
            out.num_admitted += 1
        gpu.grow(seq.block_table, cdiv(seq.num_computed + n, bs))
        seq.decoding = n == remaining  # transformers sets DECODING when it schedules the rest
        out.scheduled.append(seq)
        out.num_scheduled.append(n)
        out.num_samples += n == remaining
        budget -= n
        seats -= 1
        if budget == 0 or seats == 0:
            break
    return starved, failed


def _join(sched: Scheduler, seq: Sequence) -> None:
    seq.status = _RUNNING
    sched.running.append(seq)


def offload(sched: Scheduler, out: SchedulerOutput, starved: list[tuple[Sequence, int]]) -> bool:
    """T5-T7, T9: offload starved requests until the rest fit or one runs; True if any.

    The newest starved goes first, its GPU blocks freed; then each victim, in that
    order, is swapped if the CPU pool holds its blocks, else soft reset (recomputed);
    they rejoin the tail of their queue oldest first, and admission freezes.
    """
    bs = sched.block_size
    gpu = sched.gpu
    starved = list(starved)
    victims: list[Sequence] = []
    tables: list[list[int]] = []  # the GPU blocks each victim held
    while starved and len(sched.running) - len(victims) > 1:
        left = gpu.num_free_blocks
        fits_all = True
        for seq, n in starved:
            need = cdiv(seq.num_computed + n, bs) - len(seq.block_table)
            if need > left:
                fits_all = False
                break
            left -= need
        if fits_all:
            break
        seq, _ = starved.pop()
        victims.append(seq)
        tables.append(list(seq.block_table))
        gpu.free(seq.block_table)
    if not victims:
        return False
    requeue: list[Sequence] = []
    for seq, gpu_blocks in zip(victims, tables, strict=True):
        index = sched.running.index(seq)
        del sched.running[index]
        sched.num_cached_tokens -= seq.num_computed
        seq.num_preemptions += 1
        seq.decoding = False
        mode = PreemptionMode.RECOMPUTE
        if sched.config.preemption_mode is PreemptionMode.SWAP and sched.cpu.can_allocate(
            len(gpu_blocks)
        ):
            mode = PreemptionMode.SWAP
            seq.cpu_block_table = sched.cpu.allocate(len(gpu_blocks))
            out.swap_out.extend(zip(gpu_blocks, seq.cpu_block_table, strict=True))
            seq.status = _SWAPPED
        else:
            seq.recomputed_until = max(seq.recomputed_until, seq.num_computed)
            seq.num_computed = 0
            seq.status = _WAITING
        out.preempted.append(PreemptionRecord(seq, mode, index, len(out.num_scheduled), gpu_blocks))
        requeue.append(seq)
    for seq in reversed(requeue):
        if seq.status is _SWAPPED:
            sched.swapped.append(seq)
        else:
            sched.waiting.push_back(seq)
    sched.admission_frozen = True
    return True


def schedule_offloading(sched: Scheduler, out: SchedulerOutput) -> None:
    """Phases A-C under transformers/offload-starved (``prepare_next_batch``'s order)."""
    starved, failed = walk(sched, out)
    while not out.scheduled and failed:
        if not offload(sched, out, starved):
            break  # unreachable under R4 (transformers raises RuntimeError here)
        starved, failed = walk(sched, out)
    if starved:
        offload(sched, out, starved)
    for seq, cpu_blocks in out.swapped_in:  # their K/V comes in after the offloads
        out.swap_in.extend(zip(cpu_blocks, seq.block_table, strict=False))
        sched.cpu.free(seq.cpu_block_table)
