"""Peer tests skip when a peer is not installed here, but fail under ``CI=true``.

CI installs the peers (``.ci/run`` calls ``scripts/install_peers``), so a missing peer
there is a broken setup, never a reason to skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvsched.peers.protocol import INSTALL_HINT
from tests.cli.conftest import invoke, write_workload  # the CLI tests' fixtures, reused

_MODULES = {
    "vllm": "vllm",
    "nano-vllm": "nanovllm",
    "transformers": "transformers",
    "tokenspeed": "tokenspeed_scheduler",
}


def require_peer(name: str) -> None:
    if importlib.util.find_spec(_MODULES[name]) is not None:
        return
    message = f"peer {name} is not installed (run {INSTALL_HINT})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(params=("nano-vllm", "vllm"))  # the peers of the shared tests (block size 2)
def peer_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_peer(name)
    return name


__all__ = ["invoke", "peer_name", "require_peer", "write_workload"]
