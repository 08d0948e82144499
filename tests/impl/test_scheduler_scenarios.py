"""Hand-checked scheduling scenarios: the exact plan of every step, worked out by hand
from docs/semantics.md (the derivation is in the comments). No model, no torch."""

from __future__ import annotations

import subprocess
import sys

from impl.scheduler import Scheduler
from spec.types import (
    FinishedRequest,
    FinishReason,
    Preemption,
    PreemptionMode,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    StepPlan,
)
from tests.drain import drain_within
from tests.impl.helpers import constant_sampler

RECOMPUTE = PreemptionMode.RECOMPUTE
SWAP = PreemptionMode.SWAP
LENGTH = FinishReason.LENGTH


def chunk(rid: str, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, start=start, num_tokens=n)


def tok(rid: str, token: int = 9) -> SampledToken:
    return SampledToken(request_id=rid, token_id=token)


def done(rid: str, outputs: int, preemptions: int = 0, token: int = 9) -> FinishedRequest:
    return FinishedRequest(
        request_id=rid,
        output_token_ids=(token,) * outputs,
        finish_reason=LENGTH,
        num_preemptions=preemptions,
    )


def params(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys; import impl; from impl import Scheduler, BlockManager, POLICIES; "
        "import impl.scheduler, impl.policies, impl.block_manager, impl.sequence; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def abc_scheduler() -> Scheduler:
    """bs 2, 6 GPU blocks, budget 8; A: 3-token prompt, 4 outputs; B: 4, 4; C: 2, 2."""
    s = Scheduler(SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=8))
    s.add_request("A", [1, 2, 3], params(4))
    s.add_request("B", [4, 5, 6, 7], params(4))
    s.add_request("C", [8, 9], params(2))
    return s


def test_lifo_recompute_chunked_scenario() -> None:
    """``abc_scheduler``'s three requests, step by step."""
    s = abc_scheduler()
    sample = constant_sampler(9)
    plans = []
    bound = drain_within(s.observe())
    while s.has_unfinished_requests():
        bound.tick(s.observe)
        plans.append(s.step(sample))
        s.check_invariants()
    expected = [
        # Admit A (3 tokens, 2 blocks), B (4, 2), C gets the 1 token left (1 block).
        # A and B finish their prompts and sample; C does not.
        StepPlan.of(
            step=0,
            scheduled=(chunk("A", 0, 3), chunk("B", 0, 4), chunk("C", 0, 1)),
            sampled=(tok("A"), tok("B")),
        ),
        # Free 1. A decodes in its 2nd block (no new block), B needs a 3rd (takes the
        # last free one), C finishes its prompt inside its block.
        StepPlan.of(
            step=1,
            scheduled=(chunk("A", 3, 1), chunk("B", 4, 1), chunk("C", 1, 1)),
            sampled=(tok("A"), tok("B"), tok("C")),
        ),
        # Free 0. A needs a 3rd block: LIFO victim C (last), recompute, front of waiting.
        StepPlan.of(
            step=2,
            scheduled=(chunk("A", 4, 1), chunk("B", 5, 1)),
            preempted=(Preemption(request_id="C", mode=RECOMPUTE),),
            sampled=(tok("A"), tok("B")),
        ),
        # A fits in its block; B needs a 4th, the only candidate is B: it preempts
        # itself and phase A ends. A reaches max_tokens=4.
        StepPlan.of(
            step=3,
            scheduled=(chunk("A", 5, 1),),
            preempted=(Preemption(request_id="B", mode=RECOMPUTE),),
            sampled=(tok("A"),),
            finished=(done("A", 4),),
        ),
        # Waiting = [B, C]. B re-prefills prompt + 3 outputs (7 tokens, 4 blocks) and
        # samples its 4th output; C gets the last budget token.
        StepPlan.of(
            step=4,
            scheduled=(chunk("B", 0, 7), chunk("C", 0, 1)),
            sampled=(tok("B"),),
            finished=(done("B", 4, preemptions=1),),
        ),
        # C prefills its 2 remaining tokens (prompt + kept output) and samples output 2.
        StepPlan.of(
            step=5,
            scheduled=(chunk("C", 1, 2),),
            sampled=(tok("C"),),
            finished=(done("C", 2, preemptions=1),),
        ),
    ]
    assert plans == expected
    assert s.gpu.num_free_blocks == 6


def test_recomputed_tokens_are_counted_in_the_output() -> None:
    s = abc_scheduler()
    recomputed = []
    bound = drain_within(s.observe())
    while s.has_unfinished_requests():
        bound.tick(s.observe)
        out = s.schedule()
        s.commit(out, [9] * out.num_samples)
        recomputed.append(out.num_recomputed_tokens)
    # Step 4: B re-prefills positions 0..6 of which 0..5 were computed before (6);
    # C re-prefills position 0 (computed before: 0..1) -> 1. Step 5: C positions 1..2,
    # position 1 computed before -> 1.
    assert recomputed == [0, 0, 0, 0, 7, 1]


