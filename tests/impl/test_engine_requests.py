"""add_request (R4), abort_request (R11) and generate() on the real engine."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import impl.phases
from impl import LLMEngine
from impl.engine import EngineStalledError, drain_step_limit
from model import LlamaForCausalLM
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishReason,
    InvalidMaxTokensError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PreemptionMode,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    TokenOutOfVocabError,
    UnknownRequestError,
)
from tests.drain import drain_within
from tests.impl.conftest import SoloFn

P = SamplingParams(max_tokens=4, ignore_eos=True)


def engine_with(model: LlamaForCausalLM, **fields: object) -> LLMEngine:
    config: dict[str, object] = {"num_gpu_blocks": 8, "block_size": 2}
    config.update(fields)
    return LLMEngine(SchedulerConfig(**config), model=model)  # type: ignore[arg-type]


BAD_REQUESTS: list[tuple[str, Sequence[int], SamplingParams, type[InvalidRequestError]]] = [
    ("empty", [], P, EmptyPromptError),
    ("zero-max", [1, 2], SamplingParams(max_tokens=0), InvalidMaxTokensError),
    ("negative-max", [1, 2], SamplingParams(max_tokens=-3), InvalidMaxTokensError),
    ("negative-token", [1, -1], P, TokenOutOfVocabError),
    ("vocab-token", [1, 256], P, TokenOutOfVocabError),
    ("float-token", [1, 2.0], P, TokenOutOfVocabError),  # type: ignore[list-item]
    ("negative-temperature", [1, 2], SamplingParams(temperature=-1.0), InvalidSamplingParamsError),
    (
        "nan-temperature",
        [1, 2],
        SamplingParams(temperature=float("nan")),
        InvalidSamplingParamsError,
    ),
    (
        "inf-temperature",
        [1, 2],
        SamplingParams(temperature=float("inf")),
        InvalidSamplingParamsError,
    ),
    ("live", [1, 2], P, DuplicateRequestError),
    # L = 14 + 4 - 1 = 17 tokens = 9 blocks of 2 > 8 blocks.
    ("too-large", list(range(1, 15)), P, RequestTooLargeError),
    # The checks run in order: an empty prompt wins over a bad max_tokens.
    ("order", [], SamplingParams(max_tokens=0), EmptyPromptError),
    ("order2", [300], SamplingParams(max_tokens=0), InvalidMaxTokensError),
    ("live", [300], P, TokenOutOfVocabError),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_raise_typed_errors_and_change_nothing(
    model64: LlamaForCausalLM,
    solo: SoloFn,
    case: tuple[str, Sequence[int], SamplingParams, type[InvalidRequestError]],
) -> None:
    request_id, prompt, params, error = case
    engine = engine_with(model64)
    engine.add_request("live", [5, 6, 7], P)
    engine.step()
    before = engine.observe()
    with pytest.raises(error):
        engine.add_request(request_id, prompt, params)
    assert engine.observe() == before
    # The live request keeps being served, with its solo outputs.
    plans = []
    bound = drain_within(engine.observe())
    while engine.has_unfinished_requests():
        bound.tick(engine.observe)
        plans.append(engine.step())
    (finished,) = [f for plan in plans for f in plan.finished]
    assert finished.output_token_ids == solo([5, 6, 7], P)


def test_request_too_large_with_chunked_prefill_off(model64: LlamaForCausalLM) -> None:
    # Largest prefill: L = P + M - 1 in recompute/swap mode, P in restart mode.
    for mode, ok in ((PreemptionMode.RECOMPUTE, False), (PreemptionMode.RESTART, True)):
        engine = engine_with(
            model64,
            num_gpu_blocks=64,
            max_num_batched_tokens=6,
            enable_chunked_prefill=False,
            preemption_mode=mode,
        )
        if ok:
            engine.add_request("a", [1] * 6, SamplingParams(max_tokens=3))
        else:
            with pytest.raises(RequestTooLargeError):
                engine.add_request("a", [1] * 6, SamplingParams(max_tokens=3))
        engine.add_request("b", [1] * 5, SamplingParams(max_tokens=2))  # L = 6
        with pytest.raises(RequestTooLargeError):
            engine.add_request("c", [1] * 7, SamplingParams(max_tokens=1))


def test_unknown_abort_changes_nothing(model64: LlamaForCausalLM) -> None:
    engine = engine_with(model64)
    engine.add_request("a", [1, 2], P)
    before = engine.observe()
    with pytest.raises(UnknownRequestError, match="nope"):
        engine.abort_request("nope")
    assert engine.observe() == before


def test_abort_in_each_state_frees_exactly_its_blocks(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    # bs 2, 8 GPU blocks, 8 CPU blocks, budget 6, swap mode.
    engine = engine_with(
        model64,
        max_num_batched_tokens=6,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=8,
    )
    long = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("run", [1, 2, 3], long)  # 3 tokens, 2 blocks
    engine.add_request("pre", [4, 5, 6, 7, 8, 9, 10, 11], long)  # 3 tokens of 8 in step 0
    engine.add_request("wait", [12], long)
    engine.step()
    state = engine.observe()
    by_id = {r.request_id: r for r in state.running}
    assert by_id["pre"].num_computed_tokens == 3  # mid-prefill
    assert [r.request_id for r in state.waiting] == ["wait"]
    assert state.num_free_gpu_blocks == 8 - 2 - 2

    aborted = engine.abort_request("wait")  # waiting: holds nothing
    assert aborted.finish_reason is FinishReason.ABORTED and aborted.output_token_ids == ()
    assert engine.observe().num_free_gpu_blocks == 4

    aborted = engine.abort_request("pre")  # running, mid-prefill: 2 blocks
    assert aborted.output_token_ids == () and aborted.num_preemptions == 0
    assert engine.observe().num_free_gpu_blocks == 6

    state = engine.observe()
    (running,) = state.running
    aborted = engine.abort_request("run")  # running, decoding: 2 blocks
    assert aborted.output_token_ids == running.output_token_ids
    assert engine.observe().num_free_gpu_blocks == 8
    assert not engine.has_unfinished_requests()
    with pytest.raises(UnknownRequestError):
        engine.abort_request("run")  # frees exactly once
    assert engine.observe().num_free_gpu_blocks == 8


def test_abort_a_swapped_request_frees_its_cpu_blocks(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    engine = engine_with(
        model64,
        num_gpu_blocks=4,
        block_size=1,
        max_num_batched_tokens=4,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=4,
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", [1, 2], params)
    engine.add_request("b", [3, 4], params)
    engine.step()  # both admitted, 2 blocks each
    plan = engine.step()  # "a" needs a 3rd block: "b" is swapped out (2 CPU blocks)
    assert [p.request_id for p in plan.preempted] == ["b"]
    state = engine.observe()
    assert [r.request_id for r in state.swapped] == ["b"]
    assert (state.num_free_gpu_blocks, state.num_free_cpu_blocks) == (1, 2)
    aborted = engine.abort_request("b")
    assert aborted.output_token_ids == state.swapped[0].output_token_ids
    assert aborted.num_preemptions == 1
    state = engine.observe()
    assert (state.num_free_gpu_blocks, state.num_free_cpu_blocks) == (1, 4)
    outputs = [f for _ in range(5) for f in engine.step().finished]
    assert [(f.request_id, f.output_token_ids) for f in outputs] == [("a", solo([1, 2], params))]
    assert engine.observe().num_free_gpu_blocks == 4


def test_abort_a_preempted_request_then_the_rest_finish(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    engine = engine_with(model64, num_gpu_blocks=6, block_size=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2], params)
    engine.add_request("b", [3, 4], params)
    engine.add_request("c", [5], params)
    preempted = None
    bound = drain_within(engine.observe())
    while preempted is None:
        bound.tick(engine.observe)
        plan = engine.step()
        if plan.preempted:
            preempted = plan.preempted[0].request_id
    waiting = engine.observe().waiting
    assert waiting[0].request_id == preempted
    finished = engine.abort_request(preempted)
    assert finished.num_preemptions == 1
    assert finished.output_token_ids == waiting[0].output_token_ids
    prompts = {"a": [1, 2], "b": [3, 4], "c": [5]}
    outputs = {}
    bound = drain_within(engine.observe())
    while engine.has_unfinished_requests():
        bound.tick(engine.observe)
        for f in engine.step().finished:
            outputs[f.request_id] = f.output_token_ids
    assert outputs == {rid: solo(p, params) for rid, p in prompts.items() if rid != preempted}
    assert engine.observe().num_free_gpu_blocks == 6


def test_generate_checks_every_request_before_adding_any(model64: LlamaForCausalLM) -> None:
    engine = engine_with(model64)
    before = engine.observe()
    with pytest.raises(TokenOutOfVocabError):
        engine.generate([("a", [1, 2], P), ("b", [999], P)])
    assert engine.observe() == before
    with pytest.raises(DuplicateRequestError):
        engine.generate([("a", [1, 2], P), ("a", [3], P)])
    assert engine.observe() == before


def test_generate_returns_in_input_order_and_ids_can_be_reused(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    engine = engine_with(model64, num_gpu_blocks=16)
    requests = [("z", [9, 8, 7], P), ("a", [1], SamplingParams(max_tokens=1)), ("m", [4, 4], P)]
    results = engine.generate(requests)
    assert [r.request_id for r in results] == ["z", "a", "m"]
    assert [r.output_token_ids for r in results] == [solo(p, sp) for _, p, sp in requests]
    again = engine.generate([("a", [1], SamplingParams(max_tokens=1))])
    assert again[0].output_token_ids == results[1].output_token_ids
    assert engine.observe().next_arrival == 4


def test_default_model_is_built_when_none_is_given() -> None:
    engine = LLMEngine(SchedulerConfig(num_gpu_blocks=8, block_size=4), device="cpu", seed=1)
    assert engine.model.config.vocab_size == 256
    (result,) = engine.generate([("a", [1, 2, 3], P)])
    assert len(result.output_token_ids) == 4
    with pytest.raises(ValueError, match="unknown"):
        LLMEngine(SchedulerConfig(num_gpu_blocks=8), device="cpu", dtype="float8")


def test_generate_reports_a_stuck_engine(
    model64: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler that never admits (a liveness bug) fails generate() within its limit."""
    engine = engine_with(model64)
    monkeypatch.setattr(impl.phases, "admit", lambda scheduler, out, budget: budget)
    with pytest.raises(EngineStalledError, match=r"\['a'\] not finished after 11 steps"):
        engine.generate([("a", [1, 2], P)])
    assert drain_step_limit(engine.observe()) == 11  # (1 + 1) * (cdiv(2 + 4, B) + 4) + 1
