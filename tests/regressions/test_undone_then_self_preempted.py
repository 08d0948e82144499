"""An undone chunk (vllm-v1/priority-victim-any-running) followed, in the same step, by
the request that needed the blocks preempting itself.

Found while tracing docs/peers.md V11 (issue 12): ``make_room_any_running`` returned
None when the request preempted itself and dropped what it had undone before, so phase
A still counted the undone victim's sample; the engine then failed the step
(``SampledTokensError: step 3: 2 requests sample, the model runner returned 1 tokens``).
The workload is tests/peers/repros/undone_chunk_keys.jsonl: V (priority 2) and X
(priority 0) decode while R (priority 1) prefills; at step 3 R needs blocks, V's decode
is undone and R then preempts itself. (Since vllm-v1/undone-chunk-unkeyed, docs/peers.md
V11, the undone decode's key is dropped too, so Y's later hit stops short of V's
unwritten block.)
"""

from __future__ import annotations

from pathlib import Path

from impl import LLMEngine
from kvsched.runner import run_workload
from kvsched.workload import read_workload
from model import build_tiny_model
from spec.types import SchedulerConfig, Semantics
from tests.oracles.pool import engine_pool_violations
from tests.regressions.solo import assert_outputs_are_solo

WORKLOAD = Path(__file__).parents[1] / "peers" / "repros" / "undone_chunk_keys.jsonl"


def test_an_undone_chunk_before_a_self_preemption_does_not_sample() -> None:
    """With prefix caching: X shares V's blocks, so V's undo frees too few for R."""
    model = build_tiny_model(seed=0)
    workload = read_workload(WORKLOAD)

    def config(num_gpu_blocks: int) -> SchedulerConfig:
        return SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=1,
            max_num_batched_tokens=6,
            max_num_seqs=4,
            enable_prefix_caching=True,
            semantics=Semantics.VLLM_V1,
            policy="priority",
            max_model_len=16,
        )

    shared = config(16)
    engine = LLMEngine(shared, model=model, dtype="float64")
    result = run_workload(engine, shared, workload)
    assert result.metrics.preemptions >= 2
    assert engine_pool_violations(engine.scheduler) == []
    alone = config(64)
    assert_outputs_are_solo(model, alone, workload, result)
