"""Running a differential machine as a test: its run record, coverage and report.

The machines are tests/stateful/machine.py (``DifferentialMachine``), built from its
strategies, rules and invariants (one module each here) over the lockstep comparison
(kvsched/peers/lockstep.py), and the peer machines of tests/peers/machine.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from typing import Final, cast

from hypothesis import seed, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.stateful.base import RecordedMachine
from tests.stateful.coverage import RunRecord, write_report
from tests.stateful.profiles import machine_settings

#: Profiles whose runs are sized to reach every required path (asserted).
COVERAGE_PROFILES: Final = frozenset({"ci", "nightly"})


def run_differential(machine: type[RecordedMachine], required: Collection[str]) -> str:
    """Run ``machine`` under the current profile; report; assert coverage under ci/nightly.

    ``KVSCHED_STATEFUL_SEED=<n>`` runs another fixed stream of examples (``@seed``).

    The run gets its own ``RunRecord`` (on a subclass of ``machine``) and reads it in
    the same process right after the run, so the coverage check does not depend on
    test order or on pytest-xdist.
    """
    name = machine.NAME
    record = RunRecord()
    namespace = {"__module__": machine.__module__, "record": record}
    machine = cast(type[RecordedMachine], type(machine.__name__, (machine,), namespace))
    profile = settings.get_current_profile_name()
    chosen_seed = os.environ.get("KVSCHED_STATEFUL_SEED")
    if chosen_seed:  # @seed wins over derandomize: another fixed stream of examples
        machine = seed(int(chosen_seed))(machine)
        profile = f"{profile}, seed {chosen_seed}"
    start = time.process_time()
    try:
        run_state_machine_as_test(machine, settings=machine_settings(name))
    finally:
        record.stats.cpu_seconds = time.process_time() - start
    missing = sorted(set(required) - set(record.coverage))
    checked = profile in COVERAGE_PROFILES
    report = write_report(name, profile, record, missing, required=checked)
    print(report)
    if checked:
        assert not missing, f"{name} never reached: {missing}"
    return report
