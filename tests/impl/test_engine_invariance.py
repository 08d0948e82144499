"""Batch invariance end to end (float64): a request's outputs do not depend on what it
is batched with, how its prompt is chunked, its blocks, or how it is preempted."""

from __future__ import annotations

import random

import pytest

from impl import LLMEngine
from model import LlamaForCausalLM
from spec.types import FinishReason, PreemptionMode, SamplingParams, SchedulerConfig
from tests.drain import workload_bound
from tests.impl.conftest import SoloFn


def workload(
    seed: int, n: int, *, temperature: float = 0.0
) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            f"q{i}",
            [rng.randint(0, 255) for _ in range(rng.randint(1, 12))],
            SamplingParams(
                max_tokens=rng.randint(1, 8),
                ignore_eos=True,
                temperature=temperature,
                seed=rng.randint(0, 1000) if temperature else None,
                priority=rng.randint(0, 2),
            ),
        )
        for i in range(n)
    ]


CONFIGS = [
    # Roomy: every mix is one batch, chunked prefill with a small budget.
    SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=5),
    # Tight, block size 1, recompute.
    SchedulerConfig(num_gpu_blocks=20, block_size=1, max_num_batched_tokens=7, max_num_seqs=6),
    # Tight, block size 3, restart, chunked prefill off.
    SchedulerConfig(
        num_gpu_blocks=8,
        block_size=3,
        max_num_batched_tokens=24,
        enable_chunked_prefill=False,
        preemption_mode=PreemptionMode.RESTART,
    ),
    # Tight, swap with a small CPU pool (some swaps fall back to recompute).
    SchedulerConfig(
        num_gpu_blocks=10,
        block_size=2,
        max_num_batched_tokens=3,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=5,
    ),
    # Tight, swap, roomy CPU pool, priority policy.
    SchedulerConfig(
        num_gpu_blocks=10,
        block_size=2,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=32,
        policy="priority",
    ),
    # Tight, fewest-outputs policy.
    SchedulerConfig(
        num_gpu_blocks=12, block_size=2, max_num_batched_tokens=4, policy="fewest-outputs"
    ),
]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"{c.preemption_mode}-{c.policy}-bs{c.block_size}"
)
def test_outputs_equal_solo_runs(
    config: SchedulerConfig, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    requests = workload(7, 10)
    engine = LLMEngine(config, model=model64)
    results = engine.generate(requests)
    for (rid, prompt, params), result in zip(requests, results, strict=True):
        assert result.request_id == rid
        assert result.output_token_ids == solo(prompt, params), rid
        assert result.finish_reason is FinishReason.LENGTH
    assert engine.observe().num_free_gpu_blocks == config.num_gpu_blocks
    if config.num_gpu_blocks < 64:
        assert engine.metrics.num_preemptions > 0


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_seeded_temperature_sampling_equals_solo_under_preemption(
    mode: PreemptionMode, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    config = SchedulerConfig(
        num_gpu_blocks=14,
        block_size=2,
        max_num_batched_tokens=6,
        preemption_mode=mode,
        num_cpu_blocks=12,
    )
    requests = workload(11, 8, temperature=0.9)
    engine = LLMEngine(config, model=model64)
    results = engine.generate(requests)
    assert engine.metrics.num_preemptions > 0
    assert [r.output_token_ids for r in results] == [solo(p, sp) for _, p, sp in requests]


def test_eos_stops_at_the_same_token_under_preemption(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    base = workload(3, 6)
    requests = []
    for rid, prompt, _ in base:
        free_run = solo(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        eos = free_run[min(2, len(free_run) - 1)]
        requests.append((rid, prompt, SamplingParams(max_tokens=8, eos_token_id=eos)))
    engine = LLMEngine(
        SchedulerConfig(num_gpu_blocks=20, block_size=1, max_num_batched_tokens=6), model=model64
    )
    results = engine.generate(requests)
    assert engine.metrics.num_preemptions > 0
    for (_, prompt, params), result in zip(requests, results, strict=True):
        expected = solo(prompt, params)
        assert result.output_token_ids == expected
        assert expected[-1] == params.eos_token_id
        assert result.finish_reason is FinishReason.STOP


def test_staggered_arrivals_and_aborts_do_not_change_outputs(
    model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    requests = workload(5, 9)
    config = SchedulerConfig(num_gpu_blocks=16, block_size=2, max_num_batched_tokens=4)
    engine = LLMEngine(config, model=model64)
    results = {}
    pending = list(requests)
    aborted = set()
    step = 0
    last = 2 * (len(requests) - 1)  # one arrival every other step
    bound = workload_bound(config, ((p, params) for _, p, params in requests), last_arrival=last)
    while pending or engine.has_unfinished_requests():
        bound.tick(engine.observe)
        if pending and step % 2 == 0:
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if step == 5:
            live = [r.request_id for r in engine.observe().running]
            if live:
                aborted.add(engine.abort_request(live[-1]).request_id)
        for f in engine.step().finished:
            results[f.request_id] = f.output_token_ids
        step += 1
    assert aborted
    for rid, prompt, params in requests:
        if rid not in aborted:
            assert results[rid] == solo(prompt, params), rid
