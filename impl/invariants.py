"""R1, R2 and PC1 asserted on the scheduler's whole state, for tests (O(everything)).

Every live request is in exactly one queue with the status of that queue; waiting
requests hold no blocks; running and swapped ones hold ``cdiv(num_computed, bs)``
blocks of their pool (a running one, under speculative decoding, also the blocks of
its rejected drafts); free + owned == total in both pools; the cached-token counter
and the policy's own state agree with the queues.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from impl.block_manager import cdiv
from impl.reserve_step import reserve_blocks
from impl.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED


def check_invariants(sched: Scheduler) -> None:
    """Assert R1 and R2 on the whole state (O(everything): for tests)."""
    bs = sched.block_size
    seen: set[str] = set()
    queues: list[tuple[SequenceStatus, list[Sequence]]] = [
        (_WAITING, sched.waiting.stored()),
        (_RUNNING, sched.running),
        (_SWAPPED, list(sched.swapped)),
    ]
    cpu_owned = 0
    cached = 0
    for status, queue in queues:
        for seq in queue:
            assert seq.status is status, seq
            assert seq.request_id not in seen, seq
            assert sched.requests.get(seq.request_id) is seq, seq
            seen.add(seq.request_id)
            assert seq.num_tokens == len(seq.token_ids), seq
            if status is _WAITING:
                assert seq.num_computed == 0, seq
                assert not seq.block_table and not seq.cpu_block_table, seq
            else:
                # vllm-v1/async-placeholders: computed runs past the known tokens.
                assert 1 <= seq.num_computed < seq.num_tokens + seq.num_output_placeholders, seq
                owned = cdiv(seq.num_computed, bs)
                if status is _RUNNING and sched.reserves_generation:
                    owned = reserve_blocks(seq, bs)  # tokenspeed/reserve-generation
                if status is _RUNNING:
                    # vllm-v1/spec-rejected-blocks-kept: the blocks of up to K rejected
                    # drafts stay in the table.
                    ahead = len(seq.block_table) - owned
                    drafts = sched.num_speculative_tokens
                    most = cdiv(seq.num_computed + drafts, bs) - cdiv(seq.num_computed, bs)
                    assert 0 <= ahead <= most and not seq.cpu_block_table, seq
                    cached += seq.num_computed
                else:
                    assert len(seq.cpu_block_table) == owned and not seq.block_table, seq
                    cpu_owned += owned
    assert seen == set(sched.requests), "a live request is in no queue"
    # PC1: a block shared by prefix caching counts once, and each block's reference
    # count is its holders (1 in a pool without caching, which shares nothing).
    holders = Counter(block for seq in sched.running for block in seq.block_table)
    for block, count in holders.items():
        assert sched.gpu.ref_count(block) == count, f"block {block}: wrong reference count"
    gpu_owned = len(holders)
    assert sched.gpu.num_free_blocks + gpu_owned == sched.gpu.num_blocks, "GPU blocks leak"
    assert sched.cpu.num_free_blocks + cpu_owned == sched.cpu.num_blocks, "CPU blocks leak"
    assert cached == sched.num_cached_tokens, "cached-token counter drifted"
    sched.policy.check_invariants(sched.running)
    sched.gpu.check()
    sched.cpu.check()
