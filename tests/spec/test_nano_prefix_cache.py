"""nano-vllm's prefix-cache rules (spec/prefix_cache.py, spec/profiles.py; docs/semantics.md,
N7, N8, N13)."""

from __future__ import annotations

from collections import Counter

import spec
from spec.oracle import HashOracle
from spec.prefix_cache import give_keys_last_wins, nano_pool_violations, release_dropping_keys
from spec.profiles import profile_defaults, whole_sequence_admissible
from spec.types import (
    PrefixCacheState,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    Semantics,
)
from tests.oracles.pool import spec_pool_violations

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def nano() -> SchedulerConfig:
    """The profile's own config: chunked prefill off, caching on (``profile_defaults``)."""
    semantics = Semantics.NANO_VLLM
    return SchedulerConfig(
        num_gpu_blocks=8, block_size=4, semantics=semantics, **profile_defaults(semantics)
    )


def waiting(prompt: tuple[int, ...]) -> RequestState:
    return RequestState(
        request=Request(request_id="r", prompt_token_ids=prompt, params=PARAMS, arrival=0)
    )


def test_a_key_moves_to_the_block_keyed_last_and_keeps_its_place() -> None:
    cache = PrefixCacheState(free_queue=(), cached=(((1, 2), 0), ((1, 2, 3, 4), 1), ((9, 9), 5)))
    tokens = (1, 2, 3, 4, 5)
    after = give_keys_last_wins(cache, tokens, (0, 7), start=2, end=4, block_size=2)
    assert after.cached == (((1, 2), 0), ((1, 2, 3, 4), 7), ((9, 9), 5))
    assert nano_pool_violations(after) == []


def test_only_the_blocks_a_chunk_fills_get_keys() -> None:
    cache = PrefixCacheState(free_queue=())
    # Block 0 was full before the chunk (its key moved away): it stays without one.
    after = give_keys_last_wins(cache, (1, 2, 3, 4, 5), (0, 1, 2), start=2, end=5, block_size=2)
    assert after.cached == (((1, 2, 3, 4), 1),)


def test_a_freed_block_loses_its_key_and_joins_the_tail() -> None:
    cache = PrefixCacheState(free_queue=(6,), cached=(((1, 2), 0), ((1, 2, 3, 4), 1)))
    # Block 0 is shared with another request: it stays, with its key.
    after = release_dropping_keys(cache, (0, 1, 2), Counter({0: 1}))
    assert after == PrefixCacheState(free_queue=(6, 2, 1), cached=(((1, 2), 0),))


def test_the_gate_tests_the_whole_sequence_hit_or_not() -> None:
    request = waiting((1, 2, 3, 4, 5))
    assert whole_sequence_admissible(nano(), request, budget=5, free=2)
    assert not whole_sequence_admissible(nano(), request, budget=4, free=2)
    assert not whole_sequence_admissible(nano(), request, budget=5, free=1)
    kvsched = SchedulerConfig(num_gpu_blocks=8, block_size=4, enable_prefix_caching=True)
    assert whole_sequence_admissible(kvsched, request, budget=1, free=0)


def test_a_request_hits_a_running_one_but_not_a_finished_one() -> None:
    config = nano()
    state = spec.init_state(config)
    state = spec.add_request(state, "a", (1, 2, 3, 4, 5), SamplingParams(max_tokens=1))
    state = spec.add_request(state, "b", (1, 2, 3, 4, 6), PARAMS)
    state, plan = spec.step(state, HashOracle(8))
    assert [(c.request_id, c.start) for c in plan.scheduled] == [("a", 0), ("b", 4)]
    assert state.prefix_cache is not None
    # "a" finished: its unshared block lost nothing (it had no key) and went to the tail;
    # the shared block 0 stays with "b".
    assert state.prefix_cache.free_queue[-1] == 1
    state = spec.abort_request(state, "b")[0]
    assert spec_pool_violations(state) == []
    assert state.prefix_cache is not None and state.prefix_cache.cached == ()
    state = spec.add_request(state, "c", (1, 2, 3, 4, 7), PARAMS)
    state, plan = spec.step(state, HashOracle(8))
    assert plan.scheduled[0].start == 0  # the freed block kept no key (drop-key-on-free)
    assert spec.state_violations(state) == ()
