"""The stateful differential machines as HypoFuzz targets (``scripts/fuzz``).

HypoFuzz fuzzes the Hypothesis tests that pytest collects; a state machine is one when
it is exposed as its ``TestCase`` (``tests/stateful`` runs the machines through
``run_machine`` instead, which sizes and reports the run, and HypoFuzz does not see
those). This module is not a ``test_*`` file, so a plain pytest run does not collect it;
``scripts/fuzz`` names it.

Each worker also writes how many differential steps it has checked (the machine's
``record.stats``, ``tests/stateful/coverage.py``) to
``$KVSCHED_FUZZ_STATS/<machine>-<pid>.json`` after every example, so that
``scripts/fuzz`` can report steps per second over all workers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hypothesis import settings

from tests.stateful.coverage import RunStats
from tests.stateful.machine import LockstepMachine
from tests.stateful.sizes import SUPPRESSED
from tests.stateful.subjects.scheduler import SCHEDULER

_STARTED = time.monotonic()


def record_throughput(machine: str, stats: RunStats) -> None:
    """Write this worker's step count (if ``KVSCHED_FUZZ_STATS`` names a folder)."""
    folder = os.environ.get("KVSCHED_FUZZ_STATS")
    if not folder:
        return
    record = {
        "machine": machine,
        "pid": os.getpid(),
        "examples": stats.examples,
        "steps": stats.steps,
        "seconds": time.monotonic() - _STARTED,
        "cpu_seconds": time.process_time(),
    }
    path = Path(folder) / f"{machine}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # a reader never sees half a record


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class FuzzedSchedulerDifferential(LockstepMachine):
    """The machine on the toy scheduler's subject, reporting its throughput after each
    example."""

    subject = SCHEDULER

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            record_throughput(self.subject.machine, self.record.stats)


TestSchedulerDifferential = FuzzedSchedulerDifferential.TestCase
