"""The engine's step under the tokenspeed profile: TokenSpeed's plan (TS1-TS6).

TokenSpeed's scheduler (tokenspeed-scheduler 0.1.42, Fused role, prefix cache off,
prefill and decode in separate plans) takes its requests in submission order: first
local prefill work, the prompts already prefilling (one more chunk each), then new
prompts, each of which reserves the pages of its whole generation and is skipped when
they are not free; a chunk that leaves a prefill incomplete ends the prefill work. Only
a plan with no prefill work decodes, every request that has sampled, one token each,
while the token budget lasts. docs/semantics.md, "tokenspeed rules", states each rule;
this module implements them over the scheduler's mutable state, independently of the
spec. Nothing is ever preempted. A step is rolled back from a ``Snapshot``
(impl/snapshot.py).
"""

from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING

from impl.block_manager import cdiv
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

#: TokenSpeed's kRetractionSafeSteps: the most decode tokens an admission reserves.
SAFE_DECODE_TOKENS = 4096


def reserve_blocks(seq: Sequence, block_size: int) -> int:
    """TS1: the blocks an admission takes for the whole generation (prompt + max_tokens)."""
    return cdiv(min(seq.stop_len, seq.num_prompt_tokens + SAFE_DECODE_TOKENS), block_size)


def _schedule(out: SchedulerOutput, seq: Sequence, n: int) -> None:
    out.scheduled.append(seq)
    out.num_scheduled.append(n)
    if seq.num_computed + n == seq.num_tokens:
        out.num_samples += 1
        seq.decoding = True  # PrefillDone, then Decoding: it decodes in later plans


def schedule_reserving(sched: Scheduler, out: SchedulerOutput) -> None:
    """Phases A-C under tokenspeed: prefill work, else the decode batch."""
    config = sched.config
    sched.ids_held = ()  # TS8: the plan erases the requests that finished before it
    budget = config.max_num_batched_tokens
    running = sched.running
    head_of_line = False
    for seq in running:  # TS4: resident prefills, in submission order
        if seq.decoding or budget == 0:
            continue
        rest = seq.num_tokens - seq.num_computed
        n = min(rest, budget)
        _schedule(out, seq, n)
        budget -= n
        if n < rest:
            head_of_line = True
            break
    if not head_of_line:
        budget = _admit(sched, out, budget)
    if out.scheduled:
        return
    for seq in running:  # TS3: the decode batch, only in a plan with no prefill
        if budget == 0:
            break
        if seq.decoding:
            _schedule(out, seq, 1)
            budget -= 1


def _admit(sched: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """TS1, TS5, TS6: new prompts, skipped when their reserve is not free."""
    config = sched.config
    gpu = sched.gpu
    for seq in sched.waiting.stored():
        if len(sched.running) >= config.max_num_seqs or budget == 0:
            break
        blocks = reserve_blocks(seq, sched.block_size)
        if blocks > gpu.num_free_blocks:
            continue
        sched.waiting.remove(seq)
        gpu.grow(seq.block_table, blocks)
        seq.status = SequenceStatus.RUNNING
        insort(sched.running, seq, key=lambda s: s.arrival)  # TS6: submission order
        out.num_admitted += 1
        n = min(seq.num_tokens, budget)
        _schedule(out, seq, n)
        budget -= n
        if n < seq.num_tokens:
            break  # TS4: an incomplete first chunk holds the head of the line
    return budget
