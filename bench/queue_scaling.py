"""``kvsched run``'s steps per second with 100, 10,000 and 100,000 requests waiting.

Real traces queue tens of thousands of requests; the engine's scheduler is
O(scheduled) per step (impl/scheduler.py) and the tool around it must be too. Each
size gets the same engine (the CLI's defaults: 64 blocks of 16 tokens, the tiny
model) and the same request shape (16-token prompts, 200 outputs, EOS ignored), all
arriving at step 0, so the running batch is the same and only the waiting queue
differs. What is timed is the command's own loop: ``kvsched.runner.run_workload``, as
``kvsched run`` calls it, over ``--steps`` steps after ``WARMUP``, stopped there
through the same ``stop`` hook a SIGINT uses. Sizes are interleaved, ``--repeats``
rounds, median steps/s reported; the ratio is the fastest size's over the slowest's
(goal: within 1.5x). Three commands:

* ``run``: ``kvsched run w.jsonl`` (no timeline);
* ``run --plot``: with the KV timeline sampled every step;
* ``conform``: ``kvsched conform w.jsonl``, the spec and the engine in lockstep.

Memory per waiting request: Python allocations (``tracemalloc``) of what the command
holds for a request that waits, from reading its line to the first step, measured
as the difference between the two largest sizes divided by their difference in
requests; and, for comparison, what a request costs inside the engine (eager
admission: its ``Sequence``), which the lazy admission (``kvsched.drive.Arrivals``)
saves.

``--full N`` also runs the whole command line on a generated N-request workload
(``kvsched workload --num-requests N``, defaults otherwise, then ``kvsched run
--json``) in a subprocess and prints its wall time beside the engine's own step time
(``generated tokens / tokens_per_s`` of the JSON; recompute mode, so every sampled
token is an output).

``--baseline TREE`` also times another source tree's ``kvsched run`` loop on the same
workloads (``git archive COMMIT | tar -x -C TREE``), once per size and over fewer
steps (``BASELINE_STEPS``: it may be slow), in a subprocess: the before of a change.
It drives the tree's ``kvsched.drive.drive`` with the timeline on, as its ``kvsched
run`` did, and ends it with ``max_steps``.

Usage: ``python -m bench.queue_scaling [--quick] [--full 100000] [--baseline TREE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from bench._common import (
    add_common_args,
    command_line,
    load_average,
    markdown_table,
    median,
    print_header,
    setup_torch,
    spread,
)
from impl import LLMEngine
from kvsched import conform
from kvsched.distributions import IntDistribution
from kvsched.peers.ours import EngineAdapter
from kvsched.runner import run_workload
from kvsched.workload import (
    GeneratorSettings,
    WorkloadRequest,
    dump_workload,
    generate_workload,
    read_workload,
)
from model import LlamaForCausalLM, build_tiny_model
from spec.types import SchedulerConfig

WARMUP = 20
BASELINE_STEPS = 30  # after 5 warm-up steps
CONFIG = SchedulerConfig(num_gpu_blocks=64, block_size=16)  # the CLI's defaults
COMMANDS = ("run", "run --plot", "conform")


class _Enough(Exception):
    """The timed steps are done."""


def workload(waiting: int) -> list[WorkloadRequest]:
    """``waiting`` requests plus the few that run, all of one shape, at step 0."""
    return generate_workload(
        GeneratorSettings(
            num_requests=waiting + 8,
            seed=0,
            prompt_len=IntDistribution("uniform", 16, 16),
            max_tokens=IntDistribution("uniform", 200, 200),
            ignore_eos=True,
        )
    )


def _stopper(
    steps: int,
) -> tuple[Callable[[int, int], None], Callable[[], str | None], list[float]]:
    """An ``on_step`` that times steps ``WARMUP..steps`` and a ``stop`` that ends there."""
    marks: list[float] = []
    done = [0]

    def on_step(step: int, finished: int) -> None:
        done[0] = step
        if step in (WARMUP, steps):
            marks.append(time.perf_counter())

    def stop() -> str | None:
        return "bench" if done[0] >= steps else None

    return on_step, stop, marks


def steps_per_s(
    command: str, model: LlamaForCausalLM, requests: list[WorkloadRequest], steps: int
) -> float:
    """Steps per second of ``command`` over steps ``WARMUP..steps`` on ``requests``."""
    on_step, stop, marks = _stopper(steps)
    engine = LLMEngine(CONFIG, model=model, threads=1)
    if command == "conform":

        def conform_step(step: int, finished: int) -> None:
            on_step(step, finished)
            if stop() is not None:
                raise _Enough  # at a step boundary, as conform's SIGINT does

        with contextlib.suppress(_Enough):
            conform.conform(EngineAdapter(engine), CONFIG, requests, on_step=conform_step)
    else:
        run_workload(
            engine,
            CONFIG,
            requests,
            on_step=on_step,
            record_timeline=command == "run --plot",
            stop=stop,
        )
    start, end = marks
    return (steps - WARMUP) / (end - start)


def bytes_per_waiting_request(model: LlamaForCausalLM, sizes: Sequence[int]) -> tuple[float, float]:
    """Python bytes ``kvsched run`` holds per waiting request (file to first step), and
    what a request held inside the engine would cost instead."""
    held: list[int] = []
    inside: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes[-2:]:
            path = Path(tmp) / f"w{n}.jsonl"
            with path.open("w") as f:
                dump_workload(workload(n), f)
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            requests = read_workload(path)
            on_step, stop, _ = _stopper(1)
            engine = LLMEngine(CONFIG, model=model, threads=1)
            run_workload(engine, CONFIG, requests, on_step=on_step, stop=stop)
            held.append(tracemalloc.get_traced_memory()[0] - base)
            eager = LLMEngine(CONFIG, model=model, threads=1)
            before = tracemalloc.get_traced_memory()[0]
            for r in requests:
                eager.add_request(r.request_id, r.prompt, r.params)
            inside.append(tracemalloc.get_traced_memory()[0] - before)
            tracemalloc.stop()
            del requests, engine, eager
    n = sizes[-1] - sizes[-2]
    return (held[1] - held[0]) / n, (inside[1] - inside[0]) / n


BASELINE = """
import sys, time
from impl import LLMEngine
from kvsched.distributions import IntDistribution
from kvsched.drive import drive
from kvsched.errors import DrainError
from kvsched.workload import GeneratorSettings, generate_workload
from model import build_tiny_model
from spec.types import SchedulerConfig

