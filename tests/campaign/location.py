"""Where a campaign's example database lives: a Redis server or a directory.

Per revision (tests/campaign/revision.py) the database holds the examples (under a key
prefix or a subdirectory named by the revision: tests/campaign/database.py opens them)
and a small *meta* record (its commit, changed files and versions, written when a
campaign starts), so that a replay on a tree of another revision can say which
revisions the database holds instead of silently replaying nothing.

Plain Python and the ``redis`` client (for ``redis://`` only): scripts/campaign uses this
without importing Hypothesis.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from redis import Redis

PREFIX: Final = "kvsched-campaign"
#: Hypothesis's default for Redis (examples of a test not run for this long expire).
EXPIRE: Final = timedelta(days=8)
REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")
INSTALL_HINT: Final = "pip install -e '.[dev]'"


class CampaignError(Exception):
    """A campaign cannot start or replay (bad URL, unreachable server, other revision)."""


def redis_client() -> ModuleType:
    """The ``redis`` package (needed for ``redis://`` databases only)."""
    try:
        return importlib.import_module("redis")
    except ImportError:
        raise CampaignError(
            f"a redis:// database needs the redis package ({INSTALL_HINT})"
        ) from None


@dataclass(frozen=True)
class Location:
    """Where a database URL points: a Redis server or a directory."""

    url: str

    @property
    def is_redis(self) -> bool:
        return self.url.startswith(REDIS_SCHEMES)

    @property
    def directory(self) -> Path:
        return Path(self.url.removeprefix("file://")).expanduser()

    def redis(self) -> Redis:
        try:
            client: Redis = redis_client().Redis.from_url(self.url)
        except ValueError as err:
            raise CampaignError(f"bad Redis URL {self.url!r}: {err}") from None
        return client

    def check(self) -> None:
        """Fail with a one-line reason unless the database can be used."""
        if self.is_redis:
            try:
                self.redis().ping()
            except redis_client().RedisError as err:
                raise CampaignError(
                    f"cannot reach Redis at {self.url}: {err} (start one: "
                    "redis-server --port 6379 --save '' --appendonly no)"
                ) from None
        elif "://" in self.url:
            raise CampaignError(
                f"unknown database URL {self.url!r}: give redis://host:port/db or a directory"
            )
        else:
            self.directory.mkdir(parents=True, exist_ok=True)

    def write_meta(self, key: str, meta: dict[str, object]) -> None:
        text = json.dumps({**meta, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if self.is_redis:
            self.redis().set(f"{PREFIX}:{key}:meta", text, ex=EXPIRE)
        else:
            (self.directory / f"{key}.json").write_text(text)

    def revisions(self) -> dict[str, dict[str, object]]:
        """Every revision the database holds a campaign of: key -> its meta record."""
        found: dict[str, dict[str, object]] = {}
        if self.is_redis:
            client = self.redis()
            for name in client.scan_iter(match=f"{PREFIX}:*:meta"):
                text = client.get(name)
                if text is not None:
                    key = name.decode().split(":")[1]
                    found[key] = json.loads(text)
        elif self.directory.is_dir():
            for path in self.directory.glob("*.json"):
                found[path.stem] = json.loads(path.read_text())
        return found


def describe_meta(key: str, meta: dict[str, object]) -> str:
    commit = meta.get("commit")
    changed = meta.get("changed")
    where = str(commit)[:12] if commit else "not a git checkout"
    return f"{key} ({where}, {len(changed) if isinstance(changed, list) else 0} changed files)"