def swap_pair(num_cpu_blocks: int) -> Scheduler:
    """Swap mode, bs 1, 4 GPU blocks, budget 4; A and B: 2-token prompts, 3 outputs."""
    config = SchedulerConfig(
        num_gpu_blocks=4,
        block_size=1,
        max_num_batched_tokens=4,
        preemption_mode=SWAP,
        num_cpu_blocks=num_cpu_blocks,
    )
    s = Scheduler(config)
    s.add_request("A", [1, 2], params(3))
    s.add_request("B", [3, 4], params(3))
    return s


def test_swap_scenario_and_swapped_requests_block_admission() -> None:
    """bs 1, 4 GPU + 4 CPU blocks, budget 4; A and B: 2-token prompts, 3 outputs."""
    s = swap_pair(num_cpu_blocks=4)
    sample = constant_sampler(9)
    plans = [s.step(sample)]
    # After step 0: A and B hold 2 blocks each, free 0.
    plans.append(s.step(sample))
    state = s.observe()
    assert [r.request_id for r in state.swapped] == ["B"]
    assert state.swapped[0].num_computed_tokens == 2
    assert (state.num_free_gpu_blocks, state.num_free_cpu_blocks) == (1, 2)
    s.add_request("C", [5], params(1))  # fits, but swapped requests go first (R8)
    plans.append(s.step(sample))
    plans.append(s.step(sample))
    plans.append(s.step(sample))
    plans.append(s.step(sample))
    expected = [
        StepPlan.of(
            step=0, scheduled=(chunk("A", 0, 2), chunk("B", 0, 2)), sampled=(tok("A"), tok("B"))
        ),
        # A needs a 3rd block, victim B moves its 2 blocks to the CPU pool.
        StepPlan.of(
            step=1,
            scheduled=(chunk("A", 2, 1),),
            preempted=(Preemption(request_id="B", mode=SWAP),),
            sampled=(tok("A"),),
        ),
        # A takes the last free block; B would need 3 > 0 free: head-of-line stop; C
        # may not be admitted while B is swapped. A finishes (3 outputs).
        StepPlan.of(
            step=2,
            scheduled=(chunk("A", 3, 1),),
            sampled=(tok("A"),),
            finished=(done("A", 3),),
        ),
        # B swaps in (3 GPU blocks for 2 computed + 1), then C is admitted (1 block).
        StepPlan.of(
            step=3,
            scheduled=(chunk("B", 2, 1), chunk("C", 0, 1)),
            swapped_in=("B",),
            sampled=(tok("B"), tok("C")),
            finished=(done("C", 1),),
        ),
        StepPlan.of(
            step=4,
            scheduled=(chunk("B", 3, 1),),
            sampled=(tok("B"),),
            finished=(done("B", 3, preemptions=1),),
        ),
        StepPlan.of(step=5),  # an empty step still counts
    ]
    assert plans == expected
    assert s.num_steps == 6
    s.check_invariants()


def test_swap_without_cpu_room_falls_back_to_recompute() -> None:
    s = swap_pair(num_cpu_blocks=1)
    sample = constant_sampler(9)
    s.step(sample)
    plan = s.step(sample)
    assert plan.preempted == (Preemption(request_id="B", mode=RECOMPUTE),)
    state = s.observe()
    assert [r.request_id for r in state.waiting] == ["B"]
    assert state.waiting[0].output_token_ids == (9,)
    assert state.waiting[0].num_computed_tokens == 0
    assert state.num_free_cpu_blocks == 1


def test_restart_discards_outputs_and_front_insertion_keeps_admission_order() -> None:
    """bs 1, 4 blocks; A..D: 1-token prompts, all admitted in step 0 (free 0)."""
    config = SchedulerConfig(num_gpu_blocks=4, block_size=1, preemption_mode=PreemptionMode.RESTART)
    s = Scheduler(config)
    for name in "ABCD":
        s.add_request(name, [1], params(3))
    sample = constant_sampler(9)
    s.step(sample)  # each has 1 output, 1 block
    s.add_request("E", [7], params(1))
    plan = s.step(sample)
    # A needs a 2nd block: LIFO victim D. B needs one: victim C. LIFO victims of one
    # step keep admission order at the front of waiting: [C, D, E].
    assert plan.scheduled == (chunk("A", 1, 1), chunk("B", 1, 1))
    assert plan.preempted == (
        Preemption(request_id="D", mode=PreemptionMode.RESTART),
        Preemption(request_id="C", mode=PreemptionMode.RESTART),
    )
    state = s.observe()
    assert [r.request_id for r in state.waiting] == ["C", "D", "E"]
    assert all(r.output_token_ids == () for r in state.waiting)
    assert [r.num_preemptions for r in state.waiting] == [1, 1, 0]
    assert [r.output_token_ids for r in state.running] == [(9, 9), (9, 9)]
    assert state.num_free_gpu_blocks == 0


