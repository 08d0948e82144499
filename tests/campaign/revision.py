"""What a campaign's examples were found on: the code revision that keys its database.

A saved example is a choice sequence; it means the same failure only on the same code
and the same versions of what interprets it. The revision is therefore a digest of the
*content* the machines run (every ``*.py`` under ``TESTED``, as it is on disk, tracked
or not), of Hypothesis's version (it encodes the choices) and of the versions of the
libraries the machines drive (torch, the peers). Content, not the git commit: a
docs-only commit does not split a campaign's corpus, a dirty tree gets the digest of
what actually runs, and a copy without ``.git`` (a mutant, a tarball on another
machine) has one. The git commit and the changed files are kept beside it, for people.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: The packages whose code a machine run executes (tests/ holds the machines).
TESTED: Final = ("spec", "impl", "model", "kvsched", "tests")

#: Top-level modules whose installed distribution's version is part of the revision:
#: Hypothesis reads the choice sequences; torch computes the engine machine's tokens;
#: the peers are the real side of the peer machines.
VERSIONED: Final = ("hypothesis", "torch", "vllm", "nanovllm")


@dataclass(frozen=True)
class Revision:
    key: str  # the database's key prefix: 16 hex digits of the digest
    commit: str | None  # HEAD, where the tree is a git checkout
    changed: tuple[str, ...]  # tested files that differ from HEAD (or are untracked)
    versions: dict[str, str]

    def describe(self) -> str:
        """One line for people: the key, the commit and whether the tree is dirty."""
        if self.commit is None:
            where = "not a git checkout"
        elif self.changed:
            where = f"{self.commit[:12]} + {len(self.changed)} changed files"
        else:
            where = f"{self.commit[:12]}, clean"
        return f"{self.key} ({where})"

    def as_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "commit": self.commit,
            "changed": list(self.changed),
            "versions": self.versions,
        }


def tested_files(root: Path) -> list[Path]:
    return sorted(p for name in TESTED for p in (root / name).rglob("*.py") if p.is_file())


def installed_versions() -> dict[str, str]:
    """Python's version and each ``VERSIONED`` module's distribution (absent: not installed)."""
    owners = importlib.metadata.packages_distributions()
    versions = {"python": platform.python_version()}
    for module in VERSIONED:
        for dist in owners.get(module, ()):
            versions[dist] = importlib.metadata.version(dist)
    return versions


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )
    except OSError:  # no git
        return None
    return proc.stdout if proc.returncode == 0 else None


def revision(root: Path) -> Revision:
    """The revision of the tree at ``root`` with the libraries installed here."""
    digest = hashlib.sha256()
    for path in tested_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    versions = installed_versions()
    digest.update(json.dumps(versions, sort_keys=True).encode())
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *TESTED)
    changed = tuple(line[3:] for line in (status or "").splitlines() if line.endswith(".py"))
    return Revision(digest.hexdigest()[:16], head.strip() if head else None, changed, versions)
