"""vllm-v1/priority-victim-any-running on a fixed workload: a victim already scheduled in
the step loses its chunk, in lockstep with the spec, with async scheduling off and on.

The scheduler machine meets this path about once per ci run (tests/stateful/coverage.py,
``UNDONE_VICTIM_EVENT``), too rarely to require it of every stream; this workload
(tests/peers/repros/priority_victim_scheduled.jsonl, where vLLM's real scheduler also
takes it) reaches it every time.
"""

from __future__ import annotations

import pytest

import spec
from kvsched.peers.lockstep import Lockstep
from kvsched.peers.ours import SchedulerAdapter
from spec.types import SamplingParams, SchedulerConfig, Semantics
from tests.stateful.events import undone_chunks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_scheduled_victims_chunk_is_undone(async_scheduling: bool) -> None:
    config = SchedulerConfig(
        num_gpu_blocks=4,
        block_size=4,
        policy="priority",
        semantics=Semantics.VLLM_V1,
        async_scheduling=async_scheduling,
    )
    lock = Lockstep(SchedulerAdapter(config), config, spec.HashOracle(vocab_size=256))
    arrivals = {
        0: ("r0", [190, 94, 184, 100], SamplingParams(max_tokens=9, ignore_eos=True, priority=2)),
        3: ("r2", [57], SamplingParams(max_tokens=8, ignore_eos=True, priority=1)),
    }
    undone: list[str] = []
    for step in range(60):
        if step in arrivals:
            assert lock.add(*arrivals[step]) is None
        if step > max(arrivals) and not lock.unfinished():
            break
        advance = lock.advance()
        if advance.plan.preempted:
            undone.extend(undone_chunks(advance.before))
    lock.finish()
    assert not lock.unfinished()
    assert undone == ["r0"]
