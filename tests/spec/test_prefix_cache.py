"""Prefix caching in the spec (PC1-PC9): hits, the cap, the free queue's order, sharing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import spec
from kvsched.workload import read_workload
from spec.invariants import plan_violations, state_violations
from spec.oracle import HashOracle
from spec.prefix_cache import (
    longest_hit,
    max_hit_blocks,
    release,
    take,
    touch,
    unkey_undone_chunk,
)
from spec.profiles import full_sequence_fits
from spec.scheduler import first_draft, schedule_running, step
from spec.types import (
    ConfigError,
    PreemptionMode,
    PrefixCacheState,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)
from tests.drain import drain_within, workload_bound
from tests.oracles.pool import spec_pool_violations


def oracle(tokens: tuple[int, ...]) -> int:
    return (sum(tokens) * 7 + len(tokens)) % 50


def config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_gpu_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def checked_step(state: SchedulerState) -> tuple[SchedulerState, StepPlan]:
    after, plan = step(state, oracle)
    assert state_violations(after) == ()
    assert plan_violations(state, plan, after) == ()
    return after, plan


def run_until_done(state: SchedulerState) -> SchedulerState:
    bound = drain_within(state)
    while spec.has_unfinished_requests(state):
        bound.tick(state)
        state, _ = checked_step(state)
    assert spec_pool_violations(state) == []
    return state


PARAMS = SamplingParams(max_tokens=2)


def test_swap_is_refused_and_every_profile_may_cache() -> None:
    with pytest.raises(ConfigError):
        config(preemption_mode=PreemptionMode.SWAP)
    # Each peer profile's caching has its own rules (spec/profiles.py, docs/semantics.md).
    assert config(semantics="vllm-v1", max_num_seqs=8).enable_prefix_caching
    assert config(semantics="nano-vllm", enable_chunked_prefill=False).enable_prefix_caching


def test_the_hit_is_capped_one_token_short_in_whole_blocks() -> None:
    assert [max_hit_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_a_resent_prompt_of_exactly_k_blocks_recomputes_its_last_block() -> None:
    state = spec.add_request(spec.init_state(config()), "a", tuple(range(12)), PARAMS)
    state = run_until_done(state)
    # PC6: finished, its 3 blocks are free but keep their keys, last block first in line.
    assert state.prefix_cache is not None
    assert len(state.prefix_cache.cached) == 3
    state = spec.add_request(state, "b", tuple(range(12)), PARAMS)
    state, plan = checked_step(state)
    assert plan.scheduled[0].start == 8 and plan.scheduled[0].num_tokens == 4


def test_requests_admitted_in_one_step_share_the_blocks_keyed_in_it() -> None:
    state = spec.init_state(config())
    for rid in ("a", "b"):
        state = spec.add_request(state, rid, tuple(range(10)), PARAMS)
    state, plan = checked_step(state)
    assert [(c.start, c.num_tokens) for c in plan.scheduled] == [(0, 10), (8, 2)]
    a, b = state.running
    assert a.block_ids[:2] == b.block_ids[:2] and a.block_ids[2] != b.block_ids[2]
    assert state.num_free_gpu_blocks == 16 - 4  # shared blocks count once (PC1)


def test_a_hit_on_a_free_block_takes_it_out_of_the_queue_before_allocation() -> None:
    cache = PrefixCacheState(free_queue=(0, 1, 2), cached=(((1, 2), 0),))
    assert longest_hit(cache, (1, 2, 3), 2) == (0,)
    after, new = take(touch(cache, (0,)), 1)
    assert new == (1,) and after.free_queue == (2,) and after.cached == cache.cached


def test_reclaiming_drops_the_key_and_freeing_keeps_keyed_blocks_longest() -> None:
    cache = PrefixCacheState(free_queue=(5, 6), cached=(((9,), 5),))
    after, blocks = take(cache, 1)
    assert blocks == (5,) and after.cached == ()
    keyed = PrefixCacheState(free_queue=after.free_queue, cached=(((1,), 1), ((1, 2), 4)))
    released = release(keyed, (1, 4, 2, 3), Counter({2: 1}))
    # Reverse table order; unkeyed 3 to the head, keyed 4 and 1 to the tail; 2 still held.
    assert released.free_queue == (3, 6, 4, 1)


def test_a_preempted_request_hits_its_own_freed_blocks() -> None:
    cfg = config(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=16)
    state = spec.init_state(cfg)
    state = spec.add_request(state, "a", tuple(range(6)), SamplingParams(max_tokens=5))
    state = spec.add_request(state, "b", tuple(range(20, 26)), SamplingParams(max_tokens=5))
    hit_own = False
    bound = drain_within(state)
    while spec.has_unfinished_requests(state):
        bound.tick(state)
        before = state
        state, plan = checked_step(state)
        waiting = {r.request_id: r for r in before.waiting}
        for chunk in plan.scheduled:
            request = waiting.get(chunk.request_id)
            if request is not None and request.num_preemptions and chunk.start:
                hit_own = True
    assert spec_pool_violations(state) == []
    assert hit_own


def test_vllm_v1_full_sequence_gate_credits_the_hit_and_charges_its_free_blocks() -> None:
    """vllm-v1/full-sequence-admission with a hit (V9): cdiv(20, 4) - hit + free hits <= free."""
    vllm = config(semantics="vllm-v1", max_num_seqs=8)
    request = RequestState(
        request=Request(request_id="r", prompt_token_ids=tuple(range(20)), params=PARAMS, arrival=0)
    )
    assert full_sequence_fits(vllm, request, 4, num_hit=2)
    assert not full_sequence_fits(vllm, request, 4, num_hit=2, num_evictable=2)
    assert not full_sequence_fits(vllm, request, 4)
    assert full_sequence_fits(config(), request, 0)  # kvsched has no such gate


def test_no_hit_on_a_block_an_undone_chunk_keyed() -> None:
    """vllm-v1/undone-chunk-unkeyed (docs/peers.md V11, whose repro this is): V's decode
    keys a block at step 3 and is undone, R then preempts itself; Y, arriving at step 4
    with V's tokens, must not hit a block no chunk computed (vLLM 0.32.0 does)."""
    config = SchedulerConfig(
        num_gpu_blocks=16,
        block_size=1,
        max_num_batched_tokens=6,
        max_num_seqs=4,
        enable_prefix_caching=True,
        semantics="vllm-v1",  # type: ignore[arg-type]
        policy="priority",
    )
    repro = Path(__file__).parents[1] / "peers" / "repros" / "undone_chunk_keys.jsonl"
    pending = read_workload(repro)
    last = max(r.arrival_step for r in pending)
    bound = workload_bound(config, ((r.prompt, r.params) for r in pending), last_arrival=last)
    state = spec.init_state(config)
    written: set[tuple[int, int]] = set()  # (block, position) some chunk computed
    undone = preemptions = 0
    while pending or spec.has_unfinished_requests(state):
        bound.tick(state)
        while pending and pending[0].arrival_step <= state.num_steps:
            r = pending.pop(0)
            state = spec.add_request(state, r.request_id, r.prompt, r.params)
        mid, _ = spec.schedule(state)
        undone += len(schedule_running(first_draft(state)).undone)
        waiting = {r.request_id for r in state.waiting}
        state, plan = spec.step(state, HashOracle(vocab_size=256))
        blocks = {r.request_id: r.block_ids for r in mid.running}
        for chunk in plan.scheduled:
            ids = blocks[chunk.request_id]
            if chunk.request_id in waiting:
                hit = {(ids[pos], pos) for pos in range(chunk.start)}
                assert hit <= written, (chunk, hit - written)
            written.update(
                (ids[pos], pos) for pos in range(chunk.start, chunk.start + chunk.num_tokens)
            )
        preemptions += len(plan.preempted)
    assert spec_pool_violations(state) == []
    assert undone >= 1 and preemptions >= 2


def test_an_undone_prefill_chunk_gives_back_the_keys_of_every_block_it_filled() -> None:
    """vllm-v1/undone-chunk-unkeyed for V11's second trigger (docs/peers.md): V's chunk
    [80, 112) keyed two blocks of 16 when it was scheduled (vLLM reaches this with
    long_prefill_token_threshold 32, tests/peers/repros/undone_prefill_chunk_keys.jsonl);
    undone, it gives back both keys, and the five blocks earlier chunks wrote keep theirs,
    so V's own re-admission hits positions 0-79 at most."""
    tokens = tuple(range(1, 128))
    blocks = (6, 5, 4, 3, 2, 1, 0)  # V's table: position p is in blocks[p // 16]
    cache = PrefixCacheState(
        free_queue=(7,), cached=tuple((tokens[: 16 * (i + 1)], b) for i, b in enumerate(blocks))
    )
    after = unkey_undone_chunk(cache, blocks, start=80, end=112, block_size=16)
    assert after.cached == cache.cached[:5]
    assert after.free_queue == cache.free_queue
