"""The wall between spec and engine is a tool: ``lint-imports`` fails on a forbidden import.

The contracts are in pyproject.toml (``[tool.importlinter]``). Each test copies the
packages to a temporary directory, plants one forbidden import there (the checkout is
never touched) and runs ``lint-imports`` on the copy: it must exit non-zero and name
the broken contract. The unplanted copy must pass, or the failures would mean nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("spec", "impl", "model", "kvsched")
IMPL_CONTRACT = "impl and model import only spec.types from the spec"
SPEC_CONTRACT = "the spec imports nothing of impl, model, kvsched or torch"


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("lint-imports")
    command = [str(script)] if script.exists() else ["lint-imports"]
    return subprocess.run(
        [*command, "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # planted\n")


def test_the_tree_keeps_both_contracts(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("impl/plan.py", "from spec.scheduler import step", IMPL_CONTRACT),
        ("impl/scheduler.py", "import spec", IMPL_CONTRACT),
        ("model/llama.py", "from spec.policies import get_policy", IMPL_CONTRACT),
        ("spec/kv.py", "import torch", SPEC_CONTRACT),
        ("spec/types.py", "from impl.sequence import Sequence", SPEC_CONTRACT),
    ],
)
def test_a_planted_forbidden_import_fails_with_the_contract_name(
    tree: Path, module: str, line: str, contract: str
) -> None:
    plant(tree / module, line)
    result = lint_imports(tree)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout + result.stderr
