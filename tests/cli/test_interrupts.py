"""SIGINT and SIGTERM sent to a real ``kvsched`` process.

A run stops at a step boundary and keeps what it did: the ``--json`` document with
every request's state (finished, partial with its tokens, not started), the plot up to
that step, one line on stderr, exit 130 / 143. A second SIGINT ends the process at
once, even in the middle of a step. Outside a run a signal leaves nothing behind.

Each process's stderr is a pseudo-terminal, so that its progress bar says when the
run is under way (a signal sent before would stop the command before the run).
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsched.cli import main
from tests.cli.helpers import PNG_MAGIC

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 20_000  # minutes of work: every run here is stopped long before its end


class Process:
    """A child whose stderr is a pseudo-terminal read by a thread."""

    def __init__(self, argv: list[str], stdout: Path) -> None:
        leader, follower = pty.openpty()
        with stdout.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=follower,
            )
        os.close(follower)
        self._leader = leader
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._leader, 4096)
            except OSError:  # the terminal closed: the child has exited
                break
            if not chunk:
                break
            self._chunks.append(chunk)

    @property
    def err(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.err)
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"never printed {pattern!r}: {self.err[-2000:]}")

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        os.close(self._leader)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in started:
        p.kill()


@pytest.fixture(scope="module")
def big_workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "w.jsonl"
    assert main(["workload", "--num-requests", str(NUM_REQUESTS), "-o", str(path), "-q"]) == 0
    return path


def _kvsched(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvsched", *argv]


def _requests_done(p: Process, at_least: int) -> None:
    """Wait until the bar shows ``at_least`` requests done: the run is under way."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        done = [int(n) for n in re.findall(rf"(\d+)/{NUM_REQUESTS}\b", p.err)]
        if done and max(done) >= at_least:
            return
        assert p.proc.poll() is None, p.err[-2000:]
        time.sleep(0.05)
    raise AssertionError(f"the run never got going: {p.err[-2000:]}")


def test_sigint_keeps_what_finished(
    big_workload: Path, tmp_path: Path, processes: list[Process]
) -> None:
    png = tmp_path / "kv.png"
    out = tmp_path / "out.json"
    p = Process(_kvsched("run", str(big_workload), "--json", "--plot", str(png)), out)
    processes.append(p)
    _requests_done(p, 5)
    p.proc.send_signal(signal.SIGINT)
    assert p.finish() == 130
    doc = json.loads(out.read_text())
    steps = doc["metrics"]["steps"]
    assert doc["interrupted"] == {"signal": "SIGINT", "after_step": steps}
    requests = doc["requests"]
    assert len(requests) == NUM_REQUESTS
    by_state: dict[str, list[dict[str, object]]] = {}
    for r in requests:
        by_state.setdefault(str(r["state"]), []).append(r)
    assert set(by_state) == {"finished", "partial", "not_started"}
    assert len(by_state["finished"]) >= 5
    for r in by_state["finished"]:
        assert r["finish_reason"] in ("length", "stop") and r["output"]
    for r in by_state["partial"]:
        assert r["finish_reason"] is None and r["error"] is None
    for r in by_state["not_started"]:
        assert (r["finish_reason"], r["output"]) == (None, [])
    assert any(r["output"] for r in by_state["partial"])  # partial, with its tokens
    assert png.read_bytes()[:8] == PNG_MAGIC  # the plot up to that step
    assert "Traceback" not in p.err
    line = [s for s in p.err.splitlines() if "stopped by SIGINT" in s]
    assert len(line) == 1, p.err[-2000:]
    assert f"stopped by SIGINT after step {steps}: {len(by_state['finished'])} of " in line[0]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kv.png", "out.json"]


def test_sigterm_stops_conform_at_a_step(
    big_workload: Path, tmp_path: Path, processes: list[Process]
) -> None:
    out = tmp_path / "out.txt"
    p = Process(_kvsched("conform", str(big_workload)), out)
    processes.append(p)
    _requests_done(p, 1)
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 143
    verdict = out.read_text()
    assert re.fullmatch(
        r"conform: stopped by SIGTERM after step (\d+): spec and engine agree at all \1 "
        rf"steps so far \(\d+ of {NUM_REQUESTS} requests done; policy lifo, recompute mode\)\n",
        verdict,
    ), verdict
    assert "Traceback" not in p.err


SLOW_STEP = """
import sys, time
from impl.engine import LLMEngine
from kvsched.cli import main

step = LLMEngine.step

def slow(self):
    if self.metrics.steps == 3:
        print("in a long step", file=sys.stderr, flush=True)
        time.sleep(300)
    return step(self)

LLMEngine.step = slow
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_sigint_exits_at_once(
    big_workload: Path, tmp_path: Path, processes: list[Process]
) -> None:
    """The first SIGINT waits for the step to end; the second does not."""
    argv = [sys.executable, "-c", SLOW_STEP, "run", str(big_workload), "--json", "-q"]
    p = Process(argv, tmp_path / "out.json")
    processes.append(p)
    p.wait_for("in a long step")
    p.proc.send_signal(signal.SIGINT)
    time.sleep(1)
    assert p.proc.poll() is None  # still in its step
    sent = time.monotonic()
    p.proc.send_signal(signal.SIGINT)
    assert p.finish(timeout=30) == -signal.SIGINT
    assert time.monotonic() - sent < 30


def test_sigint_while_writing_a_workload_leaves_nothing(
    tmp_path: Path, processes: list[Process]
) -> None:
    target = tmp_path / "w.jsonl"
    argv = _kvsched("workload", "--num-requests", "1000000", "-o", str(target))
    p = Process(argv, tmp_path / "stdout")
    processes.append(p)
    p.wait_for(r"kvsched workload.*[1-9]\d*/2000000")
    p.proc.send_signal(signal.SIGINT)
    assert p.finish() == 130
    last = p.err.rstrip().splitlines()[-1]  # after the escape codes that erase the bar:
    assert last.endswith("\x1b[2Kkvsched: interrupted by SIGINT (nothing written)"), last
    assert sorted(f.name for f in tmp_path.iterdir()) == ["stdout"]
