"""The transformers and tokenspeed profiles: their config constraints and rule functions
(docs/semantics.md, "transformers rules", "tokenspeed rules")."""

from __future__ import annotations

from fractions import Fraction

import pytest

import spec
from spec.oracle import HashOracle
from spec.profiles import (
    SAFETY_MARGIN,
    admission_frozen_after,
    generation_blocks,
    in_safety_margin,
    interleave_offloaded,
    num_offloaded,
    num_storable,
    single_prefill_violations,
    submission_order,
    too_large,
)
from spec.types import (
    ConfigError,
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    Semantics,
)

TF = Semantics.TRANSFORMERS
TS = Semantics.TOKENSPEED


def state_of(
    rid: str, arrival: int = 0, *, decoding: bool = False, max_tokens: int = 4
) -> RequestState:
    request = Request(
        request_id=rid,
        prompt_token_ids=(1, 2, 3),
        params=SamplingParams(max_tokens=max_tokens),
        arrival=arrival,
    )
    return RequestState(request=request, decoding=decoding)


@pytest.mark.parametrize(
    ("semantics", "fields", "message"),
    [
        (TF, {"enable_chunked_prefill": False}, "always chunked"),
        (TF, {"preemption_mode": PreemptionMode.RESTART}, "soft reset"),
        (TF, {"policy": "priority"}, "lifo only"),
        (TF, {"enable_prefix_caching": True}, "not modelled"),
        (TF, {"block_size": 2}, ">= 4"),
        (TS, {"preemption_mode": PreemptionMode.SWAP, "num_cpu_blocks": 4}, "no preemption"),
        (TS, {"policy": "priority"}, "lifo only"),
        (TS, {"enable_chunked_prefill": False}, "always chunked"),
        (TS, {"enable_prefix_caching": True}, "not modelled"),
        (TS, {"num_gpu_blocks": 257, "block_size": 16}, "4097 tokens"),
    ],
)
def test_config_constraints(semantics: Semantics, fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"num_gpu_blocks": 8, "block_size": 4, "semantics": semantics}
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_swap_is_the_cpu_offload() -> None:
    SchedulerConfig(
        num_gpu_blocks=8,
        block_size=4,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=4,
        semantics=TF,
    )


def test_the_safety_margin_is_the_exact_fraction() -> None:
    """``free / total >= 0.15`` in floats, as transformers compares, for every pool here."""
    assert Fraction(3, 20) == SAFETY_MARGIN
    for total in range(1, 300):
        config = SchedulerConfig(num_gpu_blocks=total, block_size=4, semantics=TF)
        for free in range(total + 1):
            assert in_safety_margin(config, free) == (free / total >= 0.15), (free, total)


def test_offloaded_and_fresh_alternate_offloaded_first() -> None:
    s = (state_of("s0"), state_of("s1"), state_of("s2"))
    w = (state_of("w0"),)
    assert [r.request_id for r in interleave_offloaded(s, w)] == ["s0", "w0", "s1", "s2"]


def test_offload_takes_the_newest_starved_until_the_rest_fit_or_one_runs() -> None:
    assert num_storable([1, 2, 1], 3) == 2
    # Three starved holding 2 blocks each, each lacking 1, nothing free: freeing the
    # newest lets the oldest fit, and then the second (2 free, 2 needed).
    assert num_offloaded([1, 1, 1], [2, 2, 2], 0, 3) == 1
    assert num_offloaded([3, 3], [1, 1], 0, 2) == 1  # one request must be left running
    assert num_offloaded([1], [1], 1, 2) == 0  # it fits: nothing to offload


def test_admission_freezes_on_an_offload_until_a_finish() -> None:
    assert admission_frozen_after(False, True, False)
    assert not admission_frozen_after(True, True, True)  # the finish comes at the step's end
    assert admission_frozen_after(True, False, False)


def test_tokenspeed_reserves_and_refuses_by_its_whole_generation() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=4, semantics=TS)
    assert generation_blocks(config, state_of("a", max_tokens=4)) == 2  # 3 + 4 tokens
    assert not too_large(config, 31, 1) and too_large(config, 32, 1)
    kvsched = SchedulerConfig(num_gpu_blocks=8, block_size=4)
    assert not too_large(kvsched, 32, 1)  # P + M - 1 = 32 tokens fit 8 blocks of 4


def test_submission_order_is_arrival_order() -> None:
    running = (state_of("b", arrival=2), state_of("a", arrival=0), state_of("c", arrival=1))
    assert [r.request_id for r in submission_order(running)] == ["a", "c", "b"]


def test_at_most_one_request_is_mid_prefill() -> None:
    tf = SchedulerConfig(num_gpu_blocks=8, block_size=4, semantics=TF)
    newest = (state_of("a", decoding=True), state_of("b"))
    assert single_prefill_violations(tf, newest) == []
    assert single_prefill_violations(tf, newest[::-1])
    assert single_prefill_violations(tf, (state_of("a"), state_of("b")))
    assert single_prefill_violations(SchedulerConfig(num_gpu_blocks=8), newest[::-1]) == []


@pytest.mark.parametrize("semantics", [TF, TS])
def test_spec_runs_keep_every_invariant(semantics: Semantics) -> None:
    """A contended run under the profile: offloads (transformers), skipped admissions
    (tokenspeed); every state and step valid, and it drains."""
    config = SchedulerConfig(
        num_gpu_blocks=6, block_size=4, max_num_batched_tokens=8, semantics=semantics
    )
    state = spec.init_state(config)
    for k, n in enumerate((8, 6, 10, 3)):
        params = SamplingParams(max_tokens=8 if k < 2 else 6, ignore_eos=True)
        state = spec.add_request(state, f"r{k}", tuple(range(100 * k, 100 * k + n)), params)
    preempted = 0
    while spec.has_unfinished_requests(state):
        before = state
        state, plan = spec.step(state, HashOracle(vocab_size=8))
        assert spec.state_violations(state) == ()
        assert spec.plan_violations(before, plan, state) == ()
        preempted += len(plan.preempted)
        assert state.num_steps < 200
    assert preempted > 0 if semantics is TF else preempted == 0
