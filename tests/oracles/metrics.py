"""The metric oracle: every metric of ``kvsched run --json`` recomputed from the spec's trace.

An engine counts its metrics as it runs (``impl.engine.EngineMetrics``); this module
counts them again from what the spec decided, step by step, and nothing else: a
``TraceStep`` is the spec's state ``before`` a step, ``mid`` (after its decisions,
``spec.schedule``) and its ``plan``. Each metric, as
``EngineMetrics`` (impl/engine.py) and the ``--json`` document (kvsched/report.py)
define it:

* ``steps``: the steps taken (empty ones too);
* ``preemptions`` and ``preemptions_by_mode``: the plans' victims, by the mode used (a
  swap that fell back to recompute counts as recompute);
* ``swap_out_blocks``: each swapped-out victim's ``cdiv(computed, bs)`` blocks (it sits
  in ``mid.swapped``); ``swap_in_blocks``: each swapped-in request's, counted in
  ``mid.running`` before its chunk;
* ``recomputed_tokens``: chunk positions below the most tokens the request ever had
  computed (a request is named by its arrival, ids may be reused);
* ``peak_gpu_blocks_used``: the most GPU blocks in use after a step's decisions (at its
  forward);
* ``kv_utilization``: the mean over steps of the token slots holding K/V once the
  forward has run (every request running at ``mid``, its chunk included) over
  ``num_gpu_blocks * block_size``; with prefix caching a slot of a shared block counts
  once, so it never exceeds 1;
* ``prefix_cache`` (caching on): ``queries`` the tokens of the requests admitted,
  ``hits`` the hit tokens they did not compute (their chunk's start), ``hit_rate`` the
  ratio, ``reclaimed_blocks`` the blocks taken for new content while they had a key.

``tokens_per_s`` is the one figure that depends on the machine: a trace has no clock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import spec
from impl.engine import EngineMetrics
from kvsched.workload import WorkloadRequest
from spec.kv import blocks_held
from spec.profiles import nano_caching, speculative
from spec.speculative import PAD, drafts_scheduled, num_accepted
from spec.types import PreemptionMode, SchedulerConfig, SchedulerState, StepPlan

#: ``tokens(mid, plan)``: the token each sampling request of a step samples.
TokenSource = Callable[[SchedulerState, StepPlan], Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class TraceStep:
    before: SchedulerState
    mid: SchedulerState
    plan: StepPlan


@dataclass(slots=True)
class MetricTrace:
    """The metrics of the trace so far; ``add`` each step in order."""

    config: SchedulerConfig
    steps: int = 0
    preemptions_by_mode: Counter[PreemptionMode] = field(default_factory=Counter)
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    tokens_sampled: int = 0
    peak_gpu_blocks_used: int = 0
    kv_utilization_sum: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    reclaimed_blocks: int = 0
    forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_runs: int = 0
    #: arrival -> the most tokens the request has had computed at any step's start
    most_computed: dict[int, int] = field(default_factory=dict)

    def add(self, step: TraceStep) -> None:
        before, mid, plan = step.before, step.mid, step.plan
        bs = self.config.block_size
        for request in (*before.running, *before.swapped):
            arrival = request.request.arrival
            self.most_computed[arrival] = max(
                self.most_computed.get(arrival, 0), request.num_computed_tokens
            )
        self.steps += 1
        self.preemptions_by_mode.update(p.mode for p in plan.preempted)
        self.tokens_sampled += len(plan.sampled)
        self.scheduled_tokens += sum(plan.num_scheduled_tokens)
        swapped = {r.request_id: r for r in mid.swapped}
        self.swap_out_blocks += sum(
            blocks_held(swapped[p.request_id].num_computed_tokens, bs)
            for p in plan.preempted
            if p.mode is PreemptionMode.SWAP
        )
        running = {r.request_id: r for r in mid.running}
        self.swap_in_blocks += sum(
            blocks_held(running[rid].num_computed_tokens, bs) for rid in plan.swapped_in
        )
        for chunk in plan.scheduled:
            most = self.most_computed.get(running[chunk.request_id].request.arrival, 0)
            self.recomputed_tokens += max(
                0, min(chunk.start + chunk.num_tokens, most) - chunk.start
            )
        self.forwards += bool(plan.scheduled)
        if speculative(self.config):
            runs = spec.plan_runs(plan)
            for chunk in plan.scheduled:
                drafts = drafts_scheduled(running[chunk.request_id], chunk.start, chunk.num_tokens)
                if drafts and PAD not in drafts and chunk.request_id in runs:
                    self.draft_tokens += len(drafts)
                    self.accepted_tokens += num_accepted(drafts, runs[chunk.request_id])
                    self.verify_runs += 1
        self.peak_gpu_blocks_used = max(
            self.peak_gpu_blocks_used, self.config.num_gpu_blocks - mid.num_free_gpu_blocks
        )
        capacity = self.config.num_gpu_blocks * bs
        self.kv_utilization_sum += slots_filled(mid, plan) / capacity
        if self.config.enable_prefix_caching:
            waiting = {r.request_id: r for r in before.waiting}
            for chunk in plan.scheduled:
                admitted = waiting.get(chunk.request_id)
                if admitted is not None:
                    self.prefix_cache_queries += admitted.num_tokens
                    self.prefix_cache_hits += chunk.start
            self.reclaimed_blocks += len(reclaimed(before, mid, plan))

    def document(self) -> dict[str, object]:
        """The ``metrics`` object of ``kvsched run --json``, but ``tokens_per_s``."""
        metrics: dict[str, object] = {
            "steps": self.steps,
            "preemptions": sum(self.preemptions_by_mode.values()),
            "preemptions_by_mode": {
                str(mode): self.preemptions_by_mode[mode] for mode in PreemptionMode
            },
            "swap_out_blocks": self.swap_out_blocks,
            "swap_in_blocks": self.swap_in_blocks,
            "recomputed_tokens": self.recomputed_tokens,
            "peak_gpu_blocks_used": self.peak_gpu_blocks_used,
            "num_gpu_blocks": self.config.num_gpu_blocks,
            "kv_utilization": self.kv_utilization_sum / self.steps if self.steps else 0.0,
        }
        if self.config.enable_prefix_caching:
            queries, hits = self.prefix_cache_queries, self.prefix_cache_hits
            metrics["prefix_cache"] = {
                "queries": queries,
                "hits": hits,
                "hit_rate": hits / queries if queries else 0.0,
                "reclaimed_blocks": self.reclaimed_blocks,
            }
        if speculative(self.config):
            drafts, accepted, runs = self.draft_tokens, self.accepted_tokens, self.verify_runs
            metrics["speculative"] = {
                "draft_tokens": drafts,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafts if drafts else 0.0,
                "mean_accepted_length": 1 + accepted / runs if runs else 0.0,
                "tokens_per_forward": self.tokens_sampled / self.forwards if self.forwards else 0.0,
            }
        return metrics

    def engine_counters(self) -> dict[str, object]:
        """``document`` plus the engine's two counters the document leaves out."""
        return {
            **self.document(),
            "scheduled_tokens": self.scheduled_tokens,
            "generated_tokens": self.tokens_sampled,
        }


