"""The scheduler-under-test protocol: what lockstep needs from any scheduler.

A scheduler under test takes requests and aborts, runs one step at a time and
reports the step in the spec's ``StepPlan`` terms, and shows its state in the spec's
``SchedulerState`` terms as far as it exposes it. Our ``impl.Scheduler`` and
``impl.LLMEngine`` implement it (``kvsched.peers.ours``), and so do adapters over
other people's schedulers: vLLM V1 (``kvsched.peers.vllm_v1``) and nano-vllm
(``kvsched.peers.nano``).

Tokens: the driver decides them with a pure ``TokenOracle`` (the next token as a
function of prompt + outputs so far) and passes it to ``step``; a scheduler samples
with it, so spec and peer see the same tokens. An engine with a real model samples
on its own and ignores the oracle; the plan says what it sampled and lockstep feeds
exactly those tokens to the spec.

Fields a scheduler cannot expose are named in ``Observation.hidden`` and left out of
the comparison on both sides; an adapter never invents them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvsched.errors import CLIInputError
from spec.oracle import TokenOracle
from spec.types import (
    FinishedRequest,
    KVSchedError,
    Preemption,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SchedulerState,
    StepPlan,
)

INSTALL_HINT = "scripts/install_peers"


class PeerNotInstalledError(CLIInputError):
    """A peer's package is not importable here."""

    def __init__(self, peer: str, missing: str) -> None:
        super().__init__(f"peer {peer} is not installed ({missing}); run {INSTALL_HINT}")
        self.peer = peer


class PeerUnsupportedError(CLIInputError):
    """The configuration or a request uses something the peer does not have."""


class PeerFailure(KVSchedError):
    """The peer raised while stepping: reported by lockstep as a divergence."""


class Hidden(enum.StrEnum):
    """State a scheduler does not expose; lockstep compares it on neither side."""

    NUM_PREEMPTIONS = "num_preemptions"  # per request: nano-vllm does not count them
    # With prefix caching: the block ids, free-queue order and keys (PC1) of a peer
    # whose pool is not projected; its free-block count and hits are still compared.
    PREFIX_POOL = "prefix_pool"


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """A scheduler's state in spec terms, plus the blocks it says each request holds.

    ``blocks`` maps every live request to the GPU blocks the scheduler's own block
    table holds for it (the spec's R2 count is ``blocks_owned``).
    """

    state: SchedulerState
    blocks: Mapping[str, int]
    hidden: frozenset[Hidden] = frozenset()


class SchedulerUnderTest(Protocol):
    """A scheduler lockstep can drive; every method may raise the project's typed errors.

    ``name`` is the ``--engine`` value; ``semantics`` the spec profile whose rules it
    is expected to follow (``kvsched`` for ours).
    """

    name: str
    semantics: str

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    def abort_request(self, request_id: str) -> FinishedRequest | None:
        """Abort; the aborted request as the scheduler reports it (compared), or ``None``
        where it reports nothing. An id it does not know: ``UnknownRequestError``."""
        ...

    def step(self, next_token: TokenOracle) -> StepPlan: ...

    def has_unfinished_requests(self) -> bool: ...

    def observe(self) -> Observation: ...


def make_plan(
    step: int,
    *,
    scheduled: Iterable[tuple[str, int, int]],
    preempted: Iterable[Preemption] = (),
    swapped_in: Iterable[str] = (),
    sampled: Iterable[tuple[str, int]] = (),
    finished: Iterable[FinishedRequest] = (),
) -> StepPlan:
    """A peer's step as a ``StepPlan``: the one place adapters build plans.

    ``scheduled`` holds ``(request_id, start, num_tokens)`` in the peer's batch order,
    ``sampled`` ``(request_id, token_id)``.
    """
    return StepPlan.of(
        step=step,
        scheduled=(ScheduledChunk(request_id=r, start=st, num_tokens=n) for r, st, n in scheduled),
        preempted=preempted,
        swapped_in=swapped_in,
        sampled=(SampledToken(request_id=r, token_id=t) for r, t in sampled),
        finished=finished,
    )


def decisions(plan: StepPlan) -> StepPlan:
    """The part of a plan decided before any token exists: the one place lockstep reads it."""
    return replace(plan, sampled_ids=(), sampled_token_ids=(), finished=())


def sampled_tokens(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.sampled_ids, plan.sampled_token_ids, strict=True))
