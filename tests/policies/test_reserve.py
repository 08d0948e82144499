"""``reserve``: its gate on both sides, in hand-built scenarios and against each other."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import spec
from impl.policies import RESERVE_HORIZON as ENGINE_HORIZON
from impl.policies import ReservePolicy
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence
from spec.policies import RESERVE_HORIZON, decode_peak_blocks, peak_blocks, reserve_admit
from spec.types import (
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)
from tests.drain import drain_within, workload_bound
from tests.policies import workloads

TOKEN = 7  # never an EOS: every request runs to max_tokens


def config(
    num_gpu_blocks: int = 4,
    policy: str = "reserve",
    mode: PreemptionMode = PreemptionMode.RECOMPUTE,
    num_cpu_blocks: int = 0,
) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=4,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        num_cpu_blocks=num_cpu_blocks,
        policy=policy,
    )


def request_state(
    rid: str, prompt_len: int, max_tokens: int, outputs: int = 0, arrival: int = 0
) -> RequestState:
    request = Request(
        request_id=rid,
        prompt_token_ids=(1,) * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        arrival=arrival,
    )
    return RequestState(request=request, output_token_ids=(TOKEN,) * outputs)


def sequence(rid: str, prompt_len: int, max_tokens: int, outputs: int = 0) -> Sequence:
    state = request_state(rid, prompt_len, max_tokens)
    seq = Sequence(state.request)
    for _ in range(outputs):
        seq.token_ids.append(TOKEN)
        seq.num_tokens += 1
    return seq


# --- the estimate -----------------------------------------------------------------------


def test_decode_peak_by_hand() -> None:
    """bs 4. A: 4 tokens, 9 to sample; B: 4 tokens, 7 to sample.

    U(k) = sum over b >= k of cdiv(num_tokens + k - 1, 4):
    U(7) = cdiv(10, 4) + cdiv(10, 4) = 6 (both live); U(9) = cdiv(12, 4) = 3 (A alone).
    """
    a = request_state("a", 4, 9)
    b = request_state("b", 4, 7)
    assert peak_blocks(a, 4) == 3 and peak_blocks(b, 4) == 3
    assert decode_peak_blocks((a,), 4, 64) == 3
    assert decode_peak_blocks((a, b), 4, 64) == 6
    # A with 8 outputs has one token to sample: its peak (3) comes before B's.
    a8 = request_state("a", 4, 9, outputs=8)
    assert decode_peak_blocks((a8, b), 4, 64) == 4  # U(1) = cdiv(12, 4) + cdiv(4, 4)
    assert decode_peak_blocks((), 4, 64) == 0
    # A horizon of 2 steps only looks at U(1) and U(2) = cdiv(5, 4) + cdiv(5, 4) = 4.
    assert decode_peak_blocks((a, b), 4, 2) == 4


def test_both_sides_look_equally_far_ahead() -> None:
    assert RESERVE_HORIZON == ENGINE_HORIZON == 64


requests = st.builds(
    request_state,
    rid=st.just("r"),
    prompt_len=st.integers(1, 40),
    max_tokens=st.integers(1, 40),
    outputs=st.just(0),
).flatmap(
    lambda r: st.integers(0, r.request.params.max_tokens - 1).map(
        lambda o: replace(r, output_token_ids=(TOKEN,) * o)
    )
)


@given(
    st.lists(requests, min_size=1, max_size=8),
    st.sampled_from((1, 2, 3, 4, 16)),
    st.integers(1, 50) | st.just(RESERVE_HORIZON),
)
def test_engine_peak_equals_spec_peak(
    states: list[RequestState], block_size: int, horizon: int
) -> None:
    """The engine's O(n log n) evaluation against the spec's definition, and its bounds."""
    peak = decode_peak_blocks(tuple(states), block_size, horizon)
    policy = ReservePolicy()
    policy.bind(SchedulerConfig(num_gpu_blocks=1, block_size=block_size, policy="reserve"))
    seqs = []
    for s in states:
        seq = Sequence(s.request)
        seq.token_ids.extend(s.output_token_ids)
        seq.num_tokens = len(seq.token_ids)
        seqs.append(seq)
    assert policy.decode_peak(seqs, horizon) == peak
    assert sum(spec.cdiv(s.num_tokens, block_size) for s in states) <= peak
    assert peak <= sum(peak_blocks(s, block_size) for s in states)
    if horizon >= 40:  # every request ends within the horizon: its whole peak counts
        assert max(peak_blocks(s, block_size) for s in states) <= peak


# --- the gate, spec side ------------------------------------------------------------------


def mid_state(cfg: SchedulerConfig, running: tuple[RequestState, ...], free: int) -> SchedulerState:
    return SchedulerState(
        config=cfg, num_free_gpu_blocks=free, num_free_cpu_blocks=0, running=running
    )


def test_gate_admits_what_fits_and_refuses_what_does_not() -> None:
    cfg = config(num_gpu_blocks=6)
    a = replace(request_state("a", 4, 9), num_computed_tokens=4)
    b = request_state("b", 4, 7)
    # decode_peak(a, b) = 6 <= 6 blocks: admitted.
    assert reserve_admit(mid_state(cfg, (a,), free=5), b, 4)
    # With 5 blocks it does not fit, however many are free right now.
    assert not reserve_admit(mid_state(replace(cfg, num_gpu_blocks=5), (a,), free=4), b, 4)


def test_gate_never_refuses_an_empty_running() -> None:
    cfg = config(num_gpu_blocks=1)
    huge = request_state("huge", 100, 100)  # could never fit: the gate still admits
    assert reserve_admit(mid_state(cfg, (), free=1), huge, 1)


# --- a whole scenario, spec and engine side by side ---------------------------------------

#: 4 blocks of 4 tokens. A (P 4, M 9) peaks at 3 blocks; B (P 4, M 7) at 3 blocks.
SCENARIO = (("a", 4, 9), ("b", 4, 7))


def run_spec(cfg: SchedulerConfig) -> list[StepPlan]:
    state = spec.init_state(cfg)
    for rid, prompt_len, max_tokens in SCENARIO:
        state = spec.add_request(
            state, rid, (1,) * prompt_len, SamplingParams(max_tokens=max_tokens)
        )
    plans = []
    bound = drain_within(state)
    while spec.has_unfinished_requests(state):
        bound.tick(state)
        state, plan = spec.step(state, lambda tokens: TOKEN)
        plans.append(plan)
    return plans


def run_engine(cfg: SchedulerConfig) -> list[StepPlan]:
    scheduler = Scheduler(cfg)
    for rid, prompt_len, max_tokens in SCENARIO:
        scheduler.add_request(rid, (1,) * prompt_len, SamplingParams(max_tokens=max_tokens))

    def sample(out: SchedulerOutput) -> list[int]:
        return [TOKEN] * out.num_samples

    plans = []
    bound = drain_within(scheduler.observe())
    while scheduler.has_unfinished_requests():
        bound.tick(scheduler.observe)
        plans.append(scheduler.step(sample))
        scheduler.check_invariants()  # includes the policy's running-peak counter
    return plans


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.num_tokens) for c in plan.scheduled]


@pytest.mark.parametrize("run", [run_spec, run_engine], ids=["spec", "engine"])
def test_reserve_holds_b_back_until_a_is_in_its_last_step(run: object) -> None:
    """B waits while A and B together would peak above 4 blocks.

    The gate sees A with ``o`` outputs; together they peak at 6 blocks while both are
    live at B's end (o <= 2), then at ``3 + cdiv(4 + (9 - o) - 1, 4)`` blocks when A
    ends first: 6, 5, 5, 5, 5 for o = 3..7 and 4 for o = 8. So B is admitted in step 8,
    beside A's last decode, and nobody is ever preempted.
    """
    assert callable(run)
    plans: list[StepPlan] = run(config())
    assert all(not p.preempted for p in plans)
    assert chunks(plans[0]) == [("a", 0, 4)]
    for k in range(1, 8):
        assert chunks(plans[k]) == [("a", 3 + k, 1)]
    assert chunks(plans[8]) == [("a", 11, 1), ("b", 0, 4)]
    assert [f.request_id for f in plans[8].finished] == ["a"]
    assert len(plans) == 8 + 7  # B decodes alone after that


@pytest.mark.parametrize("run", [run_spec, run_engine], ids=["spec", "engine"])
def test_lifo_admits_both_and_preempts_b(run: object) -> None:
    assert callable(run)
    plans: list[StepPlan] = run(config(policy="lifo"))
    assert chunks(plans[0]) == [("a", 0, 4), ("b", 0, 4)]
    victims = [p.request_id for plan in plans for p in plan.preempted]
    assert victims and set(victims) == {"b"}


def test_spec_and_engine_make_the_same_plans() -> None:
    for mode in PreemptionMode:
        cfg = config(mode=mode, num_cpu_blocks=2)
        assert run_spec(cfg) == run_engine(cfg)


# --- the engine's counter ------------------------------------------------------------------


def test_fast_path_admits_without_looking_at_running() -> None:
    """When the peaks' sum fits, the gate admits in O(1) (``running`` is not read)."""
    policy = ReservePolicy()
    policy.bind(config(num_gpu_blocks=6))
    a = sequence("a", 4, 9)
    policy.on_run(a)
    assert policy.running_peak_blocks == 3
    poisoned: list[Sequence] = [a, None]  # type: ignore[list-item]  # would crash a scan
    assert policy.can_admit(sequence("b", 4, 7), 4, running=poisoned, num_free_blocks=5)
    # 5 blocks: the sum (6) does not fit, so the exact peak decides: 6 > 5, refused.
    policy.bind(config(num_gpu_blocks=5))
    assert not policy.can_admit(sequence("b", 4, 7), 4, running=[a], num_free_blocks=4)
    # A in its last step: the exact peak is 4 <= 5, admitted.
    a8 = sequence("a8", 4, 9, outputs=8)
    assert policy.can_admit(sequence("b", 4, 7), 4, running=[a8], num_free_blocks=4)
    policy.on_leave(a)
    assert policy.running_peak_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_counter_follows_every_way_in_and_out_of_running(mode: str) -> None:
    """Admit, swap-in, preempt, finish, abort and rollback keep the counter exact.

    Every step is first scheduled and rolled back (undoing its admissions, swap-ins
    and preemptions), then run for real; ``check_invariants`` compares the counter
    with the sum over ``running`` after each.
    """
    scheduler = Scheduler(workloads.config("reserve", mode))
    policy = scheduler.policy
    assert isinstance(policy, ReservePolicy)
    pending = sorted(workloads.REQUESTS, key=lambda r: r[3])

    def sample(out: SchedulerOutput) -> list[int]:
        return [TOKEN] * out.num_samples

    seen = {"preempted": 0, "swapped_in": 0, "admitted": 0, "rolled_back": 0}
    bound = workload_bound(
        scheduler.config,
        ((prompt, workloads.params(m, p)) for _, prompt, m, _, p in pending),
        last_arrival=pending[-1][3],
    )
    while pending or scheduler.has_unfinished_requests():
        bound.tick(scheduler.observe)
        while pending and pending[0][3] <= scheduler.num_steps:
            rid, prompt, max_tokens, _, priority = pending.pop(0)
            scheduler.add_request(rid, prompt, workloads.params(max_tokens, priority))
        out = scheduler.schedule()
        seen["rolled_back"] += bool(out.preempted or out.swapped_in or out.num_admitted)
        scheduler.rollback(out)
        scheduler.check_invariants()
        out = scheduler.schedule()
        seen["preempted"] += len(out.preempted)
        seen["swapped_in"] += len(out.swapped_in)
        seen["admitted"] += out.num_admitted
        scheduler.commit(out, sample(out))
        scheduler.check_invariants()
        if scheduler.num_steps == 6 and scheduler.running:  # abort a running request
            scheduler.abort_request(scheduler.running[-1].request_id)
            scheduler.check_invariants()
    assert policy.running_peak_blocks == 0
    assert seen["preempted"] > 0 and seen["admitted"] > 0 and seen["rolled_back"] > 0
    assert (seen["swapped_in"] > 0) == (mode == "swap")
