"""The engine's speculative decoding (vllm-v1/spec-*) with the tiny float64 model.

Greedy outputs equal those without drafts, token for token (every accepted draft is the
argmax a one-token decode would have taken), however the steps go: preemptions, prefix
cache hits, stops inside a run. A verify forward that fails after writing its K/V is
rolled back exactly. At temperature > 0 the runs are reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import pytest

from impl import LLMEngine
from impl.ngram_proposer import NgramProposer
from impl.scheduler_output import SchedulerOutput
from model import LlamaForCausalLM
from spec.types import FinishReason, SamplingParams, SchedulerConfig, Semantics, StepPlan

Request = tuple[str, list[int], SamplingParams]
Outputs = dict[str, tuple[tuple[int, ...], FinishReason]]

MAX_MODEL_LEN = 64
ROOMY_BLOCKS = 64
#: 16 blocks of 4: one max_model_len sequence; the workload needs several times that.
SMALL_BLOCKS = 16
PATTERN = [7, 3, 9, 1]
RANDOM_CASES = 32


class InjectedFault(RuntimeError):
    pass


def greedy_workload(
    *, temperature: float = 0.0, seeds: Sequence[int | None] = (None,) * 6
) -> list[Request]:
    """Repetitive prompts: the tiny model falls into loops on them (request b's outputs
    cycle with period 11), so prompt lookup drafts are often right. a and e share a
    16-token prefix (prefix cache hits); e stops at an EOS, the others at max_tokens."""

    def params(max_tokens: int, seed: int | None, **more: Any) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **more)

    return [
        ("a", PATTERN * 4, params(24, seeds[0], ignore_eos=True)),
        ("b", [5, 6] * 6 + [8], params(40, seeds[1], ignore_eos=True)),
        ("c", list(range(10, 20)) * 2, params(20, seeds[2], ignore_eos=True)),
        ("d", [42] * 9, params(30, seeds[3], ignore_eos=True)),
        ("e", PATTERN * 4 + [2, 2], params(26, seeds[4], eos_token_id=22)),
        ("f", [5, 6] * 6 + [8, 9], params(21, seeds[5], ignore_eos=True)),
    ]


def vllm_config(
    *, num_gpu_blocks: int, prefix_caching: bool, k: int, **more: Any
) -> SchedulerConfig:
    fields: dict[str, Any] = {
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "semantics": Semantics.VLLM_V1,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": prefix_caching,
        "num_speculative_tokens": k,
    }
    fields.update(more)
    return SchedulerConfig(**fields)


def drafter_for(config: SchedulerConfig, lookup: tuple[int, int] | None) -> NgramProposer | None:
    """``None``: the engine's own (5-grams); else an n-gram of ``lookup`` lengths."""
    if lookup is None or not config.num_speculative_tokens:
        return None
    return NgramProposer(
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_min=lookup[0],
        prompt_lookup_max=lookup[1],
        max_model_len=config.max_model_len,
    )


