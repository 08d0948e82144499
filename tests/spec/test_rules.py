"""One small hand-built scenario per rule (R4-R11), with the exact expected plans."""

from __future__ import annotations

import copy
from types import MappingProxyType

import pytest

import spec.policies
from spec import (
    POLICIES,
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    FinishReason,
    InvalidMaxTokensError,
    Policy,
    Preemption,
    PreemptionMode,
    Request,
    RequestState,
    RequestTooLargeError,
    SampledTokensError,
    SamplingParams,
    SchedulerState,
    UnknownRequestError,
    abort_request,
    add_request,
    blocks_owned,
    check_state,
    complete_step,
    init_state,
    sampling_request_ids,
    schedule,
    step,
)
from tests.spec.helpers import add, checked_step, chunks, config, ids, new_state, prompt

RECOMPUTE = PreemptionMode.RECOMPUTE
RESTART = PreemptionMode.RESTART
SWAP = PreemptionMode.SWAP


def by_id(state: SchedulerState, request_id: str) -> tuple[int, tuple[int, ...], int]:
    """``(computed, outputs, num_preemptions)`` of a live request."""
    for request in (*state.waiting, *state.running, *state.swapped):
        if request.request_id == request_id:
            return (
                request.num_computed_tokens,
                request.output_token_ids,
                request.num_preemptions,
            )
    raise AssertionError(f"{request_id} is not live")


# --- R4: adding ------------------------------------------------------------------------


def test_add_puts_request_at_tail_with_next_arrival() -> None:
    state = new_state(config(10), ("a", 2, 3), ("b", 1, 1))
    assert ids(state.waiting) == ["a", "b"]
    assert [r.request.arrival for r in state.waiting] == [0, 1]
    assert state.next_arrival == 2
    assert all(r.num_computed_tokens == 0 and r.output_token_ids == () for r in state.waiting)


@pytest.mark.parametrize(
    ("request_id", "prompt_ids", "max_tokens", "error"),
    [
        # each row also breaks every later check, to pin the order of R4's checks
        ("a", (), 0, EmptyPromptError),
        ("a", (1,), 0, InvalidMaxTokensError),
        ("a", (1,), 100, DuplicateRequestError),
        ("b", (1,) * 10, 2, RequestTooLargeError),
        ("b", (1,), 11, RequestTooLargeError),
    ],
)
def test_each_r4_error_leaves_state_unchanged(
    request_id: str, prompt_ids: tuple[int, ...], max_tokens: int, error: type[Exception]
) -> None:
    state = new_state(config(10), ("a", 2, 3))
    before = copy.deepcopy(state)
    with pytest.raises(error):
        add_request(state, request_id, prompt_ids, SamplingParams(max_tokens=max_tokens))
    assert state == before


def test_never_fits_is_exactly_l_blocks_over_the_pool() -> None:
    cfg = config(3, block_size=4)  # 12 token slots
    state = init_state(cfg)
    # L = P + M - 1 = 12 fits exactly; 13 does not
    add_request(state, "ok", prompt(5), SamplingParams(max_tokens=8))
    with pytest.raises(RequestTooLargeError):
        add_request(state, "big", prompt(5), SamplingParams(max_tokens=9))


def test_never_fits_with_chunked_prefill_off_depends_on_mode() -> None:
    # budget 6, no chunking: the largest prefill is L = 7 (recompute), P = 4 (restart)
    for mode, accepted in ((RECOMPUTE, False), (SWAP, False), (RESTART, True)):
        cfg = config(
            100, max_num_batched_tokens=6, enable_chunked_prefill=False, preemption_mode=mode
        )
        state = init_state(cfg)
        if accepted:
            add_request(state, "a", prompt(4), SamplingParams(max_tokens=4))
        else:
            with pytest.raises(RequestTooLargeError):
                add_request(state, "a", prompt(4), SamplingParams(max_tokens=4))
    # with chunking on, the budget does not matter
    add_request(
        init_state(config(100, max_num_batched_tokens=1)), "a", prompt(50), SamplingParams()
    )


def test_ids_of_finished_or_aborted_requests_may_be_reused() -> None:
    state = new_state(config(10), ("a", 1, 1), ("b", 1, 5))
    state, plan = checked_step(state)
    assert ids(plan.finished) == ["a"]
    state = add(state, "a", 2, 2)
    state, _ = abort_request(state, "b")
    state = add(state, "b", 2, 2)
    assert ids(state.waiting) == ["a", "b"]
    assert check_state(state)


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        init_state(config(4, policy="round-robin"))


