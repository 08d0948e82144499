"""Shared helpers of the benchmark scripts: machine description, timing, tables."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch

from impl import LLMEngine
from impl.engine import EngineStalledError, drain_step_limit
from model import LlamaForCausalLM, resolve_device
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, SchedulerState

P = ParamSpec("P")
T = TypeVar("T")


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or the platform's guess)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def machine_lines(device: torch.device | None = None) -> list[str]:
    """What the figures were measured on (printed at the top of every script)."""
    lines = [
        f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"cpu: {cpu_model()} (nproc {os.cpu_count()}), load average {load_average()}",
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}",
    ]
    if device is not None and device.type == "cuda":
        lines.append(f"gpu: {torch.cuda.get_device_name(device)}")
    return lines


def print_header(title: str, command: Sequence[str], device: torch.device | None = None) -> None:
    print(f"# {title}")
    print(f"command: python -m {' '.join(command)}")
    for line in machine_lines(device):
        print(line)
    print()


def command_line(module: str, argv: Sequence[str] | None) -> list[str]:
    return [module, *(sys.argv[1:] if argv is None else argv)]


def add_common_args(parser: argparse.ArgumentParser, *, repeats: int) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        help=f"timed repetitions, median reported ({repeats})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine more threads "
        "spin-wait on descheduled peers and every op slows down by orders of magnitude)",
    )


def setup_torch(args: argparse.Namespace) -> torch.device:
    threads = max(1, int(args.threads))
    torch.set_num_threads(threads)
    # An LLMEngine built with threads=None keeps OMP_NUM_THREADS rather than choosing.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return resolve_device(str(args.device))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """``min..max`` of the repetitions, to show the noise beside a median."""
    return f"{min(values):.3g}..{max(values):.3g}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(
    device: torch.device, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> tuple[T, float]:
    """``fn(*args, **kwargs)`` and its wall seconds (the device synchronised first and
    last, so queued kernels count)."""
    sync(device)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync(device)
    return result, time.perf_counter() - start


def run_engine(
    model: LlamaForCausalLM,
    config: SchedulerConfig,
    requests: Sequence[tuple[str, list[int], SamplingParams]],
    device: torch.device,
    prepare: Callable[[LLMEngine], None] | None = None,
) -> tuple[LLMEngine, list[FinishedRequest], float]:
    """A fresh engine for ``config`` around ``model`` generates ``requests``: the engine
    (its metrics), what finished and the wall seconds of ``generate``. ``prepare`` gets
    the engine first (to time its parts)."""
    engine = LLMEngine(config, model=model)
    if prepare is not None:
        prepare(engine)
    finished, wall = timed_call(device, engine.generate, requests)
    return engine, finished, wall


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (pastes straight into docs/benchmarks.md)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


class DrainLimit:
    """The step budget of a run whose requests arrive over time: until the last one has
    arrived its arrival step bounds the run; from then on ``drain_step_limit`` of the
    state then (past it the engine is stuck: ``EngineStalledError``, never a hang)."""

    def __init__(self) -> None:
        self.limit: int | None = None

    def check(self, step: int, all_arrived: bool, observe: Callable[[], SchedulerState]) -> None:
        if all_arrived and self.limit is None:
            self.limit = step + drain_step_limit(observe())
        if self.limit is not None and step >= self.limit:
            raise EngineStalledError(f"not drained within {self.limit} steps: {observe()}")