waiting, steps = int(sys.argv[1]), int(sys.argv[2])
settings = GeneratorSettings(
    num_requests=waiting + 8, seed=0, prompt_len=IntDistribution("uniform", 16, 16),
    max_tokens=IntDistribution("uniform", 200, 200), ignore_eos=True,
)
workload = generate_workload(settings)
config = SchedulerConfig(num_gpu_blocks=64, block_size=16)
engine = LLMEngine(config, model=build_tiny_model(seed=0), threads=1)
marks = []
def on_step(step, done):
    if step in (5, 5 + steps):
        marks.append(time.perf_counter())
try:
    drive(engine, workload, on_step=on_step, max_steps=5 + steps)
except DrainError:
    pass
print(steps / (marks[1] - marks[0]))
"""


def baseline_steps_per_s(tree: str, waiting: int) -> float:
    """``BASELINE``'s steps/s for ``tree`` with ``waiting`` requests waiting."""
    with tempfile.TemporaryDirectory() as tmp:  # not a source tree: ``-c`` puts cwd first
        out = subprocess.run(
            [sys.executable, "-c", BASELINE, str(waiting), str(BASELINE_STEPS)],
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return float(out)


def full_run(num_requests: int) -> list[str]:
    """The whole command line on a generated workload: wall time against engine time."""
    kvsched = [sys.executable, "-m", "kvsched"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "w.jsonl")
        start = time.perf_counter()
        subprocess.run(
            [*kvsched, "workload", "--num-requests", str(num_requests), "-o", path, "-q"],
            check=True,
            env=env,
        )
        generated = time.perf_counter() - start
        load_before = load_average()
        start = time.perf_counter()
        out = subprocess.run(
            [*kvsched, "run", path, "--json", "-q"],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        wall = time.perf_counter() - start
    doc = json.loads(out)
    metrics = doc["metrics"]
    tokens = sum(len(r["output"]) for r in doc["requests"])
    engine = tokens / metrics["tokens_per_s"]
    done = sum(r["state"] == "finished" for r in doc["requests"])
    return [
        f"kvsched workload --num-requests {num_requests}: {generated:.1f} s",
        f"kvsched run --json: {wall:.1f} s wall for {done:,} of {num_requests:,} requests "
        f"in {metrics['steps']:,} steps; engine steps {engine:.1f} s "
        f"(wall / engine = {wall / engine:.2f}); load before {load_before}, "
        f"after {load_average()}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=3)
    parser.add_argument("--steps", type=int, default=300, help="steps timed per run (300)")
    parser.add_argument(
        "--full", type=int, default=0, metavar="N", help="also the whole CLI on N requests"
    )
    parser.add_argument("--baseline", metavar="TREE", help="also time this source tree's loop")
    args = parser.parse_args(argv)
    setup_torch(args)
    sizes = [10, 100, 1000] if args.quick else [100, 10_000, 100_000]
    steps = WARMUP + 20 if args.quick else max(WARMUP + 1, args.steps)
    print_header(
        "kvsched run: steps/s against the waiting queue", command_line("bench.queue_scaling", argv)
    )
    model = build_tiny_model(seed=0)
    workloads = {n: workload(n) for n in sizes}
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for command in COMMANDS:
            for n in sizes:
                rate = steps_per_s(command, model, workloads[n], steps)
                rates.setdefault((command, n), []).append(rate)
    rows = []
    for command in COMMANDS:
        medians = [median(rates[command, n]) for n in sizes]
        rows.append(
            [
                f"kvsched {command}",
                *(
                    f"{m:,.0f} ({spread(rates[command, n])})"
                    for m, n in zip(medians, sizes, strict=True)
                ),
                f"{max(medians) / min(medians):.2f}x",
            ]
        )
    if args.baseline is not None:
        before = [baseline_steps_per_s(args.baseline, n) for n in sizes]
        rows.append(
            [
                f"baseline {args.baseline}: kvsched run (1 run, {BASELINE_STEPS} steps)",
                *(f"{b:,.1f}" for b in before),
                f"{max(before) / min(before):.2f}x",
            ]
        )
    headers = ["command", *(f"{n:,} waiting" for n in sizes), "fastest / slowest"]
    print(f"steps/s, median of {args.repeats} (min..max), steps {WARMUP}..{steps} of each run")
    print(markdown_table(headers, rows))
    del workloads
    held, inside = bytes_per_waiting_request(model, sizes)
    print()
    print(
        f"memory per waiting request (Python allocations, {sizes[-2]:,} vs {sizes[-1]:,} "
        f"waiting): {held:,.0f} bytes held by kvsched run (its line read and kept, admitted "
        f"lazily); {inside:,.0f} bytes more if it were inside the engine"
    )
    if args.full:
        print()
        for line in full_run(args.full):
            print(line)
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