# --- R5 / R6: running requests and preemption -------------------------------------------


def test_decode_then_lifo_victim_goes_to_front_of_waiting() -> None:
    # 6 slots; three 2-token prompts take all of them in step 0
    state = new_state(config(6), ("a", 2, 4), ("b", 2, 4), ("c", 2, 4), ("w", 1, 1))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 2), ("c", 0, 2)]
    assert ids(state.waiting) == ["w"]
    assert state.num_free_gpu_blocks == 0
    # step 1: a needs a block; the LIFO victim among running[0:] is c, the latest
    state, plan = checked_step(state)
    assert plan.preempted == (Preemption(request_id="c", mode=RECOMPUTE),)
    assert chunks(plan) == [("a", 2, 1), ("b", 2, 1)]
    assert ids(state.waiting) == ["c", "w"]  # front of waiting
    assert by_id(state, "c") == (0, by_id(state, "c")[1], 1)
    assert len(by_id(state, "c")[1]) == 1  # recompute keeps the output
    # step 2: a needs a block again; the candidates are running[0:] = a, b -> b
    state, plan = checked_step(state)
    assert plan.preempted == (Preemption(request_id="b", mode=RECOMPUTE),)
    assert chunks(plan) == [("a", 3, 1)]
    assert ids(state.waiting) == ["b", "c", "w"]  # victims in admission order


def test_request_that_is_its_own_victim_ends_phase_a() -> None:
    state = new_state(config(5, max_num_seqs=2), ("a", 2, 3), ("b", 2, 3), ("w", 1, 1))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 2)]
    assert state.num_free_gpu_blocks == 1
    state, plan = checked_step(state)
    # a takes the last free block; b needs one, the only candidate is b itself
    assert chunks(plan) == [("a", 2, 1)]
    assert plan.preempted == (Preemption(request_id="b", mode=RECOMPUTE),)
    # no admission in a step that preempted, though w would fit (2 blocks free)
    assert ids(state.running) == ["a"]
    assert ids(state.waiting) == ["b", "w"]


def test_multiple_victims_in_one_step_keep_admission_order() -> None:
    state = new_state(
        config(10, max_num_seqs=5),
        ("a", 2, 4),
        ("b", 2, 4),
        ("c", 2, 4),
        ("d", 2, 4),
        ("e", 2, 4),
        ("f", 1, 2),
    )
    state, plan = checked_step(state)
    assert ids(state.running) == ["a", "b", "c", "d", "e"]
    assert state.num_free_gpu_blocks == 0
    state, plan = checked_step(state)
    # a preempts e; b takes the block left; c preempts d
    assert [p.request_id for p in plan.preempted] == ["e", "d"]
    assert chunks(plan) == [("a", 2, 1), ("b", 2, 1), ("c", 2, 1)]
    assert ids(state.waiting) == ["d", "e", "f"]
    # f (1 block) would fit in the free block, but the step preempted: no admission
    assert state.num_free_gpu_blocks == 1
    assert ids(state.running) == ["a", "b", "c"]


def test_budget_left_unscheduled_requests_wait_their_turn() -> None:
    state = new_state(config(20, max_num_batched_tokens=6), ("a", 2, 5), ("b", 2, 5), ("c", 2, 5))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 2), ("c", 0, 2)]
    state = add(state, "d", 6, 1)
    lowered = SchedulerState(
        config=config(20, max_num_batched_tokens=2),
        num_free_gpu_blocks=state.num_free_gpu_blocks,
        num_free_cpu_blocks=0,
        waiting=state.waiting,
        running=state.running,
        next_arrival=state.next_arrival,
        num_steps=state.num_steps,
    )
    _, plan = checked_step(lowered)
    assert chunks(plan) == [("a", 2, 1), ("b", 2, 1)]  # budget 2: c and d wait


