"""A campaign worker's progress, read live from each machine run's ``RunRecord``.

``harness.run_machine`` runs every machine inside ``watched(name, record)``. In a
campaign worker (``start`` was called: tests/campaign/worker.py) a thread writes what
the worker has checked so far to its JSON file every second: per machine the examples
and differential steps of its finished runs plus the running one's ``record.stats``
(the counters the machines keep anyway), the failures, the process's CPU time. The
campaign (tests/campaign/run.py) reads those files for its progress lines and report.
Anywhere else ``watched`` does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.stateful.coverage import RunRecord

INTERVAL = 1.0  # seconds between two writes of the file


@dataclass
class MachineTotals:
    nodeid: str
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0  # wall time inside the machine's runs
    cpu_seconds: float = 0.0  # this process's CPU time inside them
    runs: int = 0

    def plus(self, live: Live) -> MachineTotals:
        """These totals with ``live``'s run (so far) added."""
        stats = live.record.stats
        return MachineTotals(
            self.nodeid,
            self.examples + stats.examples,
            self.steps + stats.steps,
            self.seconds + time.time() - live.started,
            self.cpu_seconds + time.process_time() - live.cpu_started,
            self.runs + 1,
        )


@dataclass
class Live:
    name: str
    record: RunRecord
    started: float
    cpu_started: float


@dataclass(frozen=True)
class LastRun:
    name: str
    examples: int
    steps: int
    seconds: float


@dataclass
class Progress:
    path: Path
    info: dict[str, object]  # worker index, seed, revision: written as they are
    started: float = field(default_factory=time.time)
    machines: dict[str, MachineTotals] = field(default_factory=dict)
    failures: list[dict[str, object]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # nodeid -> reason
    nodeid: str = ""  # the test item running now
    live: Live | None = None
    last: LastRun | None = None
    ended: str | None = None  # "finished" (its loop ran out), or how pytest ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, name: str, record: RunRecord) -> None:
        with self.lock:
            self.live = Live(name, record, time.time(), time.process_time())

    def end(self) -> None:
        """Fold the running machine's counts into its totals."""
        with self.lock:
            live, self.live = self.live, None
            assert live is not None
            totals = self.machines.get(live.name, MachineTotals(self.nodeid))
            self.machines[live.name] = totals.plus(live)
            stats = live.record.stats
            seconds = time.time() - live.started
            self.last = LastRun(live.name, stats.examples, stats.steps, seconds)

    def rate(self, nodeid: str) -> float | None:
        """Examples per second of the test ``nodeid``'s machine so far (None: not run yet)."""
        with self.lock:
            for totals in self.machines.values():
                if totals.nodeid == nodeid and totals.seconds > 0:
                    return totals.examples / totals.seconds
            return None

    def take_last(self) -> LastRun | None:
        """The machine run that ended last (since the previous call), if any."""
        with self.lock:
            last, self.last = self.last, None
            return last

    def failure(self, nodeid: str, summary: str) -> None:
        """Record a failed run of the test ``nodeid`` (its machine: the last one run)."""
        with self.lock:
            last = self.last
            self.failures.append(
                {
                    "machine": last.name if last is not None else nodeid,
                    "nodeid": nodeid,
                    "summary": summary,
                    "seconds": time.time() - self.started,
                    # The failing run: a long one found and shrank it; one that fails
                    # at once usually replayed it from the database.
                    "run_examples": last.examples if last is not None else 0,
                    "run_seconds": last.seconds if last is not None else 0.0,
                }
            )

    def snapshot(self) -> dict[str, object]:
        with self.lock:
            machines = dict(self.machines)
            live = self.live
            if live is not None:
                machines[live.name] = machines.get(live.name, MachineTotals(self.nodeid)).plus(live)
            return {
                **self.info,
                "pid": os.getpid(),
                "started": self.started,
                "updated": time.time(),
                "cpu_seconds": time.process_time(),
                "current": live.name if live is not None else None,
                "nodeid": self.nodeid,  # the test running now (or last)
                "machines": {name: asdict(t) for name, t in machines.items()},
                "failures": list(self.failures),
                "skipped": dict(self.skipped),
                "ended": self.ended,
            }

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        tmp.replace(self.path)  # a reader never sees half a file

    def keep_writing(self) -> None:
        while self.ended is None:
            self.write()
            time.sleep(INTERVAL)


_progress: Progress | None = None


def start(path: Path, info: dict[str, object]) -> Progress:
    """Make this process a campaign worker that reports to ``path``."""
    global _progress  # noqa: PLW0603  (one worker per process)
    _progress = Progress(path, info)
    threading.Thread(target=_progress.keep_writing, daemon=True).start()
    return _progress


@contextmanager
def watched(name: str, record: RunRecord) -> Iterator[None]:
    """Count ``record`` into the campaign's progress while the machine runs (if any)."""
    progress = _progress
    if progress is None:
        yield
        return
    progress.begin(name, record)
    try:
        yield
    finally:
        progress.end()
