"""The README's examples as written: the Python example and the terminal commands, each
in a fresh process in an empty directory; and the name clash a user's own ``model.py``
(or ``spec.py``, ``impl.py``) makes, named by the import that fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _block(language: str, after: str) -> str:
    """The first fenced ``language`` block after the text ``after``."""
    start = README.index(after)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(README, start)
    assert match is not None, f"no {language} block after {after!r}"
    return match.group(1)


PYTHON_EXAMPLE = _block("python", "## Using it")
TERMINAL_COMMANDS = _block("bash", "From a terminal:")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # The project through PYTHONPATH, which comes after the working directory on
    # sys.path, as an installed package does.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_python_example(tmp_path: Path) -> None:
    result = _run([sys.executable, "-c", PYTHON_EXAMPLE], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["a", "b"]


@pytest.mark.parametrize("name", ["model", "spec"])
def test_python_example_names_a_clash(tmp_path: Path, name: str) -> None:
    own = tmp_path / f"{name}.py"
    own.write_text("VALUE = 1\n")
    result = _run([sys.executable, "-c", PYTHON_EXAMPLE], tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: name clash: {name!r} is {own}, not kvsched's package {ROOT / name}; "
        f"your own {name}.py (or {name}/) shadows it: rename it or run from elsewhere"
    )


def test_python_example_with_an_own_impl(tmp_path: Path) -> None:
    """``impl`` is the example's first import, so none of kvsched's code runs before it
    fails: Python's own message then names the shadowing file."""
    own = tmp_path / "impl.py"
    own.write_text("VALUE = 1\n")
    result = _run([sys.executable, "-c", PYTHON_EXAMPLE], tmp_path)
    assert result.returncode == 1
    assert f"cannot import name 'LLMEngine' from 'impl' ({own})" in result.stderr


@pytest.mark.parametrize("name", ["model", "spec", "impl"])
def test_cli_names_a_clash(tmp_path: Path, name: str) -> None:
    """``python -m kvsched`` puts the working directory first on sys.path too."""
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    result = _run([sys.executable, "-m", "kvsched", "--version"], tmp_path)
    assert result.returncode == 1
    assert f"ImportError: name clash: {name!r} is {tmp_path / name}.py" in result.stderr


def test_terminal_commands(tmp_path: Path) -> None:
    commands = [line for line in TERMINAL_COMMANDS.splitlines() if line.strip()]
    assert len(commands) == 7
    script = (
        "set -euo pipefail\n"
        f'kvsched() {{ "{sys.executable}" -m kvsched "$@"; }}\n' + TERMINAL_COMMANDS
    )
    result = _run(["bash", "-c", script], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "w.jsonl").read_text().count("\n") == 64
    assert (tmp_path / "kv.png").stat().st_size > 0
    assert '"requests"' in (tmp_path / "out.json").read_text()
    assert "conform: ok" in result.stdout
    assert (tmp_path / "shared.jsonl").read_text().count("\n") == 32
    assert "prefix cache: hit rate" in result.stdout