def test_restart_discards_outputs_and_reprefills_the_prompt() -> None:
    state = new_state(config(6, preemption_mode=RESTART), ("a", 2, 4), ("b", 2, 4), ("c", 2, 4))
    state, _ = checked_step(state)
    state, plan = checked_step(state)
    assert plan.preempted == (Preemption(request_id="c", mode=RESTART),)
    assert by_id(state, "c") == (0, (), 1)
    state, plan = checked_step(state)  # preempts b, a continues
    assert [p.request_id for p in plan.preempted] == ["b"]
    state, plan = checked_step(state)  # a finishes (4 outputs)
    assert ids(plan.finished) == ["a"]
    state, plan = checked_step(state)
    assert chunks(plan) == [("b", 0, 2), ("c", 0, 2)]  # prompts only


def test_recompute_reprefills_prompt_and_kept_outputs() -> None:
    state = new_state(config(6), ("a", 2, 4), ("b", 2, 4), ("c", 2, 4))
    for _ in range(3):
        state, _ = checked_step(state)
    state, plan = checked_step(state)
    assert ids(plan.finished) == ["a"]
    state, plan = checked_step(state)
    # b was preempted with 2 outputs: it re-prefills prompt + outputs (4 of the 6
    # free blocks); c (prompt + 1 output = 3 blocks) no longer fits behind it
    assert chunks(plan) == [("b", 0, 4)]
    assert by_id(state, "c")[:2] == (0, by_id(state, "c")[1])
    assert len(by_id(state, "c")[1]) == 1


# --- R6 / R7: swap ----------------------------------------------------------------------


def swap_scenario(num_cpu_blocks: int) -> SchedulerState:
    cfg = config(5, max_num_seqs=2, preemption_mode=SWAP, num_cpu_blocks=num_cpu_blocks)
    state = new_state(cfg, ("a", 2, 4), ("b", 2, 3), ("w", 1, 1))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 2)]
    return state


def test_swap_out_and_in() -> None:
    state = swap_scenario(num_cpu_blocks=4)
    # step 1: a takes the free block; b needs one and is its own victim: swapped
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 2, 1)]
    assert plan.preempted == (Preemption(request_id="b", mode=SWAP),)
    assert ids(state.swapped) == ["b"]
    assert by_id(state, "b")[0] == 2  # computed kept
    assert (state.num_free_gpu_blocks, state.num_free_cpu_blocks) == (2, 2)
    # step 2: b needs cdiv(3, 1) = 3 blocks, 1 left after a: stays swapped. w would
    # fit (1 block, 1 of 2 seqs) but swapped requests block admission
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 3, 1)]
    assert plan.swapped_in == ()
    assert ids(state.waiting) == ["w"]
    # step 3: a finishes (4 outputs) at the end of the step
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 4, 1)]
    assert ids(plan.finished) == ["a"]
    assert state.num_free_gpu_blocks == 5
    # step 4: b swaps back in (3 GPU blocks, its 2 CPU blocks freed), then w is admitted
    state, plan = checked_step(state)
    assert plan.swapped_in == ("b",)
    assert chunks(plan) == [("b", 2, 1), ("w", 0, 1)]
    assert ids(plan.finished) == ["w"]
    assert state.num_free_cpu_blocks == 4
    assert ids(state.running) == ["b"]


def test_swap_falls_back_to_recompute_when_cpu_pool_too_small() -> None:
    state = swap_scenario(num_cpu_blocks=1)  # b holds 2 blocks
    state, plan = checked_step(state)
    assert plan.preempted == (Preemption(request_id="b", mode=RECOMPUTE),)
    assert ids(state.swapped) == []
    assert ids(state.waiting) == ["b", "w"]
    assert by_id(state, "b") == (0, by_id(state, "b")[1], 1)
    assert len(by_id(state, "b")[1]) == 1
    assert state.num_free_cpu_blocks == 1


def request_state(
    request_id: str, arrival: int, prompt_len: int, *, outputs: int, computed: int
) -> RequestState:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt(prompt_len),
        params=SamplingParams(max_tokens=4),
        arrival=arrival,
    )
    return RequestState(
        request=request, output_token_ids=(5,) * outputs, num_computed_tokens=computed
    )


