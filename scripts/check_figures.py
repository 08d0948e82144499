"""The figures docs/checks.md gives for ``scripts/check``, measured: run it and print them.

``python scripts/check_figures.py`` times ``./scripts/check --quick``; ``--full`` times
``CI=true ./scripts/check`` (what CI runs) instead. Printed: the date, the load average
before and after (the machine is shared: these times scale with its load), the wall
time, pytest's share and its counts (passed, skipped ...), and whether the output
holds a line that reads like a failure although the check passed ("NOT REACHED",
"FAILED", "Error", a traceback), each with the lines around it. The whole output is
kept in ``--log`` (default check-figures.log in the temporary directory). Add the
figures to docs/checks.md, "Timings", with the load.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALARMING = re.compile(r"NOT REACHED|FAILED|Traceback|^E  |\bError\b", re.M)
PYTEST_SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ passed[^=]*?) in (?P<seconds>[\d.]+)s", re.M)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="CI=true ./scripts/check")
    default_log = Path(tempfile.gettempdir()) / "check-figures.log"
    parser.add_argument("--log", type=Path, default=default_log, help="the whole output")
    args = parser.parse_args()
    command = ["./scripts/check"] if args.full else ["./scripts/check", "--quick"]
    env = {**os.environ, "CI": "true"} if args.full else dict(os.environ)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    before = load()
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    output = result.stdout + result.stderr
    args.log.write_text(output)
    summary = PYTEST_SUMMARY.search(output)
    print(f"{' '.join(command)}{' (CI=true)' if args.full else ''}: exit {result.returncode}")
    print(f"date: {now}; {os.cpu_count()} CPUs; load average before {before}, after {load()}")
    print(f"wall: {wall:.0f} s ({wall / 60:.1f} min)")
    if summary is not None:
        print(f"pytest: {summary['counts'].strip()} in {float(summary['seconds']):.0f} s")
    lines = output.splitlines()
    alarming = [i for i, line in enumerate(lines) if ALARMING.search(line)]
    if result.returncode == 0:
        print(f"lines that read like a failure in a passing run: {len(alarming)}")
    for i in alarming[:20]:
        print(f"  line {i + 1}:")
        for line in lines[max(i - 2, 0) : i + 4]:
            print(f"    {line}")
    print(f"whole output: {args.log}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
