"""Hypothesis profiles shared by every test.

``ci`` is what CI runs (Hypothesis also switches to it by itself when ``CI`` is set):
derandomized, no example database, blobs printed so a failure can be replayed.
``dev`` is quick for local edits; ``nightly`` explores at random with a database, for
long runs. Pick one with ``HYPOTHESIS_PROFILE=<name>`` or pytest's
``--hypothesis-profile=<name>``.
"""

import os

from hypothesis import HealthCheck, settings

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

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
