"""EngineMetrics on small hand-checked runs."""

from __future__ import annotations

import pytest

from impl import EngineMetrics, LLMEngine
from model import LlamaForCausalLM
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig


def test_metrics_of_a_single_request(model64: LlamaForCausalLM) -> None:
    engine = LLMEngine(SchedulerConfig(num_gpu_blocks=8, block_size=2), model=model64)
    engine.generate([("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))])
    m = engine.metrics
    # Step 0: prefill 3 tokens (2 blocks). Step 1: decode position 3 (2 blocks).
    # Step 2: decode position 4 (3 blocks). Capacity 16 token slots.
    assert m.steps == 3
    assert m.scheduled_tokens == 5
    assert m.generated_tokens == 3
    assert m.peak_gpu_blocks_used == 3
    assert m.kv_utilization == pytest.approx((3 / 16 + 4 / 16 + 5 / 16) / 3)
    assert m.num_preemptions == 0 and m.recomputed_tokens == 0
    assert m.swap_in_blocks == m.swap_out_blocks == 0
    assert m.step_time_s > 0 and m.tokens_per_s == pytest.approx(3 / m.step_time_s)


def test_metrics_count_recompute_and_swap(model64: LlamaForCausalLM) -> None:
    # The hand-checked scheduling scenario of test_scheduler_scenarios: C is preempted
    # in step 2, B in step 3; B re-prefills 7 tokens (6 computed before) and C 1 + 2
    # (2 computed before): 8 recomputed tokens.
    engine = LLMEngine(
        SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=8),
        model=model64,
    )
    params = {
        "A": ([1, 2, 3], 4),
        "B": ([4, 5, 6, 7], 4),
        "C": ([8, 9], 2),
    }
    engine.generate(
        [(rid, p, SamplingParams(max_tokens=m, ignore_eos=True)) for rid, (p, m) in params.items()]
    )
    m = engine.metrics
    assert m.preemptions == {
        PreemptionMode.RECOMPUTE: 2,
        PreemptionMode.RESTART: 0,
        PreemptionMode.SWAP: 0,
    }
    assert m.recomputed_tokens == 8
    assert m.steps == 6
    assert m.peak_gpu_blocks_used == 6

    swap = LLMEngine(
        SchedulerConfig(
            num_gpu_blocks=4,
            block_size=1,
            max_num_batched_tokens=4,
            preemption_mode=PreemptionMode.SWAP,
            num_cpu_blocks=4,
        ),
        model=model64,
    )
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    swap.generate([("A", [1, 2], p), ("B", [3, 4], p)])
    assert swap.metrics.preemptions[PreemptionMode.SWAP] == 1
    assert swap.metrics.swap_out_blocks == swap.metrics.swap_in_blocks == 2
    assert swap.metrics.recomputed_tokens == 0


def test_empty_metrics() -> None:
    m = EngineMetrics()
    assert m.kv_utilization == 0.0 and m.tokens_per_s == 0.0 and m.num_preemptions == 0


def test_kv_utilization_counts_a_shared_block_once(model64: LlamaForCausalLM) -> None:
    """Four prompts of 33 tokens share their first two blocks of 16: 6 blocks hold them.
    Each step has 32 shared slots plus 1, 2, 3 of each request's own: 36, 40, 44 of 96
    (the per-request sum, 132 of 96 at the first step, would read 142 %)."""
    engine = LLMEngine(SchedulerConfig(num_gpu_blocks=6, enable_prefix_caching=True), model=model64)
    shared = list(range(1, 33))
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.generate([(f"r{i}", [*shared, 40 + i], p) for i in range(4)])
    m = engine.metrics
    assert m.steps == 3 and m.peak_gpu_blocks_used == 6
    assert m.prefix_cache_hits == 3 * 32
    assert m.kv_utilization == pytest.approx((36 + 40 + 44) / 3 / 96)
