"""Running the lockstep machine as a test: its run record, coverage and report.

The machine is tests/stateful/machine.py (``LockstepMachine``); ``machine_for`` binds it
to a subject (tests/stateful/subjects/), which says what is under test and how big a
run is under each Hypothesis profile (tests/conftest.py registers the profiles).
"""

from __future__ import annotations

import os
import time
from typing import Final

from hypothesis import seed, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.campaign.progress import watched
from tests.stateful.coverage import RunRecord, write_report
from tests.stateful.machine import LockstepMachine
from tests.stateful.sizes import machine_settings

#: Profiles whose runs are sized to reach every required path (asserted).
COVERAGE_PROFILES: Final = frozenset({"ci", "nightly"})


def run_machine(machine: type[LockstepMachine]) -> str:
    """Run ``machine`` under the current profile; report; assert coverage under ci/nightly.

    ``KVSCHED_STATEFUL_SEED=<n>`` runs another fixed stream of examples (``@seed``).

    The run gets its own ``RunRecord`` (on a subclass of ``machine``) and reads it in
    the same process right after the run, so the coverage check does not depend on
    test order or on pytest-xdist.
    """
    subject = machine.subject
    subject.require()
    record = RunRecord()
    namespace = {"__module__": machine.__module__, "record": record}
    run: type[LockstepMachine] = type(machine.__name__, (machine,), namespace)
    profile = settings.get_current_profile_name()
    chosen_seed = os.environ.get("KVSCHED_STATEFUL_SEED")
    if chosen_seed:  # @seed wins over derandomize: another fixed stream of examples
        run = seed(int(chosen_seed))(run)
        profile = f"{profile}, seed {chosen_seed}"
    start = time.process_time()
    try:
        with watched(machine.__name__, record):  # a campaign worker reads the record live
            run_state_machine_as_test(run, settings=machine_settings(subject.sizes))
    finally:
        record.stats.cpu_seconds = time.process_time() - start
    missing = sorted(subject.required - set(record.coverage))
    checked = profile in COVERAGE_PROFILES
    report = write_report(machine.__name__, profile, record, missing, required=checked)
    print(report)
    if checked:
        assert not missing, f"{machine.__name__} never reached: {missing}"
    return report
