"""A campaign worker: one pytest process that runs the stateful machines in turn until a
deadline (``python -m pytest -p tests.campaign.worker ...``, started by scripts/campaign).

It keeps, of the collected tests, the *machine tests*: those that run a machine through
``tests.stateful.harness.run_machine`` (every differential and peer machine, found
by what the test calls, not by its name, so a new machine joins the campaign by being
a machine test). Then it runs them round-robin, each for a time slice, starting at its
own place so that the workers of a machine start on different machines. A slice is one
or more *runs* of the test, each with its own seed (``KVSCHED_STATEFUL_SEED``, drawn
from the worker's seed) and the examples (``KVSCHED_STATEFUL_EXAMPLES``) that the
machine's rate so far says take ``RUN_SECONDS``; the campaign profile gives each run the
shared database, so every run starts by replaying what any worker saved there.

A machine that fails leaves the rotation (its failure is in the database; every other
worker replays it at its next run of that machine, fails too, and drops it as well); a
skipped one (a peer not installed) leaves it with its reason. Progress goes to the
worker's JSON file (tests/campaign/progress.py).

A replay (``KVSCHED_CAMPAIGN_REPLAY``) runs the named tests once each, the default way,
reporting only the examples it replayed.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path
from typing import Final

import pytest

from tests.campaign import environment, progress
from tests.stateful.harness import run_machine

#: The examples of a machine's first run, before its rate is known.
FIRST_RUN_EXAMPLES: Final = 3
#: How long a run is sized to take (see ``Worker.run_slice``).
RUN_SECONDS: Final = 15.0
#: Do not start a run in the last second of a slice.
MIN_RUN_SECONDS: Final = 1.0
#: The automatic slice: every machine gets a turn in a finite campaign, within these.
SLICE_SECONDS: Final = (10.0, 60.0)

INVARIANT: Final = re.compile(r"InvariantViolation: \[[a-z_]+\][^\n]*")
ERROR_LINE: Final = re.compile(r"^E\s+(\S.*)$", re.MULTILINE)


def is_machine_test(item: pytest.Item) -> bool:
    """Whether ``item`` runs a state machine through the harness."""
    return isinstance(item, pytest.Function) and (
        run_machine.__name__ in item.function.__code__.co_names
    )


def failure_summary(text: str) -> str:
    """The line that says what failed: the invariant, else pytest's last ``E`` line."""
    found = INVARIANT.search(text)
    if found:
        return found.group(0)[:300]
    lines = ERROR_LINE.findall(text)
    return lines[-1][:300] if lines else text.strip().splitlines()[-1][:300]


class Worker:
    def __init__(self) -> None:
        self.index = int(os.environ.get(environment.WORKER) or 0)
        self.seed = int(os.environ.get(environment.SEED) or random.SystemRandom().getrandbits(63))
        self.random = random.Random(self.seed)
        deadline = os.environ.get(environment.DEADLINE)
        self.deadline = float(deadline) if deadline else float("inf")
        slice_seconds = os.environ.get(environment.SLICE)
        self.slice = float(slice_seconds) if slice_seconds else None
        self.workers = int(os.environ.get(environment.WORKERS) or 1)
        self.replay = bool(os.environ.get(environment.REPLAY))
        self.outcome = "passed"  # of the last run: passed, failed or skipped
        self.progress = progress.start(
            Path(os.environ[environment.STATS]),
            {
                "worker": self.index,
                "seed": self.seed,
                "revision": os.environ.get(environment.REVISION),
                "replay": self.replay,
            },
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        others = [item for item in items if not is_machine_test(item)]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if is_machine_test(item)]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        if self.replay or session.config.option.collectonly:
            return None  # pytest's own loop: each test once
        if session.testsfailed:
            raise session.Interrupted(f"{session.testsfailed} errors during collection")
        rotation = list(session.items)
        turn = self.index * len(rotation) // self.workers  # the workers spread out
        slice_seconds = self.slice or self.auto_slice(len(rotation))
        while rotation and self.deadline - time.time() > MIN_RUN_SECONDS:
            item = rotation[turn % len(rotation)]
            if self.run_slice(item, min(slice_seconds, self.deadline - time.time())):
                turn += 1
            else:
                rotation.remove(item)
        self.progress.ended = "finished"
        return True

    def auto_slice(self, machines: int) -> float:
        """Long enough to amortise a run's start, short enough that in a finite campaign
        the workers together give every machine a turn."""
        low, high = SLICE_SECONDS
        share = (self.deadline - time.time()) * self.workers / max(machines, 1)
        return max(low, min(high, share))

    def run_slice(self, item: pytest.Item, seconds: float) -> bool:
        """Run ``item`` for about ``seconds``; whether it passed every run.

        Each run gets the examples that the machine's rate so far (in this worker) says
        fill ``RUN_SECONDS`` or what is left of the slice: examples vary a lot in size,
        so short runs keep the overrun of a slice, and of the deadline, short.
        """
        end = time.time() + seconds
        ran = False
        while not ran or end - time.time() > MIN_RUN_SECONDS:
            rate = self.progress.rate(item.nodeid)
            target = min(end - time.time(), RUN_SECONDS)
            examples = FIRST_RUN_EXAMPLES if rate is None else max(1, int(rate * target))
            os.environ["KVSCHED_STATEFUL_EXAMPLES"] = str(examples)
            os.environ["KVSCHED_STATEFUL_SEED"] = str(self.random.getrandbits(63))
            self.progress.nodeid = item.nodeid
            self.progress.take_last()
            item.ihook.pytest_runtest_protocol(item=item, nextitem=None)
            if self.outcome != "passed":
                return False
            last = self.progress.take_last()
            if last is None or not last.examples:
                break  # the test ran no machine example: nothing to size on
            ran = True
        return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "setup" and report.passed:
            self.outcome = "passed"
        if report.skipped:
            self.outcome = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            self.progress.skipped[report.nodeid] = str(reason)
        elif report.failed:
            self.outcome = "failed"
            self.progress.failure(report.nodeid, failure_summary(report.longreprtext))

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        if self.progress.ended is None:  # stopped by Ctrl-C, the campaign, or an error
            interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
            self.progress.ended = "interrupted" if interrupted else f"pytest exit {exitstatus}"
        self.progress.write()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(environment.STATS):
        config.pluginmanager.register(Worker(), "kvsched-campaign-worker")
