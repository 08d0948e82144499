"""Per-step cost independent of the waiting queue: lazy arrivals change no decision,
and the plot's cheap samples equal what ``observe()`` would have said.

``kvsched run`` and ``conform`` admit arrivals lazily (``kvsched.drive.Arrivals``)
under the policies that serve the stored order: the waiting requests behind the
few a step can read (``admission_window``) stay outside the engine. These tests drive the same
workloads eagerly and lazily and require the same run: outcomes (outputs, finish
reasons, refusals with their messages), steps, preemptions, engine metrics, and the
same KV timeline but for the waiting count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impl import LLMEngine
from kvsched.drive import Arrivals, admission_window, drive, head_blocks_needed
from kvsched.peers.lockstep import run_workload as lockstep_run
from kvsched.peers.ours import SchedulerAdapter
from kvsched.results import StepSample
from kvsched.workload import WorkloadRequest
from model import LlamaForCausalLM, build_tiny_model
from spec.oracle import HashOracle
from spec.policies import POLICIES, stored_order
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, SchedulerState, StepPlan

MODEL = build_tiny_model(seed=0)
STORED_ORDER = sorted(name for name, p in POLICIES.items() if p.order_waiting is stored_order)


def _request(i: int, rid: str, prompt_len: int, max_tokens: int, arrival: int) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=rid,
        prompt=tuple((7 * i + j) % 250 + 1 for j in range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_step=arrival,
        line=i + 1,
    )


@st.composite
def workloads(draw: st.DrawFn) -> list[WorkloadRequest]:
    """Up to 14 requests, ids drawn from a few names (duplicates, live and finished),
    some too long for the cache or empty (refused), arriving over a few steps."""
    n = draw(st.integers(1, 14))
    return [
        _request(
            i,
            draw(st.sampled_from(["a", "b", "c", f"u{i}", f"v{i}"])),
            draw(st.integers(0, 14)),
            draw(st.integers(1, 9)),
            draw(st.integers(0, 6)),
        )
        for i in range(n)
    ]


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    mode = draw(st.sampled_from(list(PreemptionMode)))
    return SchedulerConfig(
        num_gpu_blocks=draw(st.integers(3, 12)),
        block_size=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(4, 24)),
        max_num_seqs=draw(st.integers(1, 4)),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=mode,
        num_cpu_blocks=draw(st.integers(0, 6)) if mode is PreemptionMode.SWAP else 0,
        policy=draw(st.sampled_from(STORED_ORDER)),
        enable_prefix_caching=mode is not PreemptionMode.SWAP and draw(st.booleans()),
    )


def _engine(config: SchedulerConfig, model: LlamaForCausalLM = MODEL) -> LLMEngine:
    return LLMEngine(config, model=model, threads=1)


def _without_waiting(timeline: list[StepSample]) -> list[StepSample]:
    return [dataclasses.replace(s, num_waiting=0) for s in timeline]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), config=configs())
def test_lazy_arrivals_change_no_decision(
    workload: list[WorkloadRequest], config: SchedulerConfig
) -> None:
    window = admission_window(config)
    assert window is not None
    eager_engine, lazy_engine = _engine(config), _engine(config)
    eager = drive(eager_engine, workload, record_timeline=True)
    lazy = drive(lazy_engine, workload, record_timeline=True, window=window)
    assert lazy.outcomes == eager.outcomes
    assert (lazy.steps, lazy.preemptions_by_mode, lazy.tokens_sampled) == (
        eager.steps,
        eager.preemptions_by_mode,
        eager.tokens_sampled,
    )
    assert lazy_engine.metrics.kv_utilization == eager_engine.metrics.kv_utilization
    assert dataclasses.replace(lazy_engine.metrics, step_time_s=0) == dataclasses.replace(
        eager_engine.metrics, step_time_s=0
    )
    assert _without_waiting(lazy.timeline) == _without_waiting(eager.timeline)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), config=configs())
def test_lazy_arrivals_in_lockstep(
    workload: list[WorkloadRequest], config: SchedulerConfig
) -> None:
    """``conform``'s lockstep, spec and engine scheduler: the same verdict and counts."""
    oracle = HashOracle(vocab_size=16)
    eager = lockstep_run(SchedulerAdapter(config), config, workload, oracle)
    lazy = lockstep_run(
        SchedulerAdapter(config), config, workload, oracle, window=admission_window(config)
    )
    assert eager.ok, eager.divergence
    assert lazy == eager