def run_all(engine: LLMEngine, requests: Sequence[Request]) -> list[StepPlan]:
    """Add ``requests`` and step to the end, checking the invariants after each step."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    plans = []
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            break
        plans.append(engine.step())
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    return plans


def outputs_of(plans: Sequence[StepPlan]) -> Outputs:
    return {
        f.request_id: (f.output_token_ids, f.finish_reason) for plan in plans for f in plan.finished
    }


def accepted_drafts(plans: Sequence[StepPlan]) -> int:
    """Tokens past the first that a request sampled in one step: its accepted drafts."""
    return sum(
        plan.sampled_ids.count(request_id) - 1
        for plan in plans
        for request_id in set(plan.sampled_ids)
    )


def metrics_without_time(engine: LLMEngine) -> dict[str, Any]:
    values = asdict(engine.metrics)
    del values["step_time_s"]
    return values


_BASELINES: dict[tuple[SchedulerConfig, str], Outputs] = {}


def baseline(
    model: LlamaForCausalLM, config: SchedulerConfig, requests: Sequence[Request]
) -> Outputs:
    """The outputs of ``config`` without speculative decoding (memoised)."""
    plain = replace(config, num_speculative_tokens=0)
    key = (plain, repr(requests))
    if key not in _BASELINES:
        engine = LLMEngine(plain, model=model)
        plans = run_all(engine, requests)
        assert accepted_drafts(plans) == 0
        _BASELINES[key] = outputs_of(plans)
    return _BASELINES[key]


# --- (a) greedy outputs equal those without drafts ------------------------------------------


@pytest.mark.parametrize("lookup", [None, (1, 3)], ids=["ngram5", "ngram1-3"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("num_gpu_blocks", [ROOMY_BLOCKS, SMALL_BLOCKS], ids=["roomy", "small"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_equal_those_without_drafts(
    model64: LlamaForCausalLM,
    k: int,
    num_gpu_blocks: int,
    prefix_caching: bool,
    lookup: tuple[int, int] | None,
) -> None:
    config = vllm_config(num_gpu_blocks=num_gpu_blocks, prefix_caching=prefix_caching, k=k)
    requests = greedy_workload()
    engine = LLMEngine(config, model=model64, drafter=drafter_for(config, lookup))
    assert engine.drafter is not None
    plans = run_all(engine, requests)
    outputs = outputs_of(plans)
    assert outputs == baseline(model64, config, requests)
    assert outputs["e"][1] is FinishReason.STOP  # the EOS stop is in the workload
    # Drafts were accepted, so the equality is not that of a run without any.
    assert accepted_drafts(plans) >= 5
    # A token a run brought past a stop is dropped, not counted.
    assert engine.metrics.generated_tokens == sum(len(tokens) for tokens, _ in outputs.values())
    if num_gpu_blocks == SMALL_BLOCKS:
        assert engine.metrics.num_preemptions > 0
    if prefix_caching:
        assert engine.metrics.prefix_cache_hits > 0


def random_case(seed: int) -> tuple[SchedulerConfig, tuple[int, int], list[Request]]:
    """A random vllm-v1 config with drafts and a random repetitive greedy workload."""
    rng = random.Random(seed)
    k = rng.randint(1, 5)
    block_size = rng.choice((1, 2, 4, 8))
    max_model_len = rng.choice((24, 40, 48))
    max_num_seqs = rng.choice((2, 3, 4, 8))
    config = SchedulerConfig(
        num_gpu_blocks=-(-max_model_len // block_size) * rng.choice((1, 1, 2, 4)),
        block_size=block_size,
        max_num_batched_tokens=rng.randint(max(max_num_seqs, 1 + k), 40),
        max_num_seqs=max_num_seqs,
        semantics=Semantics.VLLM_V1,
        policy=rng.choice(("lifo", "priority")),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.5,
        long_prefill_token_threshold=rng.choice((0, 0, 1 + k + rng.randint(0, 6))),
        num_speculative_tokens=k,
    )
    low = rng.randint(1, 3)
    lookup = (low, rng.randint(low, 4))
    pieces = [[rng.randrange(256) for _ in range(rng.randint(1, 4))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(2, 7)):
        piece = rng.choice(pieces)
        prompt = (piece * rng.randint(1, 6))[: max_model_len // 2] + [
            rng.randrange(256) for _ in range(rng.randint(0, 2))
        ]
        requests.append(
            (
                f"r{i}",
                prompt,
                SamplingParams(
                    max_tokens=rng.randint(1, max_model_len - len(prompt)),
                    eos_token_id=rng.randrange(256),
                    priority=rng.randint(0, 2),
                ),
            )
        )
    return config, lookup, requests


@pytest.mark.parametrize("seed", range(RANDOM_CASES))
def test_random_greedy_runs_equal_those_without_drafts(
    model64: LlamaForCausalLM, seed: int
) -> None:
    config, lookup, requests = random_case(seed)
    engine = LLMEngine(config, model=model64, drafter=drafter_for(config, lookup))
    outputs = outputs_of(run_all(engine, requests))
    assert outputs == baseline(model64, config, requests)


def test_random_cases_draft_and_preempt(model64: LlamaForCausalLM) -> None:
    """The random cases above reach what they are there for: accepted drafts and
    preemptions (each in some case, as a whole)."""
    accepted = preemptions = 0
    for seed in range(RANDOM_CASES):
        config, lookup, requests = random_case(seed)
        engine = LLMEngine(config, model=model64, drafter=drafter_for(config, lookup))
        accepted += accepted_drafts(run_all(engine, requests))
        preemptions += engine.metrics.num_preemptions
    assert accepted >= 10
    assert preemptions >= 3


# --- (b) a failing verify rolls the step back -----------------------------------------------


def failing_verify(
    real: Callable[[SchedulerOutput], list[list[int]]],
    condition: Callable[[SchedulerOutput, list[list[int]]], bool],
) -> tuple[Callable[[SchedulerOutput], list[list[int]]], list[int]]:
    """Wrap ``verify``: run the real one (its forward writes K/V, the drafts' too),
    then raise, once per step, where ``condition(out, runs)`` holds."""
    failed_steps: list[int] = []

    def verify(out: SchedulerOutput) -> list[list[int]]:
        runs = real(out)
        if out.step not in failed_steps and condition(out, runs):
            failed_steps.append(out.step)
            raise InjectedFault(f"fault in step {out.step}")
        return runs

    return verify, failed_steps


def step_expecting_faults(engine: LLMEngine, failed_steps: list[int]) -> list[StepPlan]:
    """Step to the end; a step that failed leaves observe() and the metrics as they
    were before it, and its retry goes on."""
    plans = []
    for _ in range(4_000):
        if not engine.has_unfinished_requests():
            break
        before = engine.observe()
        metrics = metrics_without_time(engine)
        failures = len(failed_steps)
        try:
            plans.append(engine.step())
        except InjectedFault:
            assert len(failed_steps) == failures + 1
            assert engine.observe() == before
            assert metrics_without_time(engine) == metrics
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    return plans


def runs_drafts(out: SchedulerOutput, runs: list[list[int]]) -> bool:
    return any(seq.spec_token_ids for seq in out.scheduled)


def accepts_drafts(out: SchedulerOutput, runs: list[list[int]]) -> bool:
    return any(len(run) > 1 for run in runs)


def preempts(out: SchedulerOutput, runs: list[list[int]]) -> bool:
    return bool(out.preempted)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize(
    "condition", [runs_drafts, accepts_drafts, preempts], ids=lambda c: c.__name__
)
def test_a_verify_fault_after_writing_kv_is_rolled_back(
    model64: LlamaForCausalLM,
    condition: Callable[[SchedulerOutput, list[list[int]]], bool],
    prefix_caching: bool,
) -> None:
    config = vllm_config(num_gpu_blocks=SMALL_BLOCKS, prefix_caching=prefix_caching, k=3)
    requests = greedy_workload()
    clean = LLMEngine(config, model=model64, drafter=drafter_for(config, (1, 3)))
    clean_plans = run_all(clean, requests)

    engine = LLMEngine(config, model=model64, drafter=drafter_for(config, (1, 3)))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    verify, failed = failing_verify(engine.model_runner.verify, condition)
    setattr(engine.model_runner, "verify", verify)  # noqa: B010 (a test double)
    plans = step_expecting_faults(engine, failed)
    assert len(failed) >= 3  # every step the condition picked failed once, then went on
    assert plans == clean_plans
    assert metrics_without_time(engine) == metrics_without_time(clean)
    assert outputs_of(plans) == baseline(model64, config, requests)


def test_a_single_verify_fault_is_retried(model64: LlamaForCausalLM) -> None:
    """One fault, in the first step that accepts a draft, then none."""
    config = vllm_config(num_gpu_blocks=ROOMY_BLOCKS, prefix_caching=True, k=5)
    requests = greedy_workload()
    clean_plans = run_all(LLMEngine(config, model=model64), requests)

    engine = LLMEngine(config, model=model64)
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    faults: list[int] = []

    def first_acceptance(out: SchedulerOutput, runs: list[list[int]]) -> bool:
        return not faults and accepts_drafts(out, runs)

    verify, failed = failing_verify(engine.model_runner.verify, first_acceptance)
    faults = failed
    setattr(engine.model_runner, "verify", verify)  # noqa: B010 (a test double)
    plans = step_expecting_faults(engine, failed)
    assert len(failed) == 1
    assert plans == clean_plans


# --- (c) temperature > 0 --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.1, 0.8])
def test_sampling_with_drafts_is_reproducible(
    model64: LlamaForCausalLM, temperature: float
) -> None:
    config = vllm_config(num_gpu_blocks=SMALL_BLOCKS, prefix_caching=True, k=3)
    requests = greedy_workload(temperature=temperature, seeds=(1, 2, 3, None, 5, 6))
    vocab = model64.config.vocab_size

    def run() -> tuple[list[StepPlan], LLMEngine]:
        engine = LLMEngine(config, model=model64, drafter=drafter_for(config, (1, 3)))
        return run_all(engine, requests), engine

    plans, engine = run()
    again, _ = run()
    assert again == plans
    outputs = outputs_of(plans)
    assert set(outputs) == {request_id for request_id, _, _ in requests}
    for request_id, prompt, params in requests:
        tokens, reason = outputs[request_id]
        assert all(0 <= token < vocab for token in tokens)
        assert 1 <= len(tokens) <= min(params.max_tokens, MAX_MODEL_LEN - len(prompt))
        if reason is FinishReason.STOP:
            assert tokens[-1] == params.eos_token_id
        else:
            assert len(tokens) == params.max_tokens
    assert engine.metrics.num_preemptions > 0
    # The first token of each request is sampled without drafts: the same draw as
    # without speculative decoding, to the bit.
    plain = baseline(model64, config, requests)
    assert {r: out[0][0] for r, out in outputs.items()} == {
        r: out[0][0] for r, out in plain.items()
    }
    if temperature == 0.1:  # near-greedy: drafts get accepted
        assert accepted_drafts(plans) >= 5
