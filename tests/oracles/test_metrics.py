"""The metric oracle itself: figures known by hand or documented, from spec traces alone."""

from __future__ import annotations

import pytest

from kvsched.demo import seed_config, seed_workload
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.scheduler import oracle_tokens
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, SchedulerState, StepPlan
from tests.impl.helpers import SEED_FIGURES
from tests.oracles.metrics import mismatches, replay, trace_metrics

ORACLE = HashOracle(vocab_size=256)


def oracle(mid: SchedulerState, plan: StepPlan) -> dict[str, int]:
    return oracle_tokens(mid, plan, ORACLE)


def request(
    rid: str, prompt: tuple[int, ...], max_tokens: int, arrival: int = 0
) -> WorkloadRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return WorkloadRequest(request_id=rid, prompt=prompt, params=params, arrival_step=arrival)


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_the_seed_workload_has_its_documented_figures(mode: PreemptionMode) -> None:
    config = seed_config(mode)
    m = trace_metrics(config, replay(config, seed_workload(), oracle))
    figures = SEED_FIGURES[mode]
    assert m.steps == figures.steps
    assert {str(k): n for k, n in m.preemptions_by_mode.items() if n} == figures.preemptions_by_mode
    assert (m.swap_out_blocks, m.swap_in_blocks) == figures.swap_blocks
    assert m.recomputed_tokens == figures.recomputed_tokens
    assert (m.scheduled_tokens, m.tokens_sampled) == (
        figures.scheduled_tokens,
        figures.sampled_tokens,
    )
    assert m.document()["kv_utilization"] == pytest.approx(figures.kv_utilization)
    assert m.peak_gpu_blocks_used == 20  # the seed's 20 slots fill up before each preemption


def test_kv_utilization_counts_a_shared_block_once() -> None:
    """Four requests share two blocks of 16 and have one block each: 6 blocks in use.
    Steps hold 32 + 4 x (1, 2, 3) slots of 96, whatever the per-request sum says."""
    shared = tuple(range(1, 33))
    workload = [request(f"r{i}", (*shared, 100 + i), 3) for i in range(4)]
    config = SchedulerConfig(num_gpu_blocks=6, enable_prefix_caching=True)
    m = trace_metrics(config, replay(config, workload, oracle)).document()
    assert m["steps"] == 3
    assert m["kv_utilization"] == pytest.approx((36 + 40 + 44) / 3 / 96)
    assert m["peak_gpu_blocks_used"] == 6
    # r0 misses; r1..r3 each hit the two shared blocks, admitted in the same step.
    assert m["prefix_cache"] == {
        "queries": 4 * 33,
        "hits": 3 * 32,
        "hit_rate": 96 / 132,
        "reclaimed_blocks": 0,
    }


def test_kv_utilization_without_caching_is_every_requests_slots() -> None:
    """One request of 3 tokens, 2 outputs, in 16 slots: 3 then 4 slots hold K/V."""
    config = SchedulerConfig(num_gpu_blocks=4, block_size=4)
    m = trace_metrics(config, replay(config, [request("a", (1, 2, 3), 2)], oracle))
    assert m.document()["kv_utilization"] == pytest.approx((3 / 16 + 4 / 16) / 2)


def test_reclaimed_blocks_are_the_keyed_blocks_taken_for_new_content() -> None:
    """``a`` leaves three keyed blocks of 4 (and its last one, partly filled, unkeyed);
    ``b``, arriving after, needs all four blocks of the pool: the free queue gives the
    unkeyed one first, then reclaims the three keyed ones."""
    config = SchedulerConfig(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True)
    workload = [request("a", tuple(range(12)), 2), request("b", tuple(range(50, 64)), 2, 5)]
    m = trace_metrics(config, replay(config, workload, oracle)).document()
    assert m["prefix_cache"] == {
        "queries": 12 + 14,
        "hits": 0,
        "hit_rate": 0.0,
        "reclaimed_blocks": 3,
    }


def test_recomputed_tokens_stop_at_what_the_victim_had_computed() -> None:
    """``a`` and ``b`` (prompts of 4, 6 outputs) in 3 blocks of 4: at step 1 ``a``'s decode
    needs a third block and ``b`` (4 computed, 1 output) is preempted; at step 6 it
    re-prefills 5 tokens, of which the first 4 were computed before."""
    config = SchedulerConfig(num_gpu_blocks=3, block_size=4, max_num_batched_tokens=8)
    workload = [request("a", (1, 2, 3, 4), 6), request("b", (5, 6, 7, 8), 6)]
    trace = replay(config, workload, oracle)
    assert [t.plan.step for t in trace if t.plan.preempted] == [1]
    assert trace[6].plan.scheduled_ids == ("b",)
    assert (trace[6].plan.num_computed_tokens, trace[6].plan.num_scheduled_tokens) == ((0,), (5,))
    m = trace_metrics(config, trace)
    assert m.recomputed_tokens == 4
    assert m.preemptions_by_mode == {PreemptionMode.RECOMPUTE: 1}


def test_mismatches_name_each_metric_that_differs() -> None:
    expected = {"steps": 3, "kv_utilization": 0.5, "prefix_cache": {"hits": 4, "queries": 8}}
    actual = {"steps": 3, "kv_utilization": 0.5 + 1e-15, "prefix_cache": {"hits": 5}}
    # In the document's order: the count a ratio is made of comes first.
    assert mismatches(expected, actual) == [
        ("prefix_cache_hits", "prefix_cache_hits: trace 4, engine 5"),
        ("prefix_cache_queries", "prefix_cache_queries: trace 8, engine (none)"),
    ]
    ratio = {"prefix_cache": {"hits": 3, "hit_rate": 0.5}}
    assert [
        name for name, _ in mismatches(ratio, {"prefix_cache": {"hits": 4, "hit_rate": 1.0}})
    ] == [
        "prefix_cache_hits",
        "prefix_cache_hit_rate",
    ]
