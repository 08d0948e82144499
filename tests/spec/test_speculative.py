"""vllm-v1/spec-*: speculative decoding in the spec (spec.speculative, docs/semantics.md).

Each rule on a small hand-built run, every step checked against ``state_violations``
and ``plan_violations``; then the exact oracle of speculative decoding: with a greedy
model, a run with drafts (whatever they are) gives every request the tokens of the
run without them, and drains within the LIFO bound from every state.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import spec
from spec import (
    ConfigError,
    HashOracle,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOracle,
)
from spec.oracle import ConstantOracle, Drafter, OracleDrafter, PromptLookupDrafter
from spec.speculative import PAD, verify
from spec.types import Semantics

ORACLE = HashOracle(vocab_size=8)


def vconfig(**fields: int | bool) -> SchedulerConfig:
    values: dict[str, int | bool] = {
        "num_gpu_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "num_speculative_tokens": 3,
        **fields,
    }
    return SchedulerConfig(semantics=Semantics.VLLM_V1, **values)  # type: ignore[arg-type]


def params(max_tokens: int, eos: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, eos_token_id=eos, ignore_eos=eos is None)


def checked(
    state: SchedulerState, drafter: Drafter, oracle: TokenOracle = ORACLE
) -> tuple[SchedulerState, StepPlan]:
    after, plan = spec.step(state, oracle, drafter)
    problems = spec.state_violations(after) + spec.plan_violations(state, plan, after)
    assert not problems, problems
    return after, plan


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.num_tokens) for c in plan.scheduled]


def running(state: SchedulerState, request_id: str) -> spec.RequestState:
    return next(r for r in state.running if r.request_id == request_id)


def test_verify_accepts_the_longest_agreeing_prefix_then_one_more() -> None:
    context = (1, 2, 3)
    right = [ORACLE(context)]
    right.append(ORACLE((*context, *right)))
    assert verify(context, (*right, 99), ORACLE) == (*right, ORACLE((*context, *right)))
    assert verify(context, (99, *right), ORACLE) == (ORACLE(context),)
    assert verify(context, (PAD, PAD), ORACLE) == (ORACLE(context),)


@pytest.mark.parametrize(("first_wrong", "rejected"), [(3, 0), (1, 2), (0, 3)])
def test_a_verify_step_rolls_back_the_rejected_drafts_and_keeps_their_blocks(
    first_wrong: int, rejected: int
) -> None:
    """vllm-v1/spec-verify, -rejected-blocks-kept: the prefill samples, drafts follow;
    the verify chunk runs 1 + 3 tokens from position 3 (blocks for 7 tokens), and
    ``computed`` ends at 7 less the rejected drafts, with the blocks kept."""
    drafter = OracleDrafter(ORACLE, 3, first_wrong)
    state = spec.add_request(spec.init_state(vconfig()), "r0", (1, 2, 3), params(9))
    state, plan = checked(state, drafter)
    assert running(state, "r0").spec_token_ids == drafter((1, 2, 3, *plan.sampled_token_ids))
    state, plan = checked(state, drafter)
    assert chunks(plan) == [("r0", 3, 4)]
    r0 = running(state, "r0")
    assert len(plan.sampled) == 4 - rejected
    assert r0.num_computed_tokens == 7 - rejected
    assert spec.blocks_owned(state, "r0") == (2, 0)  # cdiv(7, 4): the drafts' blocks stay
    assert r0.num_blocks_ahead == 2 - -(-r0.num_computed_tokens // 4)


def test_a_chunk_cut_by_the_budget_drops_drafts_from_the_end() -> None:
    """vllm-v1/spec-drafts-scheduled: r1's decode gets the 2 tokens r0's 1 + 3 left of
    a 6-token budget, so it runs its first draft only."""
    drafter = OracleDrafter(ORACLE, 3, 3)
    state = spec.init_state(vconfig(max_num_batched_tokens=6))
    state = spec.add_request(state, "r0", (1, 2), params(5))
    state = spec.add_request(state, "r1", (3, 4), params(5))
    state, _ = checked(state, drafter)
    state, plan = checked(state, drafter)
    assert chunks(plan) == [("r0", 2, 4), ("r1", 2, 2)]
    assert plan.sampled_ids.count("r1") == 2  # one draft, then the bonus


def test_a_one_token_admission_is_padded_or_not_admitted() -> None:
    """vllm-v1/spec-padded-new-decode: r1's one-token prompt joins r0's decode padded
    to 1 + 3 tokens (its pads rejected); with a budget that leaves it fewer than 4
    tokens it waits, though one token would fit."""
    drafter = OracleDrafter(ORACLE, 3, 1)
    for budget, admitted in ((16, True), (6, False)):
        state = spec.init_state(vconfig(max_num_batched_tokens=budget))
        state = spec.add_request(state, "r0", (1, 2, 3), params(4))
        state, _ = checked(state, drafter)
        state = spec.add_request(state, "r1", (7,), params(3))
        state, plan = checked(state, drafter)
        assert (("r1", 0, 4) in chunks(plan)) is admitted, chunks(plan)
        if admitted:
            assert plan.sampled_ids.count("r1") == 1
            assert running(state, "r1").num_computed_tokens == 1


@pytest.mark.parametrize(
    ("eos", "max_tokens", "outputs", "reason"),
    [(None, 3, 3, "length"), ("third", 9, 3, "stop")],
)
def test_a_stop_inside_an_accepted_run_drops_the_rest(
    eos: str | None, max_tokens: int, outputs: int, reason: str
) -> None:
    """R10 token by token (vllm-v1/spec-verify): the drafts are scheduled whatever
    max_tokens leaves, and the run is cut after the token that stops the request."""
    drafter = OracleDrafter(ORACLE, 3, 3)
    prompt = (1, 2, 3)
    first = ORACLE(prompt)
    run = verify((*prompt, first), drafter((*prompt, first)), ORACLE)
    eos_token = run[1] if eos == "third" else None
    if eos_token is not None:
        assert eos_token not in (first, run[0])  # the oracle's run for this prompt
    state = spec.add_request(
        spec.init_state(vconfig()), "r0", prompt, params(max_tokens, eos=eos_token)
    )
    state, _ = checked(state, drafter)
    state, plan = checked(state, drafter)
    assert chunks(plan) == [("r0", 3, 4)]
    (done,) = plan.finished
    assert done.output_token_ids == (first, *run)[:outputs]
    assert done.finish_reason.value == reason
    assert state.num_free_gpu_blocks == 16


def test_max_model_len_caps_a_chunk_with_drafts() -> None:
    """vllm-v1/spec-drafts-scheduled: a chunk ends at max_model_len - 1; the request
    stops by length at max_model_len tokens."""
    drafter = OracleDrafter(ORACLE, 3, 3)
    state = spec.add_request(spec.init_state(vconfig(max_model_len=9)), "r0", (1, 2, 3), params(20))
    plans = []
    while spec.has_unfinished_requests(state):
        state, plan = checked(state, drafter)
        plans.append(plan)
    assert all(c.start + c.num_tokens <= 8 for p in plans for c in p.scheduled)
    (done,) = plans[-1].finished
    assert len(done.output_token_ids) == 9 - 3 and done.finish_reason.value == "length"


def test_a_request_mid_prefill_gets_no_drafts() -> None:
    """vllm-v1/spec-propose: a chunk that ends mid-prefill samples nothing and gets no
    drafts; once it samples it does."""
    drafter = OracleDrafter(ORACLE, 3, 3)
    state = spec.add_request(
        spec.init_state(vconfig(max_num_batched_tokens=4, max_num_seqs=2)),
        "r0",
        (1, 2, 3, 4, 5, 6),
        params(4),
    )
    state, plan = checked(state, drafter)
    assert chunks(plan) == [("r0", 0, 4)] and running(state, "r0").spec_token_ids == ()
    state, plan = checked(state, drafter)
    assert running(state, "r0").spec_token_ids != ()


def test_a_victim_drops_its_drafts_and_their_blocks() -> None:
    """R6 with drafts: r0's verify chunk needs the blocks r1 holds; r1 is preempted
    with its drafts, and comes back holding none."""
    drafter = OracleDrafter(ORACLE, 3, 1)
    state = spec.init_state(vconfig(num_gpu_blocks=5, block_size=2, max_model_len=10))
    state = spec.add_request(state, "r0", (1, 2, 3), params(5))
    state = spec.add_request(state, "r1", (4, 5), params(5))
    state, _ = checked(state, drafter)
    state, plan = checked(state, drafter)
    assert [p.request_id for p in plan.preempted] == ["r1"]
    (r1,) = state.waiting
    assert r1.spec_token_ids == () and r1.num_blocks_ahead == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"async_scheduling": True},
        {"long_prefill_token_threshold": 3},
        {"num_speculative_tokens": -1},
    ],
)
def test_configs_the_profile_refuses(fields: dict[str, int | bool]) -> None:
    with pytest.raises(ConfigError):
        vconfig(**fields)


def test_a_budget_below_a_padded_decode_is_refused() -> None:
    """vllm-v1/spec-padded-new-decode: a padded one-token admission (1 + 3 tokens) could
    never fit a budget of 3, and admission would stop at it every step (vLLM 0.32 never
    drains: tests/peers/test_vllm_engine_order.py); a budget of 1 + 3 is accepted."""
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(3\) below 1 \+ num_spec"):
        vconfig(max_num_batched_tokens=3, max_num_seqs=2)
    for budget, drafts in ((4, 3), (1, 0)):  # 1 + K, and any budget without drafts
        config = vconfig(
            max_num_batched_tokens=budget, max_num_seqs=1, num_speculative_tokens=drafts
        )
        assert config.max_num_batched_tokens == budget


def test_speculative_decoding_is_a_vllm_v1_setting() -> None:
    with pytest.raises(ConfigError, match="vllm-v1 setting"):
        SchedulerConfig(num_gpu_blocks=4, num_speculative_tokens=2)


def _run(
    state: SchedulerState, drafter: Drafter | None, oracle: TokenOracle
) -> dict[str, tuple[int, ...]]:
    """Drain ``state``, each state's LIFO drain bound held from it on; every output."""
    outputs: dict[str, tuple[int, ...]] = {}
    bounds: list[tuple[int, int]] = []
    steps = 0
    while spec.has_unfinished_requests(state):
        bounds.append((steps, spec.drain_step_bound(state)))
        state, plan = checked(state, drafter or (lambda tokens: ()), oracle)
        steps += 1
        outputs.update((f.request_id, f.output_token_ids) for f in plan.finished)
        over = [(at, bound) for at, bound in bounds if steps - at > bound]
        assert not over, f"drain past the bound from step(s) {over}"
    return outputs