def test_swap_in_is_head_of_line_and_blocks_admission() -> None:
    cfg = config(8, preemption_mode=SWAP, num_cpu_blocks=20)
    state = SchedulerState(
        config=cfg,
        num_free_gpu_blocks=3,
        num_free_cpu_blocks=15,
        running=(request_state("a", 0, 4, outputs=2, computed=5),),
        swapped=(
            request_state("big", 1, 4, outputs=1, computed=4),
            request_state("small", 2, 1, outputs=1, computed=1),
        ),
        waiting=(request_state("w", 3, 1, outputs=0, computed=0),),
        next_arrival=4,
    )
    assert check_state(state)
    state, plan = checked_step(state)
    # a takes 1 block, 2 left; big needs cdiv(5, 1) = 5: it stays, and so does small
    # (which would fit) behind it; w waits while anything is swapped
    assert chunks(plan) == [("a", 5, 1)]
    assert ids(state.swapped) == ["big", "small"]
    assert ids(state.waiting) == ["w"]


# --- R5 / R8: chunked prefill, budget, max_num_seqs ------------------------------------


def test_chunked_prefill_is_split_by_the_budget() -> None:
    cfg = config(10, block_size=4, max_num_batched_tokens=4)
    state = new_state(cfg, ("a", 10, 2), ("b", 3, 2))
    expected = [
        [("a", 0, 4)],
        [("a", 4, 4)],
        [("a", 8, 2), ("b", 0, 2)],  # a's rest first, then b gets what is left
        [("a", 10, 1), ("b", 2, 1)],  # a decodes; b completes its prefill
    ]
    sampled = [[], [], ["a"], ["a", "b"]]
    for want_chunks, want_sampled in zip(expected, sampled, strict=True):
        state, plan = checked_step(state)
        assert chunks(plan) == want_chunks
        assert [s.request_id for s in plan.sampled] == want_sampled
    assert ids(state.running) == ["b"]  # a has its 2 outputs, b one of 2


def test_chunked_prefill_off_stops_admission_at_a_prefill_over_the_budget() -> None:
    cfg = config(20, max_num_batched_tokens=6, enable_chunked_prefill=False)
    state = new_state(cfg, ("a", 4, 2), ("b", 4, 2), ("c", 1, 2))
    state, plan = checked_step(state)
    # b's 4 tokens exceed the 2 left; c would fit but admission stops at b
    assert chunks(plan) == [("a", 0, 4)]
    assert ids(state.waiting) == ["b", "c"]
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 4, 1), ("b", 0, 4), ("c", 0, 1)]


def test_admission_stops_at_max_num_seqs() -> None:
    state = new_state(config(20, max_num_seqs=2), ("a", 1, 3), ("b", 1, 3), ("c", 1, 3))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 1), ("b", 0, 1)]
    assert ids(state.waiting) == ["c"]


def test_admission_stops_at_first_request_without_blocks() -> None:
    state = new_state(config(4, block_size=2), ("a", 3, 2), ("b", 4, 2), ("c", 1, 1))
    state, plan = checked_step(state)
    # a takes 2 blocks, b needs 2 of the 2 left; c then finds none
    assert chunks(plan) == [("a", 0, 3), ("b", 0, 4)]
    state = new_state(config(4, block_size=2), ("a", 3, 2), ("b", 5, 1), ("c", 1, 1))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 3)]  # b needs 3 blocks > 2: c waits behind it


# --- R10: sampling and finishing -------------------------------------------------------


def test_eos_is_kept_and_stops() -> None:
    state = add(init_state(config(20)), "a", 2, 5, eos_token_id=7)
    state, plan = checked_step(state, {"a": 3})
    state, plan = checked_step(state, {"a": 7})
    assert [(f.request_id, f.output_token_ids, f.finish_reason) for f in plan.finished] == [
        ("a", (3, 7), FinishReason.STOP)
    ]
    assert state.num_free_gpu_blocks == 20


def test_ignore_eos_keeps_going_to_max_tokens() -> None:
    state = add(init_state(config(20)), "a", 2, 3, eos_token_id=7, ignore_eos=True)
    outputs: list[tuple[int, ...]] = []
    for _ in range(3):
        state, plan = checked_step(state, {"a": 7})
        outputs.extend(f.output_token_ids for f in plan.finished)
        if plan.finished:
            assert plan.finished[0].finish_reason is FinishReason.LENGTH
    assert outputs == [(7, 7, 7)]


