"""The suite has teeth: ``scripts/mutation_check.py`` plants known bugs; each must be caught
for its recorded reason (the invariant named in the mutant's ``expect``).

The fast test (in CI) runs the quick subset (``--quick``: one or two mutants per area,
two of them common-mode) against the machines that run the mutated code, fast machine
first: ``SchedulerDifferential`` for the scheduler, block manager and policies,
``EngineDifferential`` for the engine's own code (and for anything the fast machine
misses). The slow test runs every mutant, for the full table (docs/stateful-testing.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mutation_check.py"


def run_check(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "mutation.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    print(proc.stdout)
    assert out.exists(), proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["caught"] == result["total"]
    return result


def test_quick_mutants_are_caught_for_their_reason(tmp_path: Path) -> None:
    result = run_check(tmp_path, "--quick")
    assert result["common_mode"] >= 2


@pytest.mark.slow
def test_full_mutation_table(tmp_path: Path) -> None:
    """Every mutant, one job (the table is printed; a mutant only has to be caught by
    one machine, for its recorded reason)."""
    result = run_check(tmp_path, "--jobs", "1")
    assert result["total"] >= 40
    assert result["common_mode"] >= 6
