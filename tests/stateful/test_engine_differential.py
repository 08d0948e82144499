"""``EngineDifferential``: the spec against the whole ``LLMEngine`` with the tiny Llama in float64.

One model object is shared by every example (built once per process); each example
builds a fresh engine around it. The engine's sampled tokens are fed to the spec's
phase D, so the spec checks every scheduling decision and the full plan; the token
*values* are checked against solo runs: every sampled token online (the token at
output index ``k`` must be the solo run's ``k``-th), and every final output in
``teardown`` (aborted ones must be a prefix). Solo = the request alone in a fresh
engine with ample blocks, memoised by ``(prompt, params)``. In float64 the model is
batch-invariant to the bit, so any difference is a scheduling or KV bug (lost
tokens after preemption, a wrong swap copy, a block reused while live, a rollback
that did not restore the K/V it should).

Faults: the next forward raises (before, or after it wrote K/V into the cache), or
the next swap-out / swap-in copy raises. The engine must roll the step back:
``observe()`` and the metrics unchanged, the spec not advanced; the next step retries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from hypothesis import settings

from impl import LLMEngine
from impl.block_manager import cdiv
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from kvsched.peers.lockstep import Lockstep
from kvsched.peers.ours import EngineAdapter
from model import LlamaForCausalLM, build_tiny_model
from spec.oracle import HashOracle
from spec.types import (
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)
from tests.oracles.metrics import MetricTrace, TraceStep, engine_mismatches
from tests.stateful.coverage import REQUIRED_EVENTS
from tests.stateful.failures import InjectedFault, fail, require
from tests.stateful.harness import run_differential
from tests.stateful.machine import DifferentialMachine
from tests.stateful.profiles import SUPPRESSED

_MODEL: list[LlamaForCausalLM] = []
_SOLO: dict[tuple[tuple[int, ...], SamplingParams], tuple[int, ...]] = {}


def tiny_model() -> LlamaForCausalLM:
    """The tiny Llama in float64, built once per process and shared by every engine."""
    if not _MODEL:
        _MODEL.append(build_tiny_model(seed=0, dtype=torch.float64, device="cpu"))
    return _MODEL[0]


def solo_outputs(prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
    """The request alone in a fresh engine with ample blocks and budget (memoised)."""
    key = (prompt, params)
    if key not in _SOLO:
        need = len(prompt) + params.max_tokens
        config = SchedulerConfig(
            num_gpu_blocks=cdiv(need, 16) + 1,
            block_size=16,
            max_num_batched_tokens=max(need, 256),
        )
        engine = LLMEngine(config, model=tiny_model())
        (result,) = engine.generate([("solo", list(prompt), params)])
        assert result.num_preemptions == 0
        _SOLO[key] = result.output_token_ids
    return _SOLO[key]


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread: the forwards are tiny, and extra threads only spin (and the
    model is batch-invariant at any thread count, model/plan.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def overwrote_victim_blocks(out: SchedulerOutput, block_size: int) -> bool:
    """Whether a chunk of this step writes into a GPU block that a victim of this step
    gave up (the blocks a failed step's rollback must restore)."""
    given_up = {block for record in out.preempted for block in record.gpu_blocks}
    return any(
        block in given_up
        for seq in out.scheduled
        for block in seq.block_table[cdiv(seq.num_computed, block_size) :]
    )


def metrics_without_time(engine: LLMEngine) -> dict[str, Any]:
    values = asdict(engine.metrics)
    del values["step_time_s"]
    return values


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class EngineDifferential(DifferentialMachine):
    NAME = "EngineDifferential"
    VOCAB = 256  # the tiny model's vocabulary (checked in new_lockstep)

    engine: LLMEngine

    def new_lockstep(self, config: SchedulerConfig) -> Lockstep:
        """The model samples (the oracle goes unused); its tokens are the spec's."""
        engine = LLMEngine(config, model=tiny_model())
        assert engine.model.config.vocab_size == self.VOCAB
        self.engine = engine
        # Armed faults: kind -> only in a step that preempts; each fires once.
        self.armed: dict[str, bool] = {}
        self.preemptions_by_mode: Counter[PreemptionMode] = Counter()
        self.num_sampled = 0
        runner, cache = engine.model_runner, engine.cache_engine
        execute, swap_out, swap_in = runner.execute, cache.swap_out, cache.swap_in

        def armed(kind: str, preempting: bool) -> bool:
            return kind in self.armed and (preempting or not self.armed[kind])

        def faulty_execute(out: SchedulerOutput) -> list[int]:
            if armed("forward", bool(out.preempted)):
                self.fire("forward")
            tokens = execute(out)
            if armed("forward after KV write", bool(out.preempted)):
                if overwrote_victim_blocks(out, config.block_size):
                    self.note("fault: after the forward wrote into blocks a victim gave up")
                self.fire("forward after KV write")
            return tokens

        def faulty_swap_out(mapping: Sequence[tuple[int, int]]) -> None:
            if mapping and armed("swap-out copy", True):  # a swap-out always preempts
                self.fire("swap-out copy")
            swap_out(mapping)

        def faulty_swap_in(mapping: Sequence[tuple[int, int]]) -> None:
            swap_in(mapping)  # the copy lands in fresh blocks, then fails
            if mapping and armed("swap-in copy", True):  # never in a preempting step (R7)
                self.fire("swap-in copy")

        runner.execute = faulty_execute  # type: ignore[method-assign]
        cache.swap_out = faulty_swap_out  # type: ignore[method-assign]
        cache.swap_in = faulty_swap_in  # type: ignore[method-assign]
        self.metric_trace = MetricTrace(config)
        oracle = HashOracle(vocab_size=self.VOCAB)
        return Lockstep(EngineAdapter(engine), config, oracle, vocab_size=self.VOCAB)

    def record_step(self, before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> None:
        super().record_step(before, mid, plan)
        self.metric_trace.add(TraceStep(before, mid, plan, self.lock.state))

    def check_drained(self) -> None:
        """Also every metric against the spec's trace (tests/oracles/metrics.py)."""
        super().check_drained()
        for invariant, message in engine_mismatches(self.metric_trace, self.engine.metrics):
            fail(invariant, message)

    def fire(self, kind: str) -> None:
        del self.armed[kind]
        self.note(f"fault: {kind}")
        raise InjectedFault(kind)

    def real_scheduler(self) -> Scheduler:
        return self.engine.scheduler

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        return solo_outputs(prompt, params)

    def fault_snapshot(self) -> dict[str, object]:
        return {
            "fault_keeps_metrics": metrics_without_time(self.engine),
            "fault_restores_kv": self.live_kv(),
        }

    def live_kv(self) -> bytes:
        """The K/V of every live request's computed positions (GPU for running, CPU for
        swapped), as bytes: a rolled-back step must leave them bit for bit as they were,
        whatever the failed forward wrote into blocks its victims gave up."""
        scheduler = self.engine.scheduler
        cache = self.engine.cache_engine
        bs = self.config.block_size
        parts: list[bytes] = []
        pools = (
            (cache.gpu_cache, [(s.block_table, s.num_computed) for s in scheduler.running]),
            (cache.cpu_cache, [(s.cpu_block_table, s.num_computed) for s in scheduler.swapped]),
        )
        for pool, tables in pools:
            slots = [table[p // bs] * bs + p % bs for table, n in tables for p in range(n)]
            if pool is None or not slots:
                continue
            index = torch.tensor(slots, dtype=torch.long)
            for tensor in (pool.key, pool.value):
                flat = tensor.view(pool.num_layers, pool.num_slots, -1)
                parts.append(flat.index_select(1, index).numpy().tobytes())
        return b"".join(parts)

    def after_step(self, mid: SchedulerState, plan: StepPlan) -> None:
        by_id = {request.request_id: request for request in mid.running}
        for sampled in plan.sampled:
            request = by_id[sampled.request_id]
            solo = self.solo(request.request.prompt_token_ids, request.request.params)
            k = len(request.output_token_ids)
            if not (k < len(solo) and solo[k] == sampled.token_id):
                fail(
                    "sampled_tokens_match_solo",
                    f"step {plan.step}: {sampled.request_id!r} sampled {sampled.token_id} as "
                    f"output {k} ({request.num_preemptions} preemptions); alone: {solo}",
                )
        self.preemptions_by_mode.update(p.mode for p in plan.preempted)
        self.num_sampled += len(plan.sampled)
        metrics = self.engine.metrics
        require(
            metrics.steps == plan.step + 1
            and all(metrics.preemptions[m] == self.preemptions_by_mode[m] for m in PreemptionMode)
            and metrics.generated_tokens == self.num_sampled,
            "metrics_match_plans",
            lambda: (
                f"metrics {metrics} after step {plan.step}, plans preempted "
                f"{dict(self.preemptions_by_mode)} and sampled {self.num_sampled}"
            ),
        )

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        self.armed[kind] = when_preempting


#: Only the engine has K/V to restore: a fault after a forward that wrote into blocks
#: its step's victims gave up (the case ``fault_restores_kv`` exists for).
REQUIRED = REQUIRED_EVENTS | {"fault: after the forward wrote into blocks a victim gave up"}


def test_engine_differential() -> None:
    with single_thread():
        run_differential(EngineDifferential, REQUIRED)