def test_max_tokens_is_length_and_eos_as_last_token_is_stop() -> None:
    state = add(init_state(config(20)), "a", 2, 2, eos_token_id=7)
    state = add(state, "b", 2, 2, eos_token_id=7)
    state, plan = checked_step(state, {"a": 1, "b": 1})
    assert plan.finished == ()
    state, plan = checked_step(state, {"a": 2, "b": 7})
    assert [(f.request_id, f.output_token_ids, f.finish_reason) for f in plan.finished] == [
        ("a", (1, 2), FinishReason.LENGTH),
        ("b", (1, 7), FinishReason.STOP),
    ]


def test_max_tokens_one_finishes_at_the_end_of_the_prefill() -> None:
    state = new_state(config(20), ("a", 3, 1))
    state, plan = checked_step(state)
    assert ids(plan.finished) == ["a"]
    assert state.num_free_gpu_blocks == 20


def test_sampled_tokens_must_match_the_sampling_requests() -> None:
    cfg = config(20, max_num_batched_tokens=3)
    state = new_state(cfg, ("a", 2, 3), ("b", 4, 3))  # b's prefill is chunked: 1 of 4
    state_mid, plan = schedule(state)
    assert sampling_request_ids(state_mid, plan) == ("a",)
    for bad in ({}, {"b": 1}, {"a": 1, "b": 1}):
        with pytest.raises(SampledTokensError):
            step(state, bad)
        with pytest.raises(SampledTokensError):
            complete_step(state_mid, plan, bad)
    _, plan = step(state, {"a": 1})
    assert [(s.request_id, s.token_id) for s in plan.sampled] == [("a", 1)]


def test_step_counter_moves_even_for_an_empty_step() -> None:
    state = init_state(config(4))
    state, plan = checked_step(state)
    assert (plan.step, state.num_steps, plan.scheduled) == (0, 1, ())


def test_schedule_returns_a_mid_step_state() -> None:
    state = new_state(config(20), ("a", 3, 2))
    mid, plan = schedule(state)
    assert chunks(plan) == [("a", 0, 3)]
    assert plan.sampled == () and plan.finished == ()
    assert mid.num_free_gpu_blocks == 17  # blocks taken
    assert mid.running[0].num_computed_tokens == 0  # computed not advanced
    assert mid.num_steps == 0


# --- R11: abort ------------------------------------------------------------------------


def abort_scenario() -> SchedulerState:
    """run: a (decoding), m (mid-prefill); swapped: s; waiting: w."""
    cfg = config(12, block_size=2, max_num_batched_tokens=8, preemption_mode=SWAP, num_cpu_blocks=6)
    state = new_state(cfg, ("s", 3, 6), ("a", 3, 6), ("m", 11, 2))
    state, plan = checked_step(state)
    assert chunks(plan) == [("s", 0, 3), ("a", 0, 3), ("m", 0, 2)]
    state = SchedulerState(  # move s to the swapped queue, as a swap-out would
        config=state.config,
        num_free_gpu_blocks=state.num_free_gpu_blocks + 2,
        num_free_cpu_blocks=state.num_free_cpu_blocks - 2,
        waiting=state.waiting,
        running=state.running[1:],
        swapped=(state.running[0],),
        next_arrival=state.next_arrival,
        num_steps=state.num_steps,
    )
    state = add(state, "w", 2, 2)
    assert check_state(state)
    return state


@pytest.mark.parametrize(
    ("request_id", "gpu", "cpu"),
    [("w", 0, 0), ("a", 2, 0), ("m", 1, 0), ("s", 0, 2)],
)
def test_abort_frees_exactly_its_blocks(request_id: str, gpu: int, cpu: int) -> None:
    state = abort_scenario()
    assert blocks_owned(state, request_id) == (gpu, cpu)
    after, done = abort_request(state, request_id)
    assert (after.num_free_gpu_blocks, after.num_free_cpu_blocks) == (
        state.num_free_gpu_blocks + gpu,
        state.num_free_cpu_blocks + cpu,
    )
    assert done.request_id == request_id
    assert done.finish_reason is FinishReason.ABORTED
    assert done.output_token_ids == by_id(state, request_id)[1]
    assert request_id not in ids((*after.waiting, *after.running, *after.swapped))
    assert check_state(after)


def test_abort_of_unknown_id_changes_nothing() -> None:
    state = abort_scenario()
    before = copy.deepcopy(state)
    with pytest.raises(UnknownRequestError):
        abort_request(state, "nope")
    assert state == before


