"""Where a step's time goes: cProfile of the engine step and of the scheduler step.

1. ``LLMEngine.generate`` on the tiny model (batch-invariant and not) over a mixed
   workload (``--requests`` requests, prompts 16..256, ``max_tokens`` 16..128): the
   step split into its parts (scheduling, building the batch, the forward plan,
   attention, linear layers, sampling, commit/plan), as shares of the profiled time;
2. the decode steady state of the torch-free scheduler at ``--running`` requests
   (``Scheduler.step`` with a constant sampler): the functions with the most own time.

Profiling adds overhead per Python call, so the shares of Python-heavy parts are
inflated; read them as a ranking. Usage: ``python -m bench.profile_step``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from bench._common import add_common_args, command_line, markdown_table, print_header, setup_torch
from bench.scheduler_overhead import constant_sample, decoding, make_config, params, prompt
from impl import LLMEngine, Scheduler
from model import build_tiny_model
from spec.types import SamplingParams, SchedulerConfig

# (label, file suffix, function name): cumulative time of each, as a share of the total.
PARTS = [
    ("engine step (total)", "impl/engine.py", "step"),
    ("  scheduler: schedule (phases A-C)", "impl/scheduler.py", "schedule"),
    ("  scheduler: commit (phase D)", "impl/scheduler.py", "commit"),
    ("  StepPlan", "impl/plan.py", "make_plan"),
    ("  metrics", "impl/engine.py", "_record"),
    ("  model runner: prepare (spans)", "impl/model_runner.py", "prepare"),
    ("  model forward (total)", "model/llama.py", "forward"),
    ("    forward plan (index tensors)", "model/plan.py", "build_plan"),
    ("    attention layer (total)", "model/attention.py", "forward"),
    ("      paged attention (gather, QK, softmax, PV)", "model/paged_attention.py", "attend_group"),
    ("    MLP", "model/mlp.py", "forward"),
    ("    RMSNorm", "model/norm.py", "forward"),
    ("  sampling (one argmax for the greedy rows)", "model/sampling.py", "sample_tokens"),
    ("  sampling (per temperature row)", "model/sampling.py", "sample_token"),
]


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = 0.0
    for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in table.items():
        if func == name and str(filename).endswith(suffix):
            total += ct
    return float(total)


def own_time_rows(stats: pstats.Stats, limit: int) -> list[list[object]]:
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in table.values())
    ranked = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:limit]
    rows: list[list[object]] = []
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in ranked:
        where = str(filename).split("/work/main/")[-1] if filename != "~" else ""
        rows.append(
            [
                f"{where}:{line}({func})" if where else func,
                nc,
                f"{tt:.3f}",
                f"{tt / total:.1%}",
                f"{ct:.3f}",
            ]
        )
    return rows


def profile(run: Callable[[], object]) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    return pstats.Stats(profiler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.running, args.steps, args.top = 4, 16, 5, 5
    device = setup_torch(args)
    print_header("Profile of the step path", command_line("bench.profile_step", argv), device)

    rng = random.Random(0)
    hi_prompt, hi_tokens = (24, 8) if args.quick else (256, 128)
    requests = [
        (
            f"r{i}",
            [rng.randrange(1, 255) for _ in range(rng.randint(min(16, hi_prompt), hi_prompt))],
            SamplingParams(max_tokens=rng.randint(min(16, hi_tokens), hi_tokens), ignore_eos=True),
        )
        for i in range(args.requests)
    ]
    blocks = sum(-(-(len(p) + s.max_tokens) // 16) for _, p, s in requests)
    config = SchedulerConfig(num_gpu_blocks=blocks, block_size=16, max_num_seqs=256)
    for invariant in (True, False):
        model = build_tiny_model(seed=0, device=device, batch_invariant=invariant)
        LLMEngine(config, model=model).generate(requests[:2])  # warm-up
        engine = LLMEngine(config, model=model)
        stats = profile(partial(engine.generate, requests))
        total = cumulative(stats, "impl/engine.py", "step")
        print(
            f"## engine step, tiny model, batch_invariant={invariant}: {args.requests} "
            f"requests, {engine.metrics.steps} steps, {total:.3f} s profiled\n"
        )
        rows = [
            [
                label,
                f"{cumulative(stats, suffix, name):.3f}",
                f"{cumulative(stats, suffix, name) / total:.1%}",
            ]
            for label, suffix, name in PARTS
        ]
        print(markdown_table(["part (cumulative)", "s", "share of step"], rows))
        print()
        print(
            markdown_table(
                ["function (own time)", "calls", "s", "share", "cumulative s"],
                own_time_rows(stats, args.top),
            )
        )
        print()

    scheduler = Scheduler(make_config(args.running, args.steps + 100))
    for i in range(args.running):
        scheduler.add_request(f"r{i}", prompt(i), params(args.steps + 100))
    while not decoding(scheduler, args.running):
        scheduler.step(constant_sample)

    def steps() -> None:
        for _ in range(args.steps):
            scheduler.step(constant_sample)

    stats = profile(steps)
    print(f"## Scheduler.step, decode steady state, {args.running} running, {args.steps} steps\n")
    print(
        markdown_table(
            ["function (own time)", "calls", "s", "share", "cumulative s"],
            own_time_rows(stats, args.top),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