def slots_filled(mid: SchedulerState, plan: StepPlan) -> int:
    """Token slots holding K/V once the step's forward has run: each running request's
    computed tokens and its chunk; a slot of a block two requests share counts once."""
    filled = {r.request_id: r.num_computed_tokens for r in mid.running}
    for rid, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
        filled[rid] += n
    if mid.prefix_cache is None:
        return sum(filled.values())
    bs = mid.config.block_size
    per_block: dict[int, int] = {}
    for request in mid.running:
        for index, block in enumerate(request.block_ids):
            slots = min(bs, filled[request.request_id] - index * bs)
            per_block[block] = max(per_block.get(block, 0), slots)
    return sum(per_block.values())


def reclaimed(before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> set[int]:
    """PC5: the blocks a step took for new content while they had a key.

    A block keyed before the step keeps its key until it is taken, except under
    nano-vllm/drop-key-on-free, where a block freed in the step (a victim's) loses it
    first. A reclaimed block either no longer has its key after the decisions, or has
    it again because its new owner filled it with the same prefix: so it is one whose
    key is gone or one a request now holds past its hit that it did not hold before.
    """
    cache_before, cache_mid = before.prefix_cache, mid.prefix_cache
    assert cache_before is not None and cache_mid is not None
    keyed = {block for _, block in cache_before.cached}
    if nano_caching(before.config):
        keyed &= set(cache_before.free_queue)
    kept = set(cache_mid.cached)
    gone = {block for key, block in cache_before.cached if (key, block) not in kept}
    held = {r.request_id: set(r.block_ids) for r in before.running}
    starts = dict(zip(plan.scheduled_ids, plan.num_computed_tokens, strict=True))
    bs = before.config.block_size
    taken: set[int] = set()
    for request in mid.running:
        rid = request.request_id
        if rid in held:
            taken |= set(request.block_ids) - held[rid]
        elif rid in starts:  # admitted: its hit blocks were touched, not taken
            taken |= set(request.block_ids[starts[rid] // bs :])
    return (gone | taken) & keyed


def trace_metrics(config: SchedulerConfig, trace: Iterable[TraceStep]) -> MetricTrace:
    metrics = MetricTrace(config)
    for step in trace:
        metrics.add(step)
    return metrics


def engine_counters(metrics: EngineMetrics, config: SchedulerConfig) -> dict[str, object]:
    """An engine's counters under the names of ``MetricTrace.engine_counters``."""
    counters: dict[str, object] = {
        "steps": metrics.steps,
        "preemptions": metrics.num_preemptions,
        "preemptions_by_mode": {str(mode): n for mode, n in metrics.preemptions.items()},
        "swap_out_blocks": metrics.swap_out_blocks,
        "swap_in_blocks": metrics.swap_in_blocks,
        "recomputed_tokens": metrics.recomputed_tokens,
        "peak_gpu_blocks_used": metrics.peak_gpu_blocks_used,
        "num_gpu_blocks": config.num_gpu_blocks,
        "kv_utilization": metrics.kv_utilization,
    }
    if config.enable_prefix_caching:
        counters["prefix_cache"] = {
            "queries": metrics.prefix_cache_queries,
            "hits": metrics.prefix_cache_hits,
            "hit_rate": metrics.prefix_cache_hit_rate,
            "reclaimed_blocks": metrics.reclaimed_cached_blocks,
        }
    if speculative(config):
        figures = metrics.speculative
        counters["speculative"] = {
            "draft_tokens": figures.draft_tokens,
            "accepted_tokens": figures.accepted_tokens,
            "acceptance_rate": figures.acceptance_rate,
            "mean_accepted_length": figures.mean_accepted_length,
            "tokens_per_forward": figures.tokens_per_forward,
        }
    counters["scheduled_tokens"] = metrics.scheduled_tokens
    counters["generated_tokens"] = metrics.generated_tokens
    return counters


def flatten(values: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"prefix_cache": {"hits": 3}}`` as ``{"prefix_cache_hits": 3}``."""
    flat: dict[str, object] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}_"))
        else:
            flat[name] = value
    return flat


def same(expected: object, actual: object) -> bool:
    """Equal; floats (utilization, hit rate) up to rounding, as sums in another order."""
    if isinstance(expected, float) or isinstance(actual, float):
        assert isinstance(expected, int | float) and isinstance(actual, int | float)
        return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12)
    return expected == actual


def mismatches(
    expected: Mapping[str, object], actual: Mapping[str, object]
) -> list[tuple[str, str]]:
    """The metrics (flattened names) whose values differ or that only one side has, in
    the document's order (a count before the ratio made of it): each as its name and
    ``name: trace X, engine Y``."""
    want, got = flatten(expected), flatten(actual)
    return [
        (name, f"{name}: trace {want.get(name, '(none)')}, engine {got.get(name, '(none)')}")
        for name in [*want, *(name for name in got if name not in want)]
        if name not in want or name not in got or not same(want[name], got[name])
    ]


def engine_mismatches(trace: MetricTrace, metrics: EngineMetrics) -> list[tuple[str, str]]:
    """``mismatches`` of an engine's counters against the trace's, each named as the
    invariant it breaks: ``metric_<name>`` (``metric_kv_utilization``)."""
    found = mismatches(trace.engine_counters(), engine_counters(metrics, trace.config))
    return [(f"metric_{name}", text) for name, text in found]


def replay(
    config: SchedulerConfig, workload: Sequence[WorkloadRequest], tokens: TokenSource
) -> list[TraceStep]:
    """The spec's trace of ``workload``: requests added at their ``arrival_step`` (before
    that step, in workload order, as ``kvsched run`` adds them; a refused one is
    skipped), then a step, until all have arrived and finished."""
    order = sorted(workload, key=lambda r: r.arrival_step)
    state = spec.init_state(config)
    trace: list[TraceStep] = []
    nxt = 0
    while nxt < len(order) or spec.has_unfinished_requests(state):
        while nxt < len(order) and order[nxt].arrival_step <= state.num_steps:
            r = order[nxt]
            nxt += 1
            try:
                state = spec.add_request(state, r.request_id, r.prompt, r.params)
            except spec.InvalidRequestError:
                continue
        mid, decided = spec.schedule(state)
        after, plan = spec.complete_step(mid, decided, tokens(mid, decided))
        trace.append(TraceStep(state, mid, plan))
        state = after
    return trace


def outputs_as_tokens(outputs: Mapping[str, Sequence[int]]) -> TokenSource:
    """Tokens from each request's final outputs (by id): a request that samples its
    ``k``-th output samples ``outputs[id][k]`` (under restart, again after a restart:
    the engines are deterministic)."""

    def tokens(mid: SchedulerState, plan: StepPlan) -> dict[str, int]:
        running = {r.request_id: r for r in mid.running}
        return {
            rid: outputs[rid][len(running[rid].output_token_ids)]
            for rid in spec.sampling_request_ids(mid, plan)
        }

    return tokens
