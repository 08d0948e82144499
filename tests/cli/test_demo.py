"""``kvsched demo``: the seed's workload, the typed KV-exhausted error, every mode completes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from kvsched.demo import seed_workload
from tests.cli.helpers import Invoke
from tests.impl.helpers import SEED_FIGURES

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The table's figures per mode: steps, preemptions, tokens sampled, recomputed tokens,
#: swapped out and in (blocks), as docs/benchmarks.md has them.
DEMO_ROWS = {
    str(mode): (
        f.steps,
        sum(f.preemptions_by_mode.values()),
        f.sampled_tokens,
        f.recomputed_tokens,
        *f.swap_blocks,
    )
    for mode, f in SEED_FIGURES.items()
}


def test_seed_workload_is_the_tutorials() -> None:
    workload = seed_workload()
    assert len(workload) == 8
    # torch.manual_seed(42); torch.randint(1, 255, (5,)) -- the seed's first two prompts
    assert workload[0].prompt == (171, 68, 149, 137, 201)
    assert workload[1].prompt == (160, 243, 105, 25, 202)
    assert all(len(r.prompt) == 5 and all(1 <= t <= 254 for t in r.prompt) for r in workload)
    assert all(r.params.max_tokens == 8 and r.params.ignore_eos for r in workload)


def _row(out: str, mode: str) -> tuple[int, ...] | None:
    """The figures of the table's row for ``mode`` (None if no row reads as one)."""
    row = rf"^kvsched {mode} +(\d+) +(\d+) +(\d+)/64 +(\d+) +(\d+)/(\d+) +8/8 +yes *$"
    found = re.search(row, out, re.M)
    return None if found is None else tuple(int(g) for g in found.groups())


def test_demo(invoke: Invoke) -> None:
    result = invoke("demo")
    assert result.code == 0
    assert result.err == ""
    out = result.out
    exhausted = [line for line in out.splitlines() if "KVCacheExhaustedError" in line]
    assert len(exhausted) == 1
    assert "KV cache exhausted: used 20, needed 1, capacity 20 blocks" in exhausted[0]
    assert "preemption:    8 of 8 requests completed (recompute: 12 preemptions in 34 steps)" in out
    assert {mode: _row(out, mode) for mode in DEMO_ROWS} == DEMO_ROWS, out
    assert re.search(r"^seed tutorial +58 +39 +132/64 ", out, re.M)
    # Deterministic: nothing in it depends on timing.
    assert "/s" not in out


def test_python_m_kvsched_prints_the_same_demo(invoke: Invoke) -> None:
    """``python -m kvsched demo`` in a subprocess: byte for byte the in-process output.

    (So the demo is deterministic across processes.) The ``kvsched`` console script
    runs the same ``main``: its entry point is checked to name it.
    """
    (script,) = entry_points(group="console_scripts", name="kvsched")
    assert script.value == "kvsched.cli:main"
    in_process = invoke("demo").out
    completed = subprocess.run(
        [sys.executable, "-m", "kvsched", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert (completed.returncode, completed.stderr) == (0, "")
    assert completed.stdout == in_process
