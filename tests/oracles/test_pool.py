"""The drained-pool checks themselves: whole pools pass, each kind of leak is named."""

from __future__ import annotations

from dataclasses import replace

import spec
from impl.prefix_cache import PrefixCachingBlockManager
from impl.scheduler import Scheduler
from impl.sequence import Sequence
from spec.oracle import HashOracle
from spec.types import (
    PrefixCacheState,
    Request,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    Semantics,
)
from tests.oracles.pool import cache_violations, engine_pool_violations, spec_pool_violations

CACHING = SchedulerConfig(num_gpu_blocks=6, block_size=2, enable_prefix_caching=True)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def drained(config: SchedulerConfig) -> SchedulerState:
    """Two requests sharing a two-block prefix, run to the end."""
    state = spec.init_state(config)
    state = spec.add_request(state, "a", (1, 2, 3, 4, 5), PARAMS)
    state = spec.add_request(state, "b", (1, 2, 3, 4, 6, 7), PARAMS)
    return spec.drain(state, HashOracle(vocab_size=8), max_steps=100)[0]


def test_a_drained_spec_pool_is_whole_under_every_profile() -> None:
    state = drained(CACHING)
    assert state.prefix_cache is not None and state.prefix_cache.cached  # keys survive
    assert spec_pool_violations(state) == []
    nano = replace(CACHING, semantics=Semantics.NANO_VLLM, enable_chunked_prefill=False)
    assert spec_pool_violations(drained(nano)) == []
    assert spec_pool_violations(drained(SchedulerConfig(num_gpu_blocks=6, block_size=2))) == []


def test_each_broken_rule_of_a_drained_spec_pool_is_named() -> None:
    state = drained(CACHING)
    cache = state.prefix_cache
    assert cache is not None
    lost = replace(state, prefix_cache=replace(cache, free_queue=cache.free_queue[1:]))
    assert any("not every one of 6 blocks" in v for v in spec_pool_violations(lost))
    counted = replace(state, num_free_gpu_blocks=5)
    assert any("free GPU/CPU blocks (5, 0)" in v for v in spec_pool_violations(counted))
    keyed = {block for _, block in cache.cached}
    head_keyed = (*sorted(keyed), *(b for b in range(6) if b not in keyed))
    assert keyed != set(range(6))
    reordered = replace(state, prefix_cache=replace(cache, free_queue=head_keyed))
    assert any(v.startswith("PC6: ") for v in spec_pool_violations(reordered))
    nano = replace(
        state,
        config=replace(CACHING, semantics=Semantics.NANO_VLLM, enable_chunked_prefill=False),
    )
    assert any("drop-key-on-free" in v for v in spec_pool_violations(nano))
    live = spec.add_request(state, "c", (1,), PARAMS)
    assert any("live requests" in v for v in spec_pool_violations(live))
    assert spec_pool_violations(replace(state, prefix_cache=PrefixCacheState(free_queue=()))) != []


def seq(tokens: list[int], rid: str) -> Sequence:
    request = Request(request_id=rid, prompt_token_ids=tuple(tokens), params=PARAMS, arrival=0)
    return Sequence(request)


def test_an_engine_pool_with_a_reference_left_is_not_whole() -> None:
    pool = PrefixCachingBlockManager(4, 2)
    config = replace(CACHING, num_gpu_blocks=4)
    a = seq([1, 2, 3, 4, 5], "a")
    pool.grow(a.block_table, 3)
    pool.cache_blocks(a, 0, 5)
    kept = list(a.block_table[:1])
    pool.free(a.block_table)
    assert cache_violations(pool, config) == []
    pool.touch(kept, kept)  # a hit never given back
    found = cache_violations(pool, config)
    assert any("still referenced" in v for v in found)
    assert any("not every one of 4 blocks" in v for v in found)


def test_a_drained_engine_scheduler_is_whole() -> None:
    scheduler = Scheduler(CACHING, vocab_size=8)
    scheduler.add_request("a", [1, 2, 3, 4, 5], PARAMS)
    scheduler.add_request("b", [1, 2, 3, 4, 6, 7], PARAMS)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.commit(out, [0] * out.num_samples)
    assert engine_pool_violations(scheduler) == []
    scheduler.add_request("c", [1, 2], PARAMS)
    scheduler.commit(scheduler.schedule(), [0])
    assert any("1 live requests" in v for v in engine_pool_violations(scheduler))
