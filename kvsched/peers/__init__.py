"""Schedulers under test: ours and other engines' real ones, held to the spec in lockstep.

``make_peer`` builds one by its ``--engine`` name (``kvsched.peers.registry`` lists
them): in this process, importing its adapter lazily (``import kvsched`` never imports
a peer, and a missing one is a ``PeerNotInstalledError`` naming
``scripts/install_peers``), or, given another environment's interpreter, in that
environment through the subprocess protocol (``kvsched.peers.remote``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable

from kvsched.peers import registry
from kvsched.peers.protocol import (
    INSTALL_HINT,
    Hidden,
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    SchedulerUnderTest,
)
from kvsched.peers.remote import PeerProcess, RemotePeer
from spec.oracle import Drafter, PromptLookupDrafter
from spec.types import SamplingParams, SchedulerConfig, Semantics

PEERS = tuple(registry.ENTRIES)
#: The spec profile each ``--engine`` is held to unless ``--semantics`` says otherwise.
PROFILES = {
    "kvsched": Semantics.KVSCHED,
    **{entry.name: entry.profile for entry in registry.PEER_ENTRIES},
}


def common_eos(params: Iterable[SamplingParams]) -> int | None:
    """The EOS every request that stops on EOS shares (nano-vllm has one per engine)."""
    eos = {p.eos_token_id for p in params if not p.ignore_eos}
    if len(eos) > 1:
        raise PeerUnsupportedError(
            f"nano-vllm has one EOS for the engine; the workload uses {sorted(eos, key=repr)}"
        )
    return next(iter(eos), None)


def peer_python(name: str, python: str | os.PathLike[str] | None = None) -> str | None:
    """The interpreter ``name`` runs under: ``python`` if given, else the peer's own
    environment where ``scripts/install_peers --venv`` created one, else None (here)."""
    if python is not None:
        return str(python)
    own = registry.venv_python(registry.entry(name))
    return None if own is None else str(own)


def peer_version(name: str, peer: SchedulerUnderTest) -> registry.PeerVersion:
    """Which version of the peer ``peer`` drives, and where."""
    entry = registry.entry(name)
    if isinstance(peer, RemotePeer):
        return registry.version_of(entry, peer.installed, peer.python)
    return registry.version_of(entry, registry.installed(entry), sys.executable)


def make_peer(
    name: str,
    config: SchedulerConfig,
    *,
    eos_token_id: int | None = None,
    python: str | os.PathLike[str] | None = None,
    speculative: PromptLookupDrafter | None = None,
    drafter: Drafter | None = None,
) -> SchedulerUnderTest:
    """A peer scheduler by name; ``eos_token_id`` is nano-vllm's engine-wide EOS,
    ``speculative`` vLLM's n-gram ``speculative_config`` (its drafts per step the
    config's ``num_speculative_tokens``), ``drafter`` what proposes the drafts in place
    of its prompt lookup (a test's, to have drafts accepted).

    With ``python`` (another environment's interpreter) the peer runs there, behind
    ``kvsched.peers.remote.RemotePeer``; else here.
    """
    entry = registry.entry(name)
    if (speculative or drafter or config.num_speculative_tokens) and (
        "speculative" not in entry.options or python is not None
    ):
        raise PeerUnsupportedError(
            f"{name}: speculative decoding is driven in vLLM V1's own environment only"
        )
    if python is not None:
        return PeerProcess(python, name).peer(config, eos_token_id=eos_token_id)
    module, _, cls = entry.adapter.partition(":")
    adapter = getattr(importlib.import_module(module), cls)
    options = {"eos_token_id": eos_token_id, "speculative": speculative, "drafter": drafter}
    peer: SchedulerUnderTest = adapter(config, **{k: options[k] for k in entry.options})
    return peer


__all__ = [
    "INSTALL_HINT",
    "PEERS",
    "PROFILES",
    "Hidden",
    "Observation",
    "PeerFailure",
    "PeerNotInstalledError",
    "PeerUnsupportedError",
    "SchedulerUnderTest",
    "common_eos",
    "make_peer",
    "peer_python",
    "peer_version",
]
