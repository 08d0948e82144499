"""Every metric of ``kvsched run --json`` against the spec's trace of the same run.

Each scenario runs the CLI in-process, then replays the workload through the spec
(tests/oracles/metrics.py) with the tokens the run produced, and recomputes every
metric from the spec's states and plans alone. One test per scenario and metric, named
after the metric: a wrong count fails ``test_json_metric_equals_the_trace[MODE-METRIC]``.
The scenarios preempt under each mode, swap with a CPU pool too small for every victim
(some fall back to recompute), and cache shared prefixes while preempting and reclaiming.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Final

import pytest

from kvsched.cli import main
from kvsched.workload import read_workload
from spec.types import PreemptionMode, SchedulerConfig
from tests.oracles.metrics import flatten, outputs_as_tokens, replay, same, trace_metrics

SMALL: Final = SchedulerConfig(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=16)
CACHED: Final = replace(SMALL, num_gpu_blocks=8, enable_prefix_caching=True)


def options(config: SchedulerConfig) -> list[str]:
    """The ``kvsched run`` options that name ``config`` (the fields these scenarios set)."""
    argv = [
        "--num-gpu-blocks", str(config.num_gpu_blocks),
        "--block-size", str(config.block_size),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--preemption-mode", str(config.preemption_mode),
        "--num-cpu-blocks", str(config.num_cpu_blocks),
    ]  # fmt: skip
    return [*argv, "--enable-prefix-caching"] if config.enable_prefix_caching else argv


def _preempting() -> list[dict[str, object]]:
    """Eight requests (prompts of 5-8 tokens, 8-12 outputs) arriving over four steps,
    in 24 slots."""
    return [
        {
            "id": f"r{i}",
            "prompt": [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)],
            "max_tokens": 8 + i % 5,
            "ignore_eos": True,
            "arrival_step": i // 2,
        }
        for i in range(8)
    ]


def _shared_prefix() -> list[dict[str, object]]:
    """Ten prompts: the first 4-12 tokens of one 12-token prefix and 0-3 tokens of their
    own, arriving over five steps, in 32 slots: hits, preemptions and reclaims."""
    rng = random.Random(1)
    shared = [rng.randrange(1, 200) for _ in range(12)]
    return [
        {
            "id": f"r{i}",
            "prompt": shared[: 4 + (5 * i) % 9] + [rng.randrange(1, 200) for _ in range(i % 4)],
            "max_tokens": 6 + i % 5,
            "ignore_eos": True,
            "arrival_step": i // 2,
        }
        for i in range(10)
    ]


SCENARIOS: Final = {
    "recompute": (_preempting, SMALL),
    "restart": (_preempting, replace(SMALL, preemption_mode=PreemptionMode.RESTART)),
    "swap": (
        _preempting,
        replace(SMALL, preemption_mode=PreemptionMode.SWAP, num_cpu_blocks=3),
    ),
    "recompute-cached": (_shared_prefix, CACHED),
    "restart-cached": (_shared_prefix, replace(CACHED, preemption_mode=PreemptionMode.RESTART)),
}

METRICS: Final = (
    "steps",
    "preemptions",
    "preemptions_by_mode_recompute",
    "preemptions_by_mode_restart",
    "preemptions_by_mode_swap",
    "swap_out_blocks",
    "swap_in_blocks",
    "recomputed_tokens",
    "peak_gpu_blocks_used",
    "num_gpu_blocks",
    "kv_utilization",
)
PREFIX_METRICS: Final = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    "prefix_cache_reclaimed_blocks",
)


@functools.cache
def measured(scenario: str) -> tuple[dict[str, object], dict[str, object], int]:
    """The run's flattened ``metrics``, the trace's, and the tokens the trace sampled."""
    make, config = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in make()))
        argv = [
            "run",
            str(path),
            *options(config),
            "--json",
            "--device",
            "cpu",
            "--dtype",
            "float64",
        ]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
        workload = read_workload(path)
    doc = json.loads(out.getvalue())
    outputs = {r["id"]: r["output"] for r in doc["requests"]}
    trace = trace_metrics(config, replay(config, workload, outputs_as_tokens(outputs)))
    return flatten(doc["metrics"]), flatten(trace.document()), trace.tokens_sampled


def _cases() -> list[tuple[str, str]]:
    return [
        (scenario, metric)
        for scenario in SCENARIOS
        for metric in (*METRICS, *(PREFIX_METRICS if "cached" in scenario else ()))
    ]


@pytest.mark.parametrize(("scenario", "metric"), _cases())
def test_json_metric_equals_the_trace(scenario: str, metric: str) -> None:
    run, trace, _ = measured(scenario)
    assert same(trace[metric], run[metric]), f"{metric}: trace {trace[metric]}, run {run[metric]}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_document_has_no_metric_the_trace_lacks(scenario: str) -> None:
    """Every metric printed is checked above (``tokens_per_s``, the machine's, only for
    being there once tokens were sampled)."""
    run, trace, sampled = measured(scenario)
    assert set(run) - set(trace) == {"tokens_per_s"}
    assert set(trace) == {*METRICS, *(PREFIX_METRICS if "cached" in scenario else ())}
    assert sampled > 0 and float(str(run["tokens_per_s"])) > 0


@pytest.mark.parametrize(
    ("scenario", "needs"),
    [
        ("recompute", ("preemptions_by_mode_recompute",)),
        ("restart", ("preemptions_by_mode_restart",)),
        ("swap", ("preemptions_by_mode_swap", "preemptions_by_mode_recompute")),
        ("recompute-cached", ("preemptions", "prefix_cache_hits", "prefix_cache_reclaimed_blocks")),
        ("restart-cached", ("preemptions", "prefix_cache_hits", "prefix_cache_reclaimed_blocks")),
    ],
)
def test_each_scenario_reaches_what_it_is_for(scenario: str, needs: tuple[str, ...]) -> None:
    """The trace itself shows the case: victims of each mode (swap and its fallback to
    recompute), hits and reclaims with caching; else the comparisons prove little."""
    _, trace, _ = measured(scenario)
    assert all(int(str(trace[name])) > 0 for name in needs), {n: trace[n] for n in needs}
