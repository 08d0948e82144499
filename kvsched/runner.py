"""``kvsched run`` and ``kvsched run --reference``: a workload through the engine.

``run_workload`` drives one engine over the whole workload (see ``kvsched.drive``).
``run_reference`` is the ground truth: each request alone in a fresh engine whose
cache holds its whole life (no preemption can happen), so its output is what the
model generates for it undisturbed; a correct preempting run must produce the same
outputs. Requests the engine refuses for their own content (empty prompt,
``max_tokens`` < 1, a token outside the vocabulary) are rejected there too; a
reference run never rejects a request for its size, and, each request being alone,
never for a duplicate id. Given ``max_blocks``, a request whose solo cache would need
more blocks than that (more than the memory holds) is rejected with
``RequestTooLargeError`` instead of run.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

from impl.speculative import SpeculativeCounts
from kvsched.drive import Drive, StepCallback, admission_window, drive, unfinished_outcome
from kvsched.engine_protocol import Engine
from kvsched.results import (
    PrefixCacheMetrics,
    RequestOutcome,
    RunMetrics,
    RunResult,
)
from kvsched.workload import WorkloadRequest
from spec.types import SchedulerConfig

EngineFactory = Callable[[SchedulerConfig], Engine]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def metrics_of(engine: Engine, d: Drive, config: SchedulerConfig) -> RunMetrics:
    m = engine.metrics
    return RunMetrics(
        steps=d.steps,
        preemptions=d.preemptions,
        swap_out_blocks=m.swap_out_blocks,
        swap_in_blocks=m.swap_in_blocks,
        recomputed_tokens=m.recomputed_tokens,
        peak_gpu_blocks_used=m.peak_gpu_blocks_used,
        num_gpu_blocks=config.num_gpu_blocks,
        kv_utilization=m.kv_utilization,
        tokens_per_s=m.tokens_per_s,
        preemptions_by_mode=dict(d.preemptions_by_mode),
        tokens_sampled=d.tokens_sampled,
        prefix_cache=PrefixCacheMetrics(
            queries=m.prefix_cache_queries,
            hits=m.prefix_cache_hits,
            reclaimed_blocks=m.reclaimed_cached_blocks,
        )
        if config.enable_prefix_caching
        else None,
        speculative=m.speculative if config.num_speculative_tokens else None,
    )


def run_workload(
    engine: Engine,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    *,
    on_step: StepCallback | None = None,
    record_timeline: bool = False,
    stop: Callable[[], str | None] | None = None,
) -> RunResult:
    """``workload`` through ``engine`` (``kvsched.drive``), arrivals admitted lazily
    where the policy allows it (``admission_window``); the timeline only if asked."""
    d = drive(
        engine,
        workload,
        on_step=on_step,
        record_timeline=record_timeline,
        window=admission_window(config),
        stop=stop,
    )
    return RunResult(
        outcomes=tuple(d.outcomes),
        metrics=metrics_of(engine, d, config),
        timeline=tuple(d.timeline),
        interrupted=d.stopped,
    )


def solo_config(base: SchedulerConfig, request: WorkloadRequest) -> SchedulerConfig:
    """``base`` with a cache and a token budget that hold ``request``'s whole life.

    Nothing is ever preempted then, so there is no swap pool to allocate.
    """
    tokens = max(1, len(request.prompt) + max(request.params.max_tokens, 1))
    return dataclasses.replace(
        base,
        num_gpu_blocks=_cdiv(tokens, base.block_size),
        max_num_batched_tokens=max(base.max_num_batched_tokens, tokens),
        num_cpu_blocks=0,
    )


def run_reference(
    make_engine: EngineFactory,
    base: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    *,
    on_step: StepCallback | None = None,
    max_blocks: int | None = None,
    stop: Callable[[], str | None] | None = None,
) -> RunResult:
    """Each request alone with an unbounded cache; metrics add up over the solo runs.

    ``stop`` (as for ``run_workload``) ends the solo run in progress and leaves the
    requests after it not started.
    """
    outcomes: list[RequestOutcome] = []
    runs: list[RunMetrics] = []
    steps_before = 0
    interrupted: str | None = None
    for i, request in enumerate(workload):
        if interrupted is not None:
            outcomes.append(unfinished_outcome(request, None, waiting=True))
            continue
        config = solo_config(base, request)
        if max_blocks is not None and config.num_gpu_blocks > max_blocks:
            error = (
                f"RequestTooLargeError: alone, its whole life needs {config.num_gpu_blocks} "
                f"KV blocks; the memory free holds {max_blocks}"
            )
            outcomes.append(
                RequestOutcome(request_id=request.request_id, error=error, line=request.line)
            )
            if on_step is not None:
                on_step(steps_before, i + 1)
            continue
        solo = dataclasses.replace(request, arrival_step=0)

        def progress(steps: int, done: int, _base: int = steps_before, _i: int = i) -> None:
            if on_step is not None:
                on_step(_base + steps, _i + done)

        result = run_workload(make_engine(config), config, [solo], on_step=progress, stop=stop)
        outcomes.extend(result.outcomes)
        runs.append(result.metrics)
        steps_before += result.metrics.steps
        interrupted = result.interrupted
    return RunResult(outcomes=tuple(outcomes), metrics=_sum_metrics(runs), interrupted=interrupted)


def _sum_metrics(runs: Sequence[RunMetrics]) -> RunMetrics:
    steps = sum(m.steps for m in runs)
    by_mode: Counter[str] = Counter()
    for m in runs:
        by_mode.update(m.preemptions_by_mode)
    elapsed = sum(m.tokens_sampled / m.tokens_per_s for m in runs if m.tokens_per_s > 0)
    tokens = sum(m.tokens_sampled for m in runs)
    return RunMetrics(
        steps=steps,
        preemptions=sum(m.preemptions for m in runs),
        swap_out_blocks=sum(m.swap_out_blocks for m in runs),
        swap_in_blocks=sum(m.swap_in_blocks for m in runs),
        recomputed_tokens=sum(m.recomputed_tokens for m in runs),
        peak_gpu_blocks_used=max((m.peak_gpu_blocks_used for m in runs), default=0),
        num_gpu_blocks=max((m.num_gpu_blocks for m in runs), default=0),
        kv_utilization=(sum(m.kv_utilization * m.steps for m in runs) / steps if steps else 0.0),
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        preemptions_by_mode=dict(by_mode),
        tokens_sampled=tokens,
        prefix_cache=_sum_prefix_cache(runs),
        speculative=_sum_speculative(runs),
    )


def _sum_prefix_cache(runs: Sequence[RunMetrics]) -> PrefixCacheMetrics | None:
    caches = [m.prefix_cache for m in runs if m.prefix_cache is not None]
    if not caches:
        return None
    return PrefixCacheMetrics(
        queries=sum(c.queries for c in caches),
        hits=sum(c.hits for c in caches),
        reclaimed_blocks=sum(c.reclaimed_blocks for c in caches),
    )


def _sum_speculative(runs: Sequence[RunMetrics]) -> SpeculativeCounts | None:
    parts = [m.speculative for m in runs if m.speculative is not None]
    if not parts:
        return None
    return SpeculativeCounts(
        draft_tokens=sum(p.draft_tokens for p in parts),
        accepted_tokens=sum(p.accepted_tokens for p in parts),
        verify_runs=sum(p.verify_runs for p in parts),
        forwards=sum(p.forwards for p in parts),
        tokens=sum(p.tokens for p in parts),
    )
