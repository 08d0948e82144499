"""Hypothesis profiles shared by every test.

``ci`` is what CI runs (Hypothesis also switches to it by itself when ``CI`` is set):
derandomized, no example database, blobs printed so a failure can be replayed.
``dev`` is quick for local edits; ``nightly`` explores at random with a database, for
long runs; ``mutation`` is the quick deterministic one of scripts/mutation_check.py;
``campaign`` is scripts/campaign's: at random, on the example database its workers
share (a Redis server or a directory, keyed by the code revision: tests/campaign).
Pick one with ``HYPOTHESIS_PROFILE=<name>`` or pytest's ``--hypothesis-profile=<name>``.
The stateful machines size themselves per profile (tests/stateful/profiles.py, SIZES).
"""

import importlib.util
import os

from hypothesis import HealthCheck, Phase, settings

from tests.campaign.database import campaign_profile


def register(name: str, **overrides: object) -> None:
    """A profile: no deadline (the machines' steps vary a lot), blobs printed, slow
    draws tolerated, unless ``overrides`` say otherwise."""
    base: dict[str, object] = {
        "deadline": None,
        "print_blob": True,
        "suppress_health_check": [HealthCheck.too_slow],
    }
    settings.register_profile(name, **{**base, **overrides})  # type: ignore[arg-type]


register("ci", derandomize=True, database=None, max_examples=100)
register("dev", max_examples=25)
register("nightly", derandomize=False, max_examples=20_000)
register("campaign", **campaign_profile())

# The mutation check (scripts/mutation_check.py): deterministic, and no shrinking, since
# only *whether* a mutant is caught (and by which invariant) matters there.
register(
    "mutation",
    derandomize=True,
    database=None,
    print_blob=False,
    phases=(Phase.explicit, Phase.generate),
)

# The property tests on CrossHair's solver instead of random draws (docs/crosshair.md):
# needs the optional ``hypothesis-crosshair`` package, so the profile exists only where
# it is installed. Slow: run it on the small property tests, e.g.
# ``HYPOTHESIS_PROFILE=crosshair python -m pytest tests/spec/test_kv_policies.py``.
if importlib.util.find_spec("hypothesis_crosshair_provider") is not None:
    register(
        "crosshair",
        backend="crosshair",
        database=None,
        max_examples=50,
        suppress_health_check=list(HealthCheck),
    )

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
