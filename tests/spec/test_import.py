"""``import spec`` must not import torch (nor anything heavy): the spec is pure Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_spec_does_not_import_torch() -> None:
    code = (
        "import sys, spec, spec.kv, spec.policies, spec.lifecycle, spec.scheduler, "
        "spec.invariants, spec.liveness, spec.oracle\n"
        "assert spec.__file__ is not None, 'spec resolved to a namespace package'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'numpy', 'safetensors', 'transformers', 'model', 'impl', 'kvsched'})\n"
        "print(','.join(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", result.stdout


def test_spec_sources_do_not_mention_the_engine() -> None:
    """The spec imports only itself and the standard library."""
    for path in sorted((ROOT / "spec").glob("*.py")):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")):
                module = stripped.split()[1]
                assert module.split(".")[0] not in {"torch", "impl", "model", "kvsched"}, (
                    f"{path.name}: {stripped}"
                )