def test_abort_reports_preemptions_and_outputs() -> None:
    state = new_state(config(6), ("a", 2, 4), ("b", 2, 4), ("c", 2, 4))
    state, _ = checked_step(state)
    state, _ = checked_step(state)  # c preempted with one output
    after, done = abort_request(state, "c")
    assert (len(done.output_token_ids), done.num_preemptions) == (1, 1)
    assert ids(after.waiting) == []


# --- R9: policies ----------------------------------------------------------------------


def test_priority_policy_victim_and_order() -> None:
    cfg = config(6, policy="priority")
    state = init_state(cfg)
    state = add(state, "low", 2, 4, priority=5)
    state = add(state, "high", 2, 4, priority=0)
    state = add(state, "mid", 2, 4, priority=1)
    state, plan = checked_step(state)
    assert chunks(plan) == [("high", 0, 2), ("mid", 0, 2), ("low", 0, 2)]  # sorted
    state, plan = checked_step(state)
    # high needs a block; the victim is the largest (priority, arrival): low
    assert [p.request_id for p in plan.preempted] == ["low"]
    state, plan = checked_step(state)
    assert [p.request_id for p in plan.preempted] == ["mid"]
    # waiting keeps its stored order (victims at the front)
    assert ids(state.waiting) == ["mid", "low"]


def test_priority_victim_can_be_the_head() -> None:
    cfg = config(4, policy="priority")
    state = add(init_state(cfg), "x", 2, 3, priority=5)
    state, _ = checked_step(state)
    state = add(state, "y", 1, 2, priority=0)
    state, plan = checked_step(state)
    assert chunks(plan) == [("x", 2, 1), ("y", 0, 1)]  # 0 blocks free now
    state, plan = checked_step(state)
    # x needs a block; among running[0:] = x, y the largest (priority, arrival) is x,
    # the request itself: phase A ends and y is not scheduled in this step
    assert plan.preempted == (Preemption(request_id="x", mode=RECOMPUTE),)
    assert plan.scheduled == ()
    state, plan = checked_step(state)
    assert chunks(plan) == [("y", 1, 1)]
    assert ids(plan.finished) == ["y"]
    state, plan = checked_step(state)
    assert chunks(plan) == [("x", 0, 4)]  # prompt + 2 kept outputs
    assert ids(plan.finished) == ["x"]


def test_fewest_outputs_policy_victim() -> None:
    cfg = config(9, policy="fewest-outputs")
    state = new_state(cfg, ("a", 2, 6), ("b", 3, 6))
    state, _ = checked_step(state)  # a: 2 + 1 out, b: 3 + 1 out; 5 blocks used
    state = add(state, "c", 2, 6)
    state, plan = checked_step(state)  # a, b decode (2 blocks), c admitted (2): 0 free
    assert chunks(plan) == [("a", 2, 1), ("b", 3, 1), ("c", 0, 2)]
    state, plan = checked_step(state)
    # a needs a block: candidates a (2 out), b (2 out), c (1 out) -> c, fewest outputs
    assert [p.request_id for p in plan.preempted] == ["c"]
    state, plan = checked_step(state)
    # a needs a block: a and b both have 3 outputs; b's prompt is longer -> b
    assert [p.request_id for p in plan.preempted] == ["b"]


def test_admission_gate_sees_the_mid_step_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """R9: a custom gate is asked with the requests admitted so far already running."""
    seen: list[tuple[list[str], str, int]] = []

    def at_most_two_running(state: SchedulerState, candidate: RequestState, n: int) -> bool:
        seen.append((ids(state.running), candidate.request_id, n))
        return len(state.running) < 2

    gated = Policy(
        name="gated",
        select_victim=POLICIES["lifo"].select_victim,
        order_waiting=POLICIES["lifo"].order_waiting,
        can_admit=at_most_two_running,
    )
    monkeypatch.setattr(spec.policies, "POLICIES", MappingProxyType({**POLICIES, "gated": gated}))
    state = new_state(config(20, policy="gated"), ("a", 2, 3), ("b", 3, 3), ("c", 1, 3))
    state, plan = checked_step(state)
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 3)]
    assert seen == [([], "a", 2), (["a"], "b", 3), (["a", "b"], "c", 1)]
    assert ids(state.waiting) == ["c"]
