"""``kvsched conform --emit-repro``: the script it writes is docs/repros/'s, and fails alone.

Each case runs the command in its script's docstring (nano-vllm here, vLLM V0 in its own
environment through the subprocess protocol), checks that the shrunk script it writes is
the one checked in (so the docs' scripts are what the code writes today), and runs it as
a maintainer would: outside the repository, without kvsched, failing with its property.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import Invoke
from tests.peers.conftest import require_peer, require_peer_venv

ROOT = Path(__file__).resolve().parents[2]
REPROS = ROOT / "tests/peers/repros"

#: script -> (engine, conform's arguments after the workload, its failure line).
CASES = {
    "n12_full_hit_prefill.py": (
        "nano-vllm",
        ("prefix_hit.jsonl", "--num-gpu-blocks", "8", "--block-size", "4"),
        "FAILED at step 0: request r1 is prefilled with 0 tokens",
    ),
    "v0_5_swap_space.py": (
        "vllm-v0",
        (
            "seed.jsonl", "--num-gpu-blocks", "20", "--block-size", "1", "--max-num-seqs",
            "8", "--preemption-mode", "swap", "--num-cpu-blocks", "20",
        ),
        "FAILED at step 7: schedule() raised RuntimeError: Aborted due to the lack of CPU",
    ),
}  # fmt: skip


def without_command(text: str) -> str:
    """The script but the line naming the command that wrote it (paths differ here)."""
    return "\n".join(line for line in text.splitlines() if "--emit-repro" not in line)


def interpreter(engine: str) -> str:
    if engine == "vllm-v0":
        return str(require_peer_venv(engine))
    require_peer(engine)
    return sys.executable


@pytest.mark.parametrize("script", sorted(CASES))
def test_emit_repro_writes_the_script_docs_repros_holds(
    script: str, invoke: Invoke, tmp_path: Path
) -> None:
    engine, (workload, *options), failure = CASES[script]
    python = interpreter(engine)
    out = tmp_path / script
    result = invoke(
        "conform", "--engine", engine, str(REPROS / workload), *options, "--emit-repro", str(out)
    )
    assert result.code == 1, result  # the divergence
    assert f"wrote {out} (" in result.err, result
    text = out.read_text()
    assert without_command(text) == without_command((ROOT / "docs/repros" / script).read_text())
    assert f"--emit-repro {out}" in text  # the command as typed, not the test runner's
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [python, str(out)], check=False, capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr[-2000:]
    assert failure in ran.stdout, ran.stdout


def test_emit_repro_needs_a_peer(invoke: Invoke, tmp_path: Path) -> None:
    result = invoke("conform", str(REPROS / "seed.jsonl"), "--emit-repro", str(tmp_path / "r.py"))
    assert result.code == 2
    assert result.err.strip() == (
        "kvsched: --emit-repro writes a script that drives a peer; use --engine"
    )
    assert not (tmp_path / "r.py").exists()


def test_emit_repro_without_a_divergence_writes_nothing(invoke: Invoke, tmp_path: Path) -> None:
    """The seed workload in a pool it fits (no preemption, so no N5): nano-vllm agrees."""
    require_peer("nano-vllm")
    out = tmp_path / "r.py"
    result = invoke(
        "conform", "--engine", "nano-vllm", str(REPROS / "seed.jsonl"), "--num-gpu-blocks",
        "64", "--block-size", "2", "--emit-repro", str(out),
    )  # fmt: skip
    assert result.code == 0, result
    assert "no divergence, nothing written" in result.err
    assert not out.exists()
