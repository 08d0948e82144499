"""Liveness of every registered policy: an empty engine always admits its next request.

A gate that refused when ``running`` is empty could leave the head of ``waiting``
there forever (nothing would ever free blocks or change the state). This is the rule
``reserve`` states in its docstring; here it is checked for every registered policy,
on the gate alone and on a whole scheduling step, on both sides.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import impl
import spec
from impl.scheduler import Scheduler
from impl.sequence import Sequence
from spec.types import (
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
)

POLICY_NAMES = sorted(spec.POLICIES)


@st.composite
def configs(draw: st.DrawFn, policy: str) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=draw(st.integers(1, 16)),
        block_size=draw(st.sampled_from((1, 2, 4, 16))),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(tuple(PreemptionMode))),
        policy=policy,
    )


@st.composite
def fitting_request(draw: st.DrawFn, cfg: SchedulerConfig, arrival: int) -> RequestState:
    """A request that fits alone (R4), with some outputs already (a re-admission)."""
    capacity = cfg.num_gpu_blocks * cfg.block_size
    if not cfg.enable_chunked_prefill:
        capacity = min(capacity, cfg.max_num_batched_tokens)
    prompt_len = draw(st.integers(1, capacity))
    max_tokens = draw(st.integers(1, capacity - prompt_len + 1))
    outputs = draw(st.integers(0, max_tokens - 1))
    request = Request(
        request_id=f"r{arrival}",
        prompt_token_ids=(1,) * prompt_len,
        params=SamplingParams(max_tokens=max_tokens, priority=draw(st.integers(0, 3))),
        arrival=arrival,
    )
    return RequestState(request=request, output_token_ids=(5,) * outputs)


def _sequence(state: RequestState) -> Sequence:
    seq = Sequence(state.request)
    seq.token_ids.extend(state.output_token_ids)
    seq.num_tokens = len(seq.token_ids)
    return seq


@pytest.mark.parametrize("policy", POLICY_NAMES)
@given(data=st.data())
def test_the_gate_never_refuses_an_empty_running(policy: str, data: st.DataObject) -> None:
    cfg = data.draw(configs(policy))
    candidate = data.draw(fitting_request(cfg, 0))
    num_tokens = data.draw(st.integers(1, candidate.num_tokens))
    state = SchedulerState(
        config=cfg, num_free_gpu_blocks=cfg.num_gpu_blocks, num_free_cpu_blocks=0
    )
    assert spec.get_policy(policy).can_admit(state, candidate, num_tokens)
    engine_policy = impl.make_policy(policy)
    engine_policy.bind(cfg)
    assert engine_policy.can_admit(
        _sequence(candidate), num_tokens, running=[], num_free_blocks=cfg.num_gpu_blocks
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
@given(data=st.data())
def test_an_empty_engine_admits_its_next_request(policy: str, data: st.DataObject) -> None:
    """Whatever is waiting, a step from an empty ``running`` schedules someone."""
    cfg = data.draw(configs(policy))
    waiting = [data.draw(fitting_request(cfg, i)) for i in range(data.draw(st.integers(1, 4)))]
    state = spec.init_state(cfg)
    scheduler = Scheduler(cfg)
    for r in waiting:
        prompt, params = r.request.prompt_token_ids, r.request.params
        state = spec.add_request(state, r.request_id, prompt, params)
        scheduler.add_request(r.request_id, prompt, params)
    _, plan = spec.schedule(state)
    assert plan.scheduled, f"{policy} admitted nobody into an empty engine"
    out = scheduler.schedule()
    assert out.num_admitted == len(plan.scheduled)
