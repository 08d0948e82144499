"""What the commands that run no model import: neither torch nor matplotlib.

Importing torch takes seconds (more on a loaded machine), so ``--version``, ``--help``,
a usage error, ``workload`` and every check of a workload file or an option that needs
no model must answer without it. Checked by the modules a fresh interpreter has loaded
after each command, not by a timing (docs/cli.md has the times, measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "matplotlib", "impl", "model", "rich")

PROBE = """
import contextlib, io, json, sys
from kvsched.cli import main
argv = json.loads(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(argv)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "heavy": heavy}))
"""


def _probe(*argv: str, cwd: Path) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(result.stdout)
    assert isinstance(answer, dict)
    return answer


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (("--version",), 0),
        (("--help",), 0),
        (("run", "--help"), 0),
        ((), 2),
        (("serve",), 2),
        (("run", "{w}", "--num-gpu-blocks", "0"), 2),
        (("run", "{d}/missing.jsonl"), 2),
        (("run", "{bad}"), 2),
        (("conform", "{w}", "--engine", "vllm", "--semantics", "nano-vllm"), 2),
        (("run", "{w}", "--plot", "{d}/kv.txt"), 2),
        (("workload", "--num-requests", "50", "-o", "{d}/out.jsonl"), 0),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v),
)
def test_no_model_no_torch(tmp_path: Path, argv: tuple[str, ...], code: int) -> None:
    good = tmp_path / "w.jsonl"
    good.write_text('{"id": "a", "prompt": [1, 2], "max_tokens": 2}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": [1, 2], "max_tokens": "2"}\n')
    args = [a.format(w=good, d=tmp_path, bad=bad) for a in argv]
    assert _probe(*args, cwd=tmp_path) == {"code": code, "heavy": []}


def test_the_probe_sees_torch_when_a_model_runs(tmp_path: Path) -> None:
    """The probe itself: a command that runs a model does import torch."""
    good = tmp_path / "w.jsonl"
    good.write_text('{"id": "a", "prompt": [1, 2], "max_tokens": 2}\n')
    answer = _probe("run", str(good), "--device", "cpu", cwd=tmp_path)
    assert answer["code"] == 0
    assert "torch" in answer["heavy"]  # type: ignore[operator]
