"""The seed tutorial's scenario on the real engine (float64 tiny model)."""

from __future__ import annotations

import pytest

from impl import LLMEngine, NoPreemptionEngine
from model import LlamaForCausalLM
from spec.types import FinishReason, KVCacheExhaustedError, PreemptionMode
from tests.impl.conftest import SoloFn
from tests.impl.helpers import SEED_FIGURES, SEED_PARAMS, seed_config, seed_prompts


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_seed_scenario_finishes_with_solo_outputs(
    mode: PreemptionMode, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    engine = LLMEngine(seed_config(mode), model=model64)
    prompts = seed_prompts()
    results = engine.generate([(f"r{i}", p, SEED_PARAMS) for i, p in enumerate(prompts)])
    assert [r.request_id for r in results] == [f"r{i}" for i in range(8)]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert [r.output_token_ids for r in results] == [solo(p, SEED_PARAMS) for p in prompts]
    metrics = engine.metrics
    assert sum(r.num_preemptions for r in results) == metrics.num_preemptions
    state = engine.observe()
    assert state.num_free_gpu_blocks == 20
    assert state.num_free_cpu_blocks == engine.config.num_cpu_blocks
    assert not engine.has_unfinished_requests()
    figures = SEED_FIGURES[mode]
    assert metrics.steps == state.num_steps == figures.steps
    assert {str(m): n for m, n in metrics.preemptions.items() if n} == figures.preemptions_by_mode
    assert (metrics.swap_out_blocks, metrics.swap_in_blocks) == figures.swap_blocks
    assert metrics.recomputed_tokens == figures.recomputed_tokens
    assert metrics.scheduled_tokens == figures.scheduled_tokens
    assert metrics.generated_tokens == figures.sampled_tokens  # restart samples again
    assert metrics.peak_gpu_blocks_used == 20
    assert metrics.kv_utilization == pytest.approx(figures.kv_utilization)
    assert metrics.tokens_per_s > 0


def test_no_preemption_engine_runs_out_of_kv(model64: LlamaForCausalLM) -> None:
    engine = NoPreemptionEngine(seed_config(PreemptionMode.RECOMPUTE), model=model64)
    for i, prompt in enumerate(seed_prompts()):
        engine.add_request(f"r{i}", prompt, SEED_PARAMS)
    engine.step()  # four 5-token prompts fill the 20 blocks
    before = engine.observe()
    assert before.num_free_gpu_blocks == 0
    with pytest.raises(KVCacheExhaustedError) as info:
        engine.step()
    err = info.value
    assert (err.used, err.needed, err.capacity) == (20, 1, 20)
    assert "used 20" in str(err) and "needed 1" in str(err) and "capacity 20" in str(err)
    assert engine.observe() == before
    assert engine.metrics.steps == 1
    with pytest.raises(KVCacheExhaustedError):
        engine.step()  # still no room, still nothing changes
    assert engine.observe() == before
