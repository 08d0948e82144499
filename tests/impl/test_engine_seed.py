"""The seed tutorial's scenario on the real engine (float64 tiny model)."""

from __future__ import annotations

import pytest

from impl import LLMEngine, NoPreemptionEngine
from model import LlamaForCausalLM
from spec.types import FinishReason, KVCacheExhaustedError, PreemptionMode
from tests.impl.conftest import SoloFn
from tests.impl.helpers import SEED_PARAMS, seed_config, seed_prompts


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
    assert metrics.num_preemptions > 0
    assert sum(r.num_preemptions for r in results) == metrics.num_preemptions
    assert metrics.preemptions[mode] > 0
    state = engine.observe()
    assert state.num_free_gpu_blocks == 20
    assert state.num_free_cpu_blocks == engine.config.num_cpu_blocks
    assert not engine.has_unfinished_requests()
    assert metrics.steps == state.num_steps
    assert metrics.peak_gpu_blocks_used == 20
    assert 0.0 < metrics.kv_utilization <= 1.0
    assert metrics.tokens_per_s > 0
    if mode is PreemptionMode.SWAP:
        assert metrics.swap_out_blocks > 0
        assert metrics.swap_in_blocks > 0
    else:
        assert metrics.recomputed_tokens > 0
        assert metrics.swap_out_blocks == metrics.swap_in_blocks == 0
    if mode is PreemptionMode.RESTART:
        assert metrics.generated_tokens > 64  # discarded outputs were sampled again
    else:
        assert metrics.generated_tokens == 64


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
