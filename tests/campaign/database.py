"""The campaign's example database, through Hypothesis's own classes, one revision each.

Every worker, on this machine or another, opens the database its URL names
(tests/campaign/location.py) as ``hypothesis.extra.redis.RedisExampleDatabase`` under a
key prefix, or ``DirectoryBasedExampleDatabase`` in a subdirectory, named by the tree's
revision (tests/campaign/revision.py): examples found on one revision are never
replayed on another. A replay wraps it in ``ReadOnlyDatabase``: it reads the campaign's
failures and changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from hypothesis import Phase
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase, ReadOnlyDatabase

from tests.campaign import environment
from tests.campaign.location import EXPIRE, PREFIX, Location, redis_client
from tests.campaign.revision import revision

ROOT: Final = Path(__file__).resolve().parents[2]


def examples(location: Location, key: str) -> ExampleDatabase:
    """Revision ``key``'s example database at ``location``."""
    if not location.is_redis:
        return DirectoryBasedExampleDatabase(location.directory / key)
    redis_client()  # a one-line error if the package is missing
    from hypothesis.extra.redis import RedisExampleDatabase  # noqa: PLC0415  (imports redis)

    return RedisExampleDatabase(
        location.redis(),
        expire_after=EXPIRE,
        key_prefix=f"{PREFIX}:{key}:".encode(),
        listener_channel=f"{PREFIX}:{key}:changes",
    )


def campaign_profile() -> dict[str, object]:
    """The ``campaign`` Hypothesis profile's settings (tests/conftest.py), from the
    environment scripts/campaign sets: at random, on the shared database; for a replay,
    only the saved examples (no generation, no shrinking), read only."""
    replay = os.environ.get(environment.REPLAY)
    url = os.environ.get(environment.DB)
    database: ExampleDatabase | None = None
    if url and replay:
        database = ReadOnlyDatabase(examples(Location(url), replay))
    elif url:
        database = examples(Location(url), revision(ROOT).key)
    # No explain phase: it reruns the shrunk failure under sys.settrace (Python 3.11),
    # measured here at over a minute of a worker's time per failure, for a list of lines.
    phases = (
        (Phase.explicit, Phase.reuse)
        if replay
        else tuple(p for p in Phase if p is not Phase.explain)
    )
    return {"derandomize": False, "database": database, "phases": phases}
