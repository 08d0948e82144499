"""vllm-v0/watermark on a fixed workload: the head of ``waiting`` is held back while its
blocks are free but not with the watermark left over, in lockstep with the spec.

The scheduler machine meets this path a few times per ci run (tests/stateful/coverage.py,
``WATERMARK_EVENT``: it needs a pool of 100 blocks or more whose free blocks are
exactly what the head needs), not on every stream; this workload takes it every time.
"""

from __future__ import annotations

import spec
from kvsched.peers.lockstep import Lockstep
from kvsched.peers.ours import SchedulerAdapter
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, Semantics
from tests.stateful.events import watermark_refused


def test_the_watermark_holds_back_an_admission() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=100,  # a watermark of one block
        block_size=1,
        max_num_batched_tokens=200,
        max_num_seqs=4,
        enable_chunked_prefill=False,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=100,
        semantics=Semantics.VLLM_V0,
    )
    lock = Lockstep(SchedulerAdapter(config), config, spec.HashOracle(vocab_size=256))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # r0's 60 blocks leave 40 free: exactly r1's prompt, but not r1's and the watermark.
    assert lock.add("r0", list(range(60)), params) is None
    assert lock.add("r1", list(range(100, 140)), params) is None
    refused: list[int] = []
    for _ in range(20):
        if not lock.unfinished():
            break
        advance = lock.advance()
        if watermark_refused(advance.before, advance.mid, advance.plan):
            refused.append(advance.plan.step)
    lock.finish()
    assert not lock.unfinished()
    assert refused and refused[0] == 0
    assert [f.request_id for f in lock.spec_finished] == ["r0", "r1"]
