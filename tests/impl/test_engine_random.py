"""Random workloads, configurations, aborts and injected faults on the real engine:
every request that is not aborted finishes with its solo outputs, every fault leaves
``observe()`` unchanged, and the pools are whole at the end."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from impl import LLMEngine
from impl.scheduler_output import SchedulerOutput
from model import LlamaForCausalLM
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig
from tests.drain import StepBound, workload_bound
from tests.impl.conftest import SoloFn


class Fault(RuntimeError):
    pass


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_engine_runs_match_solo_runs(
    seed: int, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3])
    config = SchedulerConfig(
        num_gpu_blocks=-(-14 // block_size) + rng.randint(0, 3),  # L <= 14 always fits
        block_size=block_size,
        max_num_batched_tokens=rng.randint(2, 16),
        max_num_seqs=rng.randint(2, 6),
        enable_chunked_prefill=rng.random() < 0.8,
        preemption_mode=rng.choice(list(PreemptionMode)),
        num_cpu_blocks=rng.choice([0, 3, 8, 32]),
        policy=rng.choice(["lifo", "priority", "fewest-outputs"]),
    )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < 14:
        config = dataclasses.replace(config, max_num_batched_tokens=14)
    engine = LLMEngine(config, model=model64)
    requests = []
    for i in range(rng.randint(4, 10)):
        prompt = [rng.randint(0, 255) for _ in range(rng.randint(1, 8))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 7),
            ignore_eos=rng.random() < 0.7,
            eos_token_id=rng.randint(0, 255),
            priority=rng.randint(0, 3),
            temperature=rng.choice([0.0, 0.0, 1.0]),
            seed=rng.randint(0, 99),
        )
        requests.append((f"q{i}", prompt, params))

    real_execute = engine.model_runner.execute
    real_swap_out = engine.cache_engine.swap_out
    real_swap_in = engine.cache_engine.swap_in

    def execute(out: SchedulerOutput) -> list[int]:
        if rng.random() < 0.15:
            if rng.random() < 0.5:
                real_execute(out)  # the fault strikes after the K/V writes
            raise Fault("forward")
        return real_execute(out)

    def swap_out(mapping: list[tuple[int, int]]) -> None:
        if rng.random() < 0.3:
            raise Fault("swap out")
        real_swap_out(mapping)

    def swap_in(mapping: list[tuple[int, int]]) -> None:
        if rng.random() < 0.3:
            raise Fault("swap in")
        real_swap_in(mapping)

    setattr(engine.model_runner, "execute", execute)  # noqa: B010
    setattr(engine.cache_engine, "swap_out", swap_out)  # noqa: B010
    setattr(engine.cache_engine, "swap_in", swap_in)  # noqa: B010

    pending = list(requests)
    finished = {}
    aborted = set()
    # Random arrivals (four in five steps add one more) and faults: four times the drain
    # of the whole workload, with every request arriving in its own step.
    arrivals = workload_bound(config, ((p, q) for _, p, q in requests), last_arrival=len(requests))
    bound = StepBound(4 * arrivals.bound)
    while pending or engine.has_unfinished_requests():
        bound.tick(engine.observe)
        while pending and rng.random() < 0.8:
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        state = engine.observe()
        live = [r.request_id for r in (*state.waiting, *state.running, *state.swapped)]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            aborted.add(engine.abort_request(victim).request_id)
            state = engine.observe()
        try:
            plan = engine.step()
        except Fault as fault:
            assert engine.observe() == state
            event(f"fault: {fault}")
        else:
            for f in plan.finished:
                finished[f.request_id] = f.output_token_ids
            for p in plan.preempted:
                event(f"preempted: {p.mode}")
        engine.scheduler.check_invariants()
    for rid, prompt, params in requests:
        if rid in aborted:
            continue
        assert finished[rid] == solo(prompt, params), (rid, config)
    end = engine.observe()
    assert end.num_free_gpu_blocks == config.num_gpu_blocks
    assert end.num_free_cpu_blocks == config.num_cpu_blocks
