"""Hypothesis profiles shared by every test.

``ci`` is what CI runs (Hypothesis also switches to it by itself when ``CI`` is set):
derandomized, no example database, blobs printed so a failure can be replayed.
``dev`` is quick for local edits; ``nightly`` explores at random with a database, for
long runs; ``mutation`` is the quick deterministic one of scripts/mutation_check.py;
``fuzz`` is the HypoFuzz campaign's (scripts/fuzz): its example database is the folder
``KVSCHED_FUZZ_DB`` (default ``.hypothesis/fuzz``), which every worker of the campaign,
on this machine or another one that mounts the folder, reads and writes.
Pick one with ``HYPOTHESIS_PROFILE=<name>`` or pytest's ``--hypothesis-profile=<name>``.
The stateful machines size themselves per profile (tests/stateful/profiles.py, SIZES).
"""

import importlib.util
import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    derandomize=False,
    max_examples=20_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

settings.register_profile(
    "fuzz",
    derandomize=False,
    database=DirectoryBasedExampleDatabase(
        os.environ.get("KVSCHED_FUZZ_DB") or os.path.join(".hypothesis", "fuzz")
    ),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# The mutation check (scripts/mutation_check.py): deterministic, and no shrinking, since
# only *whether* a mutant is caught (and by which invariant) matters there.
settings.register_profile(
    "mutation",
    derandomize=True,
    database=None,
    print_blob=False,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)

# The property tests on CrossHair's solver instead of random draws (docs/crosshair.md):
# needs the optional ``hypothesis-crosshair`` package, so the profile exists only where
# it is installed. Slow: run it on the small property tests, e.g.
# ``HYPOTHESIS_PROFILE=crosshair python -m pytest tests/spec/test_kv_policies.py``.
if importlib.util.find_spec("hypothesis_crosshair_provider") is not None:
    settings.register_profile(
        "crosshair",
        backend="crosshair",
        database=None,
        deadline=None,
        max_examples=50,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