def test_the_waiting_queue_stays_short() -> None:
    """200 requests at once, two seats: the engine never holds them all."""
    config = SchedulerConfig(num_gpu_blocks=8, block_size=4, max_num_seqs=2)
    workload = [_request(i, f"r{i}", 6, 3, 0) for i in range(200)]
    window = admission_window(config)
    assert window is not None
    lazy = drive(_engine(config), workload, record_timeline=True, window=window)
    assert all(o.finish_reason == "length" for o in lazy.outcomes)
    # At most what a step reads (2 seats, so 3) plus the victims put back (2 at most).
    assert max(s.num_waiting for s in lazy.timeline) <= 3 + config.max_num_seqs


def test_a_policy_that_reorders_is_eager() -> None:
    assert admission_window(SchedulerConfig(num_gpu_blocks=4, policy="priority")) is None


def test_arrivals_hand_out_duplicates_as_they_arrive() -> None:
    """An id held back is released (with all held before it) when its duplicate
    arrives; an id live in the engine is handed out at once, to be refused."""
    workload = [
        _request(0, "a", 2, 2, 0),
        _request(1, "b", 2, 2, 0),
        _request(2, "c", 2, 2, 0),
        _request(3, "c", 2, 2, 1),  # c is held: b and c go first, then this c
        _request(4, "a", 2, 2, 1),  # a is live in the engine: at once
        _request(5, "d", 2, 2, 1),  # held
    ]
    waiting = [0]  # the engine's waiting queue, as the caller's adds fill it
    arrivals = Arrivals(workload, room=lambda: 1 - waiting[0])

    def due(step: int) -> list[str]:
        out = []
        for i in arrivals.due(step):
            out.append(workload[i].request_id)
            if i not in (3, 4):  # the duplicates are refused
                arrivals.accepted(i)
                waiting[0] += 1
        return out

    assert due(0) == ["a"]  # the window holds one
    assert due(1) == ["b", "c", "c", "a"]
    assert not arrivals.exhausted
    waiting[0] = 0  # all admitted
    assert due(2) == ["d"]
    assert arrivals.exhausted


def _observed_sample(state: SchedulerState, plan: StepPlan) -> StepSample:
    """The sample as computed from the whole observed state (what ``drive`` used to do)."""
    config = state.config
    head = None
    if state.waiting and state.num_free_gpu_blocks:
        order = POLICIES[config.policy].order_waiting
        head = head_blocks_needed(config, order(state.waiting)[0].num_tokens)
    return StepSample(
        step=plan.step,
        gpu_blocks_used=config.num_gpu_blocks - state.num_free_gpu_blocks,
        num_running=len(state.running),
        num_waiting=len(state.waiting),
        num_swapped=len(state.swapped),
        num_preempted=len(plan.preempted),
        preempted_modes=tuple(str(p.mode) for p in plan.preempted),
        head_blocks_needed=head,
    )


class _Observing(LLMEngine):
    """An engine that also records the observed sample after each step."""

    observed: list[StepSample]

    def step(self) -> StepPlan:
        plan = super().step()
        self.observed.append(_observed_sample(self.observe(), plan))
        return plan


@pytest.fixture
def observing() -> Iterator[type[_Observing]]:
    _Observing.observed = []
    yield _Observing


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_seqs=3, policy="priority"),
        SchedulerConfig(num_gpu_blocks=6, block_size=2, enable_prefix_caching=True),
        SchedulerConfig(
            num_gpu_blocks=5,
            block_size=2,
            preemption_mode=PreemptionMode.SWAP,
            num_cpu_blocks=4,
            enable_chunked_prefill=False,
            max_num_batched_tokens=16,
        ),
    ],
    ids=["priority", "prefix-caching", "swap-unchunked"],
)
def test_cheap_samples_equal_observed_ones(
    config: SchedulerConfig, observing: type[_Observing]
) -> None:
    workload = [
        dataclasses.replace(
            _request(i, f"r{i}", 3 + i % 5, 4 + i % 3, i // 2),
            params=SamplingParams(max_tokens=4 + i % 3, ignore_eos=True, priority=i % 3),
        )
        for i in range(10)
    ]
    engine = observing(config, model=MODEL, threads=1)
    result = drive(engine, workload, record_timeline=True, window=admission_window(config))
    assert result.preemptions > 0
    assert any(s.head_blocks_needed for s in result.timeline)
    assert result.timeline == engine.observed
