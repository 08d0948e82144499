"""Peer tests skip when a peer is not installed here, but fail under ``CI=true``.

CI installs the peers (``.ci/run`` calls ``scripts/install_peers``, and
``scripts/install_peers --venv vllm-v0`` for the peer in its own environment), so a
missing peer there is a broken setup, never a reason to skip.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NoReturn

import pytest

from kvsched.peers import registry
from kvsched.peers.protocol import INSTALL_HINT
from tests.cli.conftest import invoke, write_workload  # the CLI tests' fixtures, reused

_MODULES = {
    "vllm": "vllm",
    "nano-vllm": "nanovllm",
    "transformers": "transformers",
    "tokenspeed": "tokenspeed_scheduler",
}


def _missing(message: str) -> NoReturn:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def require_peer(name: str) -> None:
    if importlib.util.find_spec(_MODULES[name]) is None:
        _missing(f"peer {name} is not installed (run {INSTALL_HINT})")


def require_peer_venv(name: str) -> Path:
    """The interpreter of ``name``'s own environment (``scripts/install_peers --venv``)."""
    entry = registry.entry(name)
    python = registry.venv_python(entry)
    if python is None:
        _missing(
            f"{name}'s environment is missing under {registry.venv_root()} (run "
            f"scripts/install_peers --venv {entry.venv})"
        )
    return python


@pytest.fixture(params=("nano-vllm", "vllm"))  # the peers of the shared tests (block size 2)
def peer_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_peer(name)
    return name


__all__ = ["invoke", "peer_name", "require_peer", "require_peer_venv", "write_workload"]
