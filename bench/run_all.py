"""Run every benchmark in turn: ``python -m bench.run_all [--device cuda] [--quick]``.

Each script runs with ``--device`` (and ``--quick`` when given) and its own default
sizes; ``--device cuda`` trims the repetitions of the slowest ones so that the whole
run fits in about 8 minutes on one GPU. A script that fails is reported and the
others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable, Sequence

from bench import (
    async_overlap,
    kv_utilization,
    preemption_cost,
    prefix_caching,
    profile_step,
    queue_scaling,
    scheduler_overhead,
    seed_workload,
    speculative,
    startup,
    throughput,
)

Main = Callable[[Sequence[str] | None], int]

SCRIPTS: list[tuple[str, Main, list[str], list[str]]] = [
    # (name, main, extra arguments on CPU, extra arguments on CUDA)
    ("scheduler_overhead", scheduler_overhead.main, [], ["--repeats", "5"]),
    ("seed_workload", seed_workload.main, [], []),
    ("kv_utilization", kv_utilization.main, [], []),
    ("preemption_cost", preemption_cost.main, [], ["--repeats", "3"]),
    ("throughput", throughput.main, [], ["--repeats", "2"]),
    ("prefix_caching", prefix_caching.main, [], []),
    ("speculative", speculative.main, [], ["--repeats", "3"]),
    ("profile_step", profile_step.main, [], []),
    ("queue_scaling", queue_scaling.main, [], ["--repeats", "2"]),
    ("startup", startup.main, [], []),
    ("async_overlap", async_overlap.main, [], []),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated script names to run")
    args = parser.parse_args(argv)
    only = {name for name in args.only.split(",") if name}
    failed = []
    started = time.perf_counter()
    for name, script_main, cpu_args, cuda_args in SCRIPTS:
        if only and name not in only:
            continue
        script_args = ["--device", args.device]
        if args.quick:
            script_args.append("--quick")
        else:
            script_args += cuda_args if args.device.startswith("cuda") else cpu_args
        print(f"\n{'=' * 100}\n", flush=True)
        begin = time.perf_counter()
        try:
            status = script_main(script_args)
        except Exception:
            traceback.print_exc()
            status = 1
        print(
            f"\n[{name}: {'ok' if status == 0 else 'FAILED'} in "
            f"{time.perf_counter() - begin:.1f} s]",
            flush=True,
        )
        if status != 0:
            failed.append(name)
    print(f"\nall done in {time.perf_counter() - started:.1f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