def test_priority_victim_and_waiting_order() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=1, policy="priority")
    s = Scheduler(config)
    s.add_request("X", [1, 2], params(5, priority=0))
    s.add_request("Y", [3, 4], params(5, priority=5))
    sample = constant_sampler(9)
    s.step(sample)  # X, Y admitted (4 blocks)
    s.add_request("Z", [5, 6], params(5, priority=1))
    plan = s.step(sample)  # X, Y decode (2 blocks), Z admitted (2 blocks): free 0
    assert [c.request_id for c in plan.scheduled] == ["X", "Y", "Z"]
    plan = s.step(sample)
    # X needs a block: victim = largest (priority, arrival) = Y, not the last one (Z).
    assert plan.preempted == (Preemption(request_id="Y", mode=RECOMPUTE),)
    assert [c.request_id for c in plan.scheduled] == ["X", "Z"]
    # Waiting: stored order [Y, W]; W (priority 0) is tried first.
    s.add_request("W", [7], params(1, priority=0))
    assert [r.request_id for r in s.observe().waiting] == ["Y", "W"]
    assert s.waiting.peek().request_id == "W"


def test_priority_admission_order_and_head_of_line() -> None:
    config = SchedulerConfig(num_gpu_blocks=4, block_size=1, policy="priority")
    s = Scheduler(config)
    s.add_request("A", [1, 2, 3], params(1, priority=1))
    s.add_request("B", [4, 5], params(1, priority=0))
    s.add_request("C", [6], params(1, priority=2))
    plan = s.step(constant_sampler(9))
    # Policy order B (0), A (1), C (2): B takes 2 blocks, A needs 3 > 2 -> stop, C
    # waits behind A although it would fit.
    assert [c.request_id for c in plan.scheduled] == ["B"]
    assert [r.request_id for r in s.observe().waiting] == ["A", "C"]


def test_max_num_seqs_and_budget_limit_admission() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=10
    )
    s = Scheduler(config)
    for name in "ABC":
        s.add_request(name, [1] * 3, params(3))
    plan = s.step(constant_sampler(9))
    assert [c.request_id for c in plan.scheduled] == ["A", "B"]  # max_num_seqs
    s2 = Scheduler(SchedulerConfig(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=7))
    for name in "ABC":
        s2.add_request(name, [1] * 3, params(3))
    plan = s2.step(constant_sampler(9))
    # Budget 7: A 3, B 3, C gets 1 token (chunked prefill) and does not sample.
    assert plan.scheduled == (chunk("A", 0, 3), chunk("B", 0, 3), chunk("C", 0, 1))
    assert [t.request_id for t in plan.sampled] == ["A", "B"]


def test_chunked_prefill_off_stops_at_a_prefill_larger_than_the_budget() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=100, block_size=4, max_num_batched_tokens=6, enable_chunked_prefill=False
    )
    s = Scheduler(config)
    s.add_request("A", [1] * 4, params(2))  # L = 5 <= 6
    s.add_request("B", [1] * 3, params(2))
    s.add_request("C", [1], params(2))
    plan = s.step(constant_sampler(9))
    # A takes 4, B needs 3 > 2 left: stop (head-of-line), C waits behind B.
    assert plan.scheduled == (chunk("A", 0, 4),)
    plan = s.step(constant_sampler(9))
    # A decodes 1, B 3, C 1.
    assert plan.scheduled == (chunk("A", 4, 1), chunk("B", 0, 3), chunk("C", 0, 1))


def test_eos_finishes_with_stop_and_is_part_of_the_output() -> None:
    s = Scheduler(SchedulerConfig(num_gpu_blocks=10, block_size=2))
    s.add_request("A", [1, 2], SamplingParams(max_tokens=5, eos_token_id=9))
    s.add_request("B", [1, 2], SamplingParams(max_tokens=1, eos_token_id=9))
    s.add_request("C", [1, 2], SamplingParams(max_tokens=2, eos_token_id=9, ignore_eos=True))
    plan = s.step(constant_sampler(9))
    # EOS is checked first: B's EOS as its last allowed token is "stop".
    assert [(f.request_id, f.finish_reason, f.output_token_ids) for f in plan.finished] == [
        ("A", FinishReason.STOP, (9,)),
        ("B", FinishReason.STOP, (9,)),
    ]
    plan = s.step(constant_sampler(9))
    assert [(f.request_id, f.finish_reason) for f in plan.finished] == [("C", LENGTH)]
    assert s.gpu.num_free_blocks == 10


def test_ids_of_finished_and_aborted_requests_can_be_reused() -> None:
    s = Scheduler(SchedulerConfig(num_gpu_blocks=10, block_size=2))
    s.add_request("A", [1, 2], params(1))
    s.step(constant_sampler(9))
    s.add_request("A", [3], params(1))
    s.abort_request("A")
    s.add_request("A", [3], params(1))
    assert [r.request.arrival for r in s.observe().waiting] == [2]