@pytest.mark.parametrize("seed", range(30))
def test_greedy_outputs_with_drafts_equal_those_without(seed: int) -> None:
    """The exact oracle of speculative decoding: with a greedy model every request's
    outputs are those of the run without drafts, whatever the drafter proposes (prompt
    lookup, or drafts right up to a random point), on small pools that preempt, with
    prefix caching on or off."""
    rng = random.Random(seed)
    oracle = HashOracle(vocab_size=rng.choice((3, 8, 50)), salt=seed)
    k = rng.randint(1, 4)
    base = vconfig(
        num_gpu_blocks=rng.randint(6, 16),
        block_size=rng.choice((1, 2, 4)),
        max_num_batched_tokens=rng.randint(8, 24),
        max_num_seqs=rng.randint(1, 4),
        enable_prefix_caching=rng.random() < 0.5,
        num_speculative_tokens=0,
    )
    capacity = base.num_gpu_blocks * base.block_size
    state = spec.init_state(base)
    drafted = spec.init_state(replace(base, num_speculative_tokens=k))
    for i in range(rng.randint(1, 5)):
        length = rng.randint(1, 6)
        prompt = tuple(rng.choice((1, 2, 3)) for _ in range(length))
        max_tokens = rng.randint(1, max(1, min(12, capacity - length - 1)))
        request_params = params(max_tokens, eos=rng.choice((None, None, 0)))
        state = spec.add_request(state, f"r{i}", prompt, request_params)
        drafted = spec.add_request(drafted, f"r{i}", prompt, request_params)
    drafter: Drafter
    if rng.random() < 0.5:
        drafter = PromptLookupDrafter(k, 1, 3, max_model_len=base.max_model_len)
    else:
        drafter = OracleDrafter(oracle, k, rng.randint(0, k))
    assert _run(drafted, drafter, oracle) == _run(state, None, oracle)


def test_drafts_from_a_constant_model_are_all_accepted() -> None:
    """A model that always samples 0 and a drafter that always proposes 0s: each verify
    step delivers 1 + K tokens."""
    drafter = PromptLookupDrafter(3, 1, 1)
    state = spec.add_request(spec.init_state(vconfig()), "r0", (0, 0, 0, 0), params(9))
    state, _ = checked(state, drafter, ConstantOracle(0))
    state, plan = checked(state, drafter, ConstantOracle(0))
    assert plan.sampled_token_ids == (0, 0, 0, 0)
