"""A machine's derandomized stream does not depend on which modules the process imported.

Hypothesis draws some of its values from the literal constants of every local module
loaded, and tests/conftest.py pins that pool to every source file of the project before
the first draw (``pin_local_constants``; docs/stateful-testing.md, "Determinism"). Here
the scheduler machine runs small and derandomized as under ``ci`` (the ``mutation``
profile: no shrinking, no coverage assertion) in fresh pytest processes: its file
alone, and collected after tests/bench and tests/cli, which import every benchmark and
the CLI first. With the pin both give the same run; without it
(``KVSCHED_UNPINNED_CONSTANTS``) they do not, so the comparison can fail. Compared: the
run's report (examples, steps, drain and faulted steps, every coverage count), which
another stream changes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, UNPINNED_ENV
from tests.stateful.conftest import STATS_ENV

MACHINE = "tests/stateful/test_scheduler_differential.py"
#: Collected first: they import bench/ and kvsched's CLI, which the machine's module
#: alone does not, as a whole-suite run does.
OTHERS = ("tests/bench", "tests/cli")
#: Imported first as plugins (`-p`): benchmarks and commands the machine never imports,
#: whose literals an unpinned pool would take in (the CLI and bench.run_all import
#: them lazily, so collecting OTHERS alone may not).
EXTRA_MODULES = ("bench.scheduler_overhead", "bench.queue_scaling", "kvsched.commands")


def report(tmp_path: Path, *, others: bool, pinned: bool, examples: int = 20) -> str:
    """The machine's report from a fresh pytest process, its CPU time left out."""
    stats = tmp_path / f"{'others' if others else 'alone'}-{'pinned' if pinned else 'not'}"
    stats.mkdir()
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": "mutation",
        STATS_ENV: str(stats),
        "KVSCHED_STATEFUL_EXAMPLES": str(examples),
        "KVSCHED_STATEFUL_STEPS": "20",
    }
    env.pop(UNPINNED_ENV, None)
    if not pinned:
        env[UNPINNED_ENV] = "1"
    paths = [*OTHERS, MACHINE] if others else [MACHINE]
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    if others:
        command += [arg for module in EXTRA_MODULES for arg in ("-p", module)]
    proc = subprocess.run(
        [*command, *paths, "-k", "test_scheduler_differential"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = stats.glob("*.json")
    text: str = json.loads(path.read_text())["text"]
    return re.sub(r" in [\d.]+ CPU s = \d+ steps/CPU-s", "", text)


def test_stream_does_not_depend_on_the_imported_modules(tmp_path: Path) -> None:
    alone = report(tmp_path, others=False, pinned=True)
    assert report(tmp_path, others=True, pinned=True) == alone


def test_without_the_pin_it_does(tmp_path: Path) -> None:
    """The comparison above can fail: unpinned, the imports change the stream. 100
    examples: in 20 no draw took a constant from the grown pool (2026-12-02), in 100
    one does."""
    alone = report(tmp_path, others=False, pinned=False, examples=100)
    assert report(tmp_path, others=True, pinned=False, examples=100) != alone
