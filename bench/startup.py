"""How long the commands that run no model take to answer, each in a fresh process.

``kvsched --version``, ``--help``, a usage error, an option the command line refuses,
a bad workload file and ``kvsched workload`` import neither torch nor matplotlib
(tests/cli/test_fast_start.py checks the modules); this times them as a user meets
them: the console script's ``python -m kvsched`` equivalent from process start to
exit, median of ``--repeats`` runs, the load average beside it (these figures are
start-up costs: on a loaded 2-core machine they scale with the load). For scale, the
last row imports torch and the model and runs a one-request workload.

``--baseline TREE`` times the same commands, interleaved, from another source tree
(``git archive COMMIT | tar -x -C TREE``; run through ``PYTHONPATH``), for a before
and after in one run.

Usage: ``python -m bench.startup [--quick] [--repeats 5] [--baseline TREE]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench._common import (
    add_common_args,
    command_line,
    load_average,
    machine_lines,
    markdown_table,
    median,
    spread,
)

CASES: list[tuple[str, list[str], int]] = [
    ("kvsched --version", ["--version"], 0),
    ("kvsched --help", ["--help"], 0),
    ("kvsched run --help", ["run", "--help"], 0),
    ("kvsched serve (usage error)", ["serve"], 2),
    ("kvsched run w.jsonl --num-gpu-blocks 0", ["run", "{w}", "--num-gpu-blocks", "0"], 2),
    ("kvsched run bad.jsonl (line 1 bad)", ["run", "{bad}"], 2),
    ("kvsched workload -o out.jsonl (16 requests)", ["workload", "-o", "{o}"], 0),
    ("kvsched workload --num-requests 1000 -o out.jsonl", ["workload", "--num-requests", "1000", "-o", "{o}"], 0),  # noqa: E501
    ("kvsched run w.jsonl (torch, the model, 1 request)", ["run", "{w}", "--device", "{device}"], 0),  # noqa: E501
]  # fmt: skip


def time_command(argv: list[str], expected: int, cwd: str, tree: str | None = None) -> float:
    """Seconds ``python -m kvsched ARGV`` takes, run in ``cwd`` (``-m`` puts the working
    directory first on ``sys.path``: not a source tree, so ``tree`` or the installed
    package is what runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tree is not None:
        env["PYTHONPATH"] = tree
    start = time.perf_counter()
    code = subprocess.run(
        [sys.executable, "-m", "kvsched", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode
    seconds = time.perf_counter() - start
    if code != expected:
        raise SystemExit(f"kvsched {' '.join(argv)}: exit {code}, expected {expected}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=5)  # --quick: one run of each, no model run
    parser.add_argument("--baseline", metavar="TREE", help="also time this source tree")
    args = parser.parse_args(argv)
    trees: list[str | None] = [None] if args.baseline is None else [None, args.baseline]
    repeats = 1 if args.quick else max(1, args.repeats)
    cases = CASES[:-1] if args.quick else CASES
    print("# kvsched start-up: commands that run no model")
    print(f"command: python -m {' '.join(command_line('bench.startup', argv))}")
    for line in machine_lines():
        print(line)
    print()
    with tempfile.TemporaryDirectory() as tmp:
        good = Path(tmp) / "w.jsonl"
        good.write_text('{"id": "a", "prompt": [1, 2, 3], "max_tokens": 2}\n')
        bad = Path(tmp) / "bad.jsonl"
        bad.write_text('{"id": "a", "prompt": [1, 2, 3], "max_tokens": "2"}\n')
        out = str(Path(tmp) / "out.jsonl")
        times: dict[tuple[str, str | None], list[float]] = {}
        loads = [load_average()]
        for _ in range(repeats):  # interleaved: each round runs every command once
            for name, template, expected in cases:
                command = [a.format(w=good, bad=bad, o=out, device=args.device) for a in template]
                for tree in trees:
                    seconds = time_command(command, expected, tmp, tree)
                    times.setdefault((name, tree), []).append(seconds)
            loads.append(load_average())
    headers = ["command", "median s", "min..max"]
    if args.baseline is not None:
        headers += ["baseline median s", "baseline min..max"]
    rows = []
    for name, _, _ in cases:
        row = [name]
        for tree in trees:
            t = times[name, tree]
            row += [f"{median(t):.2f}", spread(t)]
        rows.append(row)
    print(f"wall seconds from process start to exit, median of {repeats} (min..max)")
    print(markdown_table(headers, rows))
    print(f"load average (1, 5, 15 min) before and after each round: {'; '.join(loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
