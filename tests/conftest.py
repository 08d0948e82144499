"""Hypothesis profiles shared by every test.

``ci`` is what CI runs (Hypothesis also switches to it by itself when ``CI`` is set):
derandomized, no example database, blobs printed so a failure can be replayed.
``dev`` is quick for local edits; ``nightly`` explores at random with a database, for
long runs; ``mutation`` is the quick deterministic one of scripts/mutation_check.py;
``campaign`` is scripts/campaign's: at random, on the example database its workers
share (a Redis server or a directory, keyed by the code revision: tests/campaign).
Pick one with ``HYPOTHESIS_PROFILE=<name>`` or pytest's ``--hypothesis-profile=<name>``.
The stateful machines size themselves per profile (their subject's ``Sizes``,
tests/stateful/sizes.py). Every profile is registered here, and only here.

Before anything draws, the pool of literal constants Hypothesis draws from is pinned
(``pin_local_constants``), so that an example stream does not depend on which modules
the process imported (docs/stateful-testing.md, "Determinism").
"""

import importlib.util
import os
import sys
import types
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

from tests.campaign.database import campaign_profile

ROOT = Path(__file__).resolve().parents[1]
#: Set to leave the pool unpinned (tests/stateful/test_determinism.py shows that it matters).
UNPINNED_ENV = "KVSCHED_UNPINNED_CONSTANTS"


def pin_local_constants() -> None:
    """Put every source file of the project outside tests/ into the pool of literal
    constants Hypothesis draws from, once, before the first draw.

    Hypothesis (6.170) draws a few per cent of its integers, floats and strings from the
    literals of every *local* module in ``sys.modules`` (test files excluded), and reads
    the new ones whenever ``sys.modules`` grows (``_get_local_constants`` in
    hypothesis/internal/conjecture/providers.py; no setting turns it off:
    HypothesisWorks/hypothesis#4627). A machine's derandomized stream then depended on
    which of spec/, impl/, kvsched/, bench/ or scripts/ the process had imported: a file
    run alone, ``-k`` or an xdist split drew other examples. Each file enters
    ``sys.modules`` as a module object naming it (not executed, under a name no import
    statement can reach), so Hypothesis reads its constants now, and a module imported
    later brings none the pool lacks.
    """
    if os.environ.get(UNPINNED_ENV):
        return
    for top in sorted(ROOT.iterdir()):
        if not top.is_dir() or top.name.startswith(".") or top.name == "tests":
            continue
        for path in sorted(top.rglob("*.py")):
            name = f"kvsched-constant-pool:{path.relative_to(ROOT).as_posix()}"
            module = types.ModuleType(name)
            module.__file__ = str(path)
            sys.modules.setdefault(name, module)


pin_local_constants()


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
