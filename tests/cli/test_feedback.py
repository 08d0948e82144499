"""What the commands tell the user besides their results: --version, notices of files
written, progress bars on a terminal only, and the plot's markers."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from matplotlib.container import BarContainer

from kvsched.cli import main
from kvsched.drive import head_blocks_needed
from kvsched.plot import timeline_figure
from kvsched.results import RunMetrics, RunResult, StepSample
from spec.types import SchedulerConfig
from tests.cli.helpers import Invoke, WriteWorkload

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"id": "a", "prompt": [1, 2, 3], "max_tokens": 2}


def test_version(invoke: Invoke) -> None:
    result = invoke("--version")
    assert (result.code, result.out, result.err) == (0, f"kvsched {version('kvsched')}\n", "")


def test_workload_reports_the_file_it_wrote(invoke: Invoke, tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    result = invoke("workload", "--num-requests", "5", "-o", str(out))
    assert (result.code, result.out) == (0, "")
    assert result.err == f"kvsched: wrote {out} (5 requests)\n"
    assert len(out.read_text().splitlines()) == 5
    quiet = invoke("workload", "--num-requests", "5", "-o", str(out), "-q")
    assert (quiet.code, quiet.out, quiet.err) == (0, "", "")


def test_run_reports_the_plot_it_wrote_after_the_results(
    invoke: Invoke, write_workload: WriteWorkload, tmp_path: Path
) -> None:
    png = tmp_path / "kv.png"
    result = invoke("run", str(write_workload([GOOD])), "--json", "--plot", str(png))
    assert result.code == 0
    assert json.loads(result.out)["metrics"]["steps"] == 2
    assert result.err == f"kvsched: wrote {png} (KV timeline, 2 steps)\n"


def _on_a_terminal(*argv: str) -> tuple[int, str]:
    """``python -m kvsched ARGV`` with stderr on a pseudo-terminal: exit code, stderr."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsched", *argv],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"},
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the child has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", ["run", "conform", "demo", "workload"])
def test_progress_on_a_terminal_only(
    write_workload: WriteWorkload,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
) -> None:
    argv = {
        "run": ["run", str(write_workload([GOOD]))],
        "conform": ["conform", str(write_workload([GOOD]))],
        "demo": ["demo"],
        "workload": ["workload", "--num-requests", "1500", "-o", str(tmp_path / "w.jsonl")],
    }[command]
    for quiet in (False, True):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main([*argv, *(["-q"] if quiet else [])]) == 0
        drawn = terminal.getvalue()
        assert (f"kvsched {command}" in drawn) is not quiet, drawn
        if command == "workload":  # no notice with -q; a notice beside the bar without
            assert ("wrote" in drawn) is not quiet


def test_progress_on_a_real_terminal() -> None:
    """The same through a pseudo-terminal and a real process (rich's own tty check)."""
    workload = ROOT / "tests" / "cli" / "data" / "two.jsonl"
    code, err = _on_a_terminal("run", str(workload))
    assert code == 0
    assert "kvsched run" in err


def test_quiet_in_a_pipe(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = str(write_workload([GOOD]))
    for argv in (["run", path], ["conform", path], ["demo"]):
        result = invoke(*argv)  # captured: not a terminal
        assert (result.code, result.err) == (0, "")


def _sample(
    step: int, used: int, modes: tuple[str, ...] = (), need: int | None = None
) -> StepSample:
    return StepSample(
        step=step,
        gpu_blocks_used=used,
        num_running=1,
        num_waiting=1 if need else 0,
        num_swapped=0,
        num_preempted=len(modes),
        preempted_modes=modes,
        head_blocks_needed=need,
    )


def test_plot_marks_modes_apart_and_the_head_that_does_not_fit() -> None:
    timeline = (
        _sample(0, 3, need=2),  # 3 + 2 <= 8: it fits, no bar
        _sample(1, 6, ("swap", "swap"), need=5),  # 6 + 5 > 8: the bar
        _sample(2, 7, ("recompute",)),
        _sample(3, 2),
    )
    metrics = RunMetrics(
        steps=4,
        preemptions=3,
        swap_out_blocks=2,
        swap_in_blocks=2,
        recomputed_tokens=1,
        peak_gpu_blocks_used=7,
        num_gpu_blocks=8,
        kv_utilization=0.5,
        tokens_per_s=1.0,
    )
    fig = timeline_figure(RunResult(outcomes=(), metrics=metrics, timeline=timeline))
    kv = fig.axes[0]
    legend = kv.get_legend()
    assert legend is not None
    labels = [t.get_text() for t in legend.get_texts()]
    assert "swap preemption (2)" in labels
    assert "recompute preemption (1)" in labels
    assert not any("restart" in label for label in labels)
    assert any(label.startswith("waiting head's prefill") for label in labels)
    (bars,) = kv.containers
    assert isinstance(bars, BarContainer)
    assert [(p.get_x(), p.get_y(), p.get_height()) for p in bars.patches] == [(1, 6, 5)]


def test_head_blocks_needed() -> None:
    chunked = SchedulerConfig(num_gpu_blocks=8, block_size=4, max_num_batched_tokens=6)
    assert head_blocks_needed(chunked, 10) == 2  # chunked: min(10, budget 6) tokens, 2 blocks
    unchunked = SchedulerConfig(num_gpu_blocks=8, block_size=4, enable_chunked_prefill=False)
    assert head_blocks_needed(unchunked, 10) == 3  # the whole prompt: 10 tokens, 3 blocks
