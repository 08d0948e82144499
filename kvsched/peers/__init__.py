"""Schedulers under test: ours and other engines' real ones, held to the spec in lockstep.

``make_peer`` builds one by its ``--engine`` name. The peers (vLLM V1, nano-vllm) are
imported only here, lazily: ``import kvsched`` never imports them, and a missing one
is a ``PeerNotInstalledError`` naming ``scripts/install_peers``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsched.peers.protocol import (
    INSTALL_HINT,
    Hidden,
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    SchedulerUnderTest,
)
from spec.types import SamplingParams, SchedulerConfig, Semantics

PEERS = ("vllm", "nano-vllm", "transformers", "tokenspeed")
#: The spec profile each ``--engine`` is held to unless ``--semantics`` says otherwise.
PROFILES = {
    "kvsched": Semantics.KVSCHED,
    "vllm": Semantics.VLLM_V1,
    "nano-vllm": Semantics.NANO_VLLM,
    "transformers": Semantics.TRANSFORMERS,
    "tokenspeed": Semantics.TOKENSPEED,
}


def common_eos(params: Iterable[SamplingParams]) -> int | None:
    """The EOS every request that stops on EOS shares (nano-vllm has one per engine)."""
    eos = {p.eos_token_id for p in params if not p.ignore_eos}
    if len(eos) > 1:
        raise PeerUnsupportedError(
            f"nano-vllm has one EOS for the engine; the workload uses {sorted(eos, key=repr)}"
        )
    return next(iter(eos), None)


def make_peer(
    name: str, config: SchedulerConfig, *, eos_token_id: int | None = None
) -> SchedulerUnderTest:
    """A peer scheduler by name; ``eos_token_id`` is nano-vllm's engine-wide EOS."""
    if name == "vllm":
        from kvsched.peers.vllm_v1 import VllmAdapter  # noqa: PLC0415  (lazy: see above)

        return VllmAdapter(config)
    if name == "nano-vllm":
        from kvsched.peers.nano import NanoAdapter  # noqa: PLC0415  (lazy: see above)

        return NanoAdapter(config, eos_token_id=eos_token_id)
    if name == "transformers":
        from kvsched.peers.transformers_cb import TransformersAdapter  # noqa: PLC0415

        return TransformersAdapter(config)
    if name == "tokenspeed":
        from kvsched.peers.tokenspeed import TokenSpeedAdapter  # noqa: PLC0415

        return TokenSpeedAdapter(config)
    raise PeerUnsupportedError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")


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
]
