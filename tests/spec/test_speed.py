"""How fast the spec steps with 64 running requests (a print, not an assertion).

Decode-only steady state: 64 requests with long ``max_tokens`` in a pool big enough
that nobody is preempted. Run with ``-rP`` to see the figure.
"""

from __future__ import annotations

import time

from spec import (
    ConstantOracle,
    SamplingParams,
    add_request,
    complete_step,
    init_state,
    sampling_request_ids,
    schedule,
    step,
)
from tests.spec.helpers import config, prompt

NUM_REQUESTS = 64
STEPS = 300


def test_spec_steps_per_second_with_64_running() -> None:
    cfg = config(64 * 128, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)
    state = init_state(cfg)
    for i in range(NUM_REQUESTS):
        state = add_request(state, f"req{i}", prompt(32, i), SamplingParams(max_tokens=2_000))
    oracle = ConstantOracle(7)
    state, plan = step(state, oracle)  # all 64 prefill in one step
    assert len(state.running) == NUM_REQUESTS and len(plan.sampled) == NUM_REQUESTS

    start = time.perf_counter()
    for _ in range(STEPS):
        state, plan = step(state, oracle)
    oracle_rate = STEPS / (time.perf_counter() - start)

    start = time.perf_counter()
    for _ in range(STEPS):
        mid, plan = schedule(state)
        tokens = dict.fromkeys(sampling_request_ids(mid, plan), 7)
        state, plan = complete_step(mid, plan, tokens)
    explicit_rate = STEPS / (time.perf_counter() - start)

    assert len(plan.scheduled) == NUM_REQUESTS and not plan.preempted
    print(
        f"\nspec, {NUM_REQUESTS} running (decode): {oracle_rate:,.0f} steps/s with an oracle, "
        f"{explicit_rate:,.0f} steps/s with explicit tokens "
        f"({1e6 / explicit_rate / NUM_REQUESTS:.1f} us per request-step)"
    )
