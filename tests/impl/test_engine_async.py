"""The engine's async step (vllm-v1/async-*, impl/pipeline.py, impl/worker.py): outputs
equal to the synchronous engine's and to solo runs, and a step that fails with a step in
flight rolled back exactly."""

from __future__ import annotations

import random
import threading
from dataclasses import asdict
from typing import Any

import pytest

from impl import LLMEngine
from impl.scheduler_output import SchedulerOutput
from model import LlamaForCausalLM
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, Semantics
from tests.impl.conftest import SoloFn

Request = tuple[str, list[int], SamplingParams]


def vllm_config(rng: random.Random, *, async_scheduling: bool) -> SchedulerConfig:
    block_size = rng.choice((1, 2, 4, 8))
    return SchedulerConfig(
        num_gpu_blocks=max(4, rng.randint(16, 48) // block_size),
        block_size=block_size,
        max_num_batched_tokens=rng.randint(12, 48),
        max_num_seqs=rng.choice((2, 3, 4, 8)),
        semantics=Semantics.VLLM_V1,
        policy=rng.choice(("lifo", "priority")),
        enable_prefix_caching=rng.random() < 0.5,
        long_prefill_token_threshold=rng.choice((0, 0, 4)),
        async_scheduling=async_scheduling,
    )


def workload(rng: random.Random) -> list[Request]:
    shared = [rng.randrange(256) for _ in range(8)]
    return [
        (
            f"r{i}",
            (shared if rng.random() < 0.3 else [])
            + [rng.randrange(256) for _ in range(rng.randint(1, 10))],
            SamplingParams(
                max_tokens=rng.randint(1, 10),
                eos_token_id=rng.randrange(256),
                priority=rng.randint(0, 2),
                temperature=rng.choice((0.0, 0.0, 0.9)),
                seed=rng.randrange(1000),
            ),
        )
        for i in range(rng.randint(2, 9))
    ]


def drained(engine: LLMEngine, requests: list[Request]) -> list[FinishedRequest]:
    results = engine.generate(requests)
    while engine.has_unfinished_requests():  # a step may still be in flight
        engine.step()
    engine.scheduler.check_invariants()
    assert not engine.forwards
    return results


@pytest.mark.parametrize("seed", range(12))
def test_async_outputs_equal_sync_and_solo(
    seed: int, model64: LlamaForCausalLM, solo: SoloFn
) -> None:
    rng = random.Random(seed)
    config = vllm_config(rng, async_scheduling=True)
    requests = workload(rng)
    engine = LLMEngine(config, model=model64)
    async_results = drained(engine, requests)
    # Every applied token counted once; the outputs of requests gone are dropped.
    assert engine.metrics.generated_tokens == sum(len(r.output_token_ids) for r in async_results)
    sync_config = SchedulerConfig(**{**asdict(config), "async_scheduling": False})
    sync_results = drained(LLMEngine(sync_config, model=model64), requests)
    assert [(r.output_token_ids, r.finish_reason) for r in async_results] == [
        (r.output_token_ids, r.finish_reason) for r in sync_results
    ]
    for (_, prompt, params), result in zip(requests, async_results, strict=True):
        outputs = result.output_token_ids  # cut short by max_model_len where it is set
        assert outputs == solo(prompt, params)[: len(outputs)]


def test_the_forward_runs_in_the_worker_while_the_next_step_is_scheduled(
    model64: LlamaForCausalLM,
) -> None:
    """Step N's forward is still running when ``step()`` returns and N+1 is scheduled:
    the worker is held inside step 0's forward until step 1 has been scheduled."""
    config = SchedulerConfig(
        num_gpu_blocks=16, block_size=4, semantics=Semantics.VLLM_V1, async_scheduling=True
    )
    engine = LLMEngine(config, model=model64)
    release = threading.Event()
    threads: list[str] = []
    real = engine.model_runner.execute

    def execute(out: SchedulerOutput) -> list[int]:
        threads.append(threading.current_thread().name)
        if out.step == 0:
            assert release.wait(timeout=30)
        return real(out)

    engine.model_runner.execute = execute  # type: ignore[method-assign]
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    first = engine.step()  # schedules step 0, returns without its tokens
    assert first.scheduled_ids == ("a",) and not first.sampled_ids
    assert engine.scheduler.in_flight and not engine.forwards[0].done()
    release.set()
    second = engine.step()  # schedules step 1 on a's placeholder, applies step 0
    assert second.scheduled_ids == ("a",) and second.sampled_ids == ("a",)
    finished = [
        f for _ in range(10) if engine.has_unfinished_requests() for f in engine.step().finished
    ]
    alone = LLMEngine(SchedulerConfig(num_gpu_blocks=16, block_size=4), model=model64)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert finished == alone.generate([("a", [1, 2, 3], params)])
    assert threads and all(name.startswith("kvsched-forward") for name in threads)


class InjectedFault(RuntimeError):
    pass


def metrics_without_time(engine: LLMEngine) -> dict[str, Any]:
    values = asdict(engine.metrics)
    del values["step_time_s"]
    return values


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("after_kv_write", [False, True])
def test_a_failed_forward_in_flight_rolls_the_step_back(
    seed: int, after_kv_write: bool, model64: LlamaForCausalLM
) -> None:
    """Forward ``k`` fails (before or after writing K/V); the call that waits for it
    raises, leaving ``observe()`` and the metrics as they were before that call, with
    step ``k`` still in flight; the retry runs forward ``k`` again and every output is
    the fault-free run's."""
    rng = random.Random(100 + seed)
    config = vllm_config(rng, async_scheduling=True)
    requests = workload(rng)
    expected = drained(LLMEngine(config, model=model64), requests)
    engine = LLMEngine(config, model=model64)
    real = engine.model_runner.execute
    failing = {2 + seed, 5 + seed}

    def execute(out: SchedulerOutput) -> list[int]:
        if out.step in failing:
            failing.discard(out.step)
            if after_kv_write:
                real(out)
            raise InjectedFault(f"forward of step {out.step}")
        return real(out)

    engine.model_runner.execute = execute  # type: ignore[method-assign]
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    finished: dict[str, FinishedRequest] = {}
    faults = 0
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.synchronize()
        before, metrics = engine.observe(), metrics_without_time(engine)
        try:
            plan = engine.step()
        except InjectedFault:
            faults += 1
            assert engine.observe() == before
            assert metrics_without_time(engine) == metrics
            assert engine.scheduler.in_flight  # the failed step waits to run again
            engine.scheduler.check_invariants()
            continue
        finished.update((f.request_id, f) for f in plan.finished)
    assert not engine.has_unfinished_requests()
    assert faults == 2 - len(failing) and faults >= 1
    assert [finished[r.request_id] for r in expected] == expected
