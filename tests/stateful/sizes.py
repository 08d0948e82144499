"""How big a machine's run is under each Hypothesis profile (tests/conftest.py registers
the profiles; each subject gives its ``Sizes``, tests/stateful/subjects/)."""

from __future__ import annotations

import dataclasses
import os
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


@dataclass(frozen=True)
class Sizes:
    """A machine's size per profile. The ci sizes keep the whole stateful suite around
    3-5 minutes with ``pytest -n 2``; nightly is sized in docs/stateful-testing.md
    (>= 10^6 differential steps a night); ``campaign`` runs nightly's rules per example.
    Another profile without a field here runs ``dev``."""

    ci: Size
    dev: Size
    nightly: Size
    mutation: Size

    def of(self, profile: str) -> Size:
        if profile == "campaign":
            # scripts/campaign: nightly's rules per example; its worker sets each run's
            # examples (KVSCHED_STATEFUL_EXAMPLES) to fill a time slice. No target
            # phase: a run is tens to hundreds of examples (about 15 s).
            return dataclasses.replace(self.nightly, targeting=False)
        named = {field.name for field in dataclasses.fields(self)}
        size: Size = getattr(self, profile if profile in named else "dev")
        return size


#: Every machine sets these explicitly (formal-methods.md section 2.2: a machine's own
#: @settings otherwise brings back the 200 ms deadline and every health check).
SUPPRESSED: Final = (HealthCheck.too_slow, HealthCheck.data_too_large)


def machine_settings(sizes: Sizes) -> settings:
    """The current profile's settings, with the machine's size for that profile.

    ``KVSCHED_STATEFUL_EXAMPLES`` / ``KVSCHED_STATEFUL_STEPS`` override the size.
    """
    size = sizes.of(settings.get_current_profile_name())
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
