"""How big a machine's run is under each Hypothesis profile (tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from hypothesis import HealthCheck, Phase, settings


@dataclass(frozen=True)
class Size:
    max_examples: int
    steps: int  # stateful_step_count: rules per example (a rule may run several steps)
    #: Keep Hypothesis's target phase (hill-climbing on the teardown's target() labels).
    #: Only for long runs: with a few hundred examples it spends the budget near the
    #: examples with the most preemptions (restart-mode thrash) and starves the rest.
    targeting: bool = False


#: Per profile (tests/conftest.py) and machine. The ci sizes keep the whole stateful
#: suite around 3-5 minutes with ``pytest -n 2``; nightly is sized in
#: docs/stateful-testing.md (>= 10^6 differential steps a night).
SIZES: Final[Mapping[str, Mapping[str, Size]]] = {
    "ci": {
        "SchedulerDifferential": Size(2_000, 50),
        "EngineDifferential": Size(400, 50),
        "VllmMachine": Size(200, 30),
        "VllmPrefixMachine": Size(200, 30),
        "NanoVllmMachine": Size(200, 30),
        "PrefixSchedulerDifferential": Size(1_000, 50),
        "PrefixEngineDifferential": Size(150, 40),
    },
    "dev": {
        "SchedulerDifferential": Size(60, 40),
        "EngineDifferential": Size(15, 25),
        "VllmMachine": Size(30, 25),
        "VllmPrefixMachine": Size(30, 25),
        "NanoVllmMachine": Size(30, 25),
        "PrefixSchedulerDifferential": Size(60, 40),
        "PrefixEngineDifferential": Size(15, 25),
    },
    "nightly": {
        "SchedulerDifferential": Size(20_000, 100, targeting=True),
        "EngineDifferential": Size(6_000, 60, targeting=True),
        "VllmMachine": Size(5_000, 50),
        "VllmPrefixMachine": Size(5_000, 50),
        "NanoVllmMachine": Size(5_000, 50),
        "PrefixSchedulerDifferential": Size(10_000, 100, targeting=True),
        "PrefixEngineDifferential": Size(2_000, 60, targeting=True),
    },
    # scripts/campaign: nightly's rules per example; the worker sets the examples of
    # each run (KVSCHED_STATEFUL_EXAMPLES) to fill its time slice. No target phase: the
    # runs are a few hundred examples each.
    "campaign": {
        "SchedulerDifferential": Size(20_000, 100),
        "EngineDifferential": Size(6_000, 60),
        "VllmMachine": Size(5_000, 50),
        "VllmPrefixMachine": Size(5_000, 50),
        "NanoVllmMachine": Size(5_000, 50),
        "PrefixSchedulerDifferential": Size(10_000, 100),
        "PrefixEngineDifferential": Size(2_000, 60),
    },
    "mutation": {
        "SchedulerDifferential": Size(1_000, 40),
        "EngineDifferential": Size(200, 30),
        "VllmMachine": Size(30, 25),
        "VllmPrefixMachine": Size(30, 25),
        "NanoVllmMachine": Size(30, 25),
        "PrefixSchedulerDifferential": Size(600, 40),
        "PrefixEngineDifferential": Size(100, 30),
    },
}

#: Every machine sets these explicitly (formal-methods.md section 2.2: a machine's own
#: @settings otherwise brings back the 200 ms deadline and every health check).
SUPPRESSED: Final = (HealthCheck.too_slow, HealthCheck.data_too_large)


def machine_settings(machine: str) -> settings:
    """The current profile's settings, with this machine's size for that profile.

    ``KVSCHED_STATEFUL_EXAMPLES`` / ``KVSCHED_STATEFUL_STEPS`` override the size.
    """
    profile = settings.get_current_profile_name()
    size = SIZES.get(profile, SIZES["dev"])[machine]
    examples = int(os.environ.get("KVSCHED_STATEFUL_EXAMPLES") or size.max_examples)
    steps = int(os.environ.get("KVSCHED_STATEFUL_STEPS") or size.steps)
    phases = tuple(p for p in settings().phases if size.targeting or p is not Phase.target)
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        phases=phases,
        deadline=None,
        suppress_health_check=SUPPRESSED,
    )
