"""The stateful suite's pytest glue: the ``slow`` marker and the coverage/throughput summary.

Each machine test writes its report (coverage counts, differential steps per CPU
second) as JSON into ``$KVSCHED_STATEFUL_STATS``; the summary at the end of the run
prints them, also under pytest-xdist (the directory is chosen by the controller,
before the workers start, and inherited by them). Run ``pytest tests/stateful`` to
see it (the controller loads this file when tests/stateful is on the command line).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

STATS_ENV = "KVSCHED_STATEFUL_STATS"
SLOW_ENV = "KVSCHED_RUN_SLOW"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"slow: long runs, skipped unless {SLOW_ENV}=1 (e.g. the full mutation table)"
    )
    if not hasattr(config, "workerinput") and STATS_ENV not in os.environ:
        os.environ[STATS_ENV] = tempfile.mkdtemp(prefix="kvsched-stateful-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SLOW_ENV):
        return
    skip = pytest.mark.skip(reason=f"slow: set {SLOW_ENV}=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if hasattr(config, "workerinput"):
        return
    directory = os.environ.get(STATS_ENV)
    if not directory or not Path(directory).is_dir():
        return
    reports = sorted(Path(directory).glob("*.json"))
    if not reports:
        return
    terminalreporter.section("stateful differential suite: coverage and throughput")
    for path in reports:
        terminalreporter.write_line(json.loads(path.read_text())["text"])
