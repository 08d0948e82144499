"""Speculative decoding in the engine's scheduler (vllm-v1/spec-* of docs/semantics.md).

A request that sampled gets drafts from the engine's drafter after the step
(``propose_drafts``); its next chunk runs its last token and the drafts, one verify
forward; the model runner returns each sampling request's *run*: the drafts it
accepted and one token of its own (``commit_verified``). Rejected drafts roll
``num_computed`` back; their blocks stay in the block table, so the next chunk grows
only past them (``len(block_table)`` exceeds ``cdiv(num_computed, block_size)`` by the
blocks ahead, and phase A's growth test already reads the table's length). Their K/V
slots need no undo: nothing reads a position at or past ``num_computed``, and the
next chunk overwrites them.

Phases A and C call ``chunk_with_drafts`` and ``pads_admission``; phase D with runs is
``impl.phases.commit_verified``; the engine calls ``propose_drafts`` after it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence, SequenceStatus
from spec.types import SampledTokensError

if TYPE_CHECKING:
    from impl.scheduler import Scheduler


class Proposer(Protocol):
    """Who drafts for the engine (vllm-v1/spec-propose): ``propose`` maps a request's
    tokens (prompt + outputs) to its drafts, at most ``num_speculative_tokens`` of them
    kept. ``NgramProposer`` (prompt lookup) is the engine's own; any other drafter that
    is a function of the tokens (a test's) plugs in here."""

    def propose(self, token_ids: list[int]) -> SequenceABC[int]: ...


#: A padded admission's drafts (vllm-v1/spec-padded-new-decode): never a token id, so
#: never accepted; the model runner feeds token 0 in its place.
PAD_TOKEN_ID = -1


def chunk_with_drafts(sched: Scheduler, seq: Sequence, remaining: int) -> int:
    """vllm-v1/spec-drafts-scheduled: a running request's tokens to compute plus its
    drafts, ending at ``max_model_len - 1`` at most (a position past it could not be
    sampled); at least one token."""
    total = remaining + len(seq.spec_token_ids)
    length = sched.max_model_len
    if length is None:
        return total
    return max(1, min(total, length - 1 - seq.num_computed))


def drafts_run(seq: Sequence, start: int, n: int) -> list[int]:
    """The drafts a chunk ``start .. start + n - 1`` runs: the positions past the
    request's tokens, the first of its drafts (a chunk cut short drops them from the end)."""
    past = start + n - seq.num_tokens
    return seq.spec_token_ids[:past] if past > 0 else []


def may_pad(out: SchedulerOutput) -> bool:
    """vllm-v1/spec-padded-new-decode, read once before phase C: no running request the
    step scheduled is mid-prefill (``out.scheduled`` holds phase A's chunks then)."""
    return all(seq.decoding for seq in out.scheduled)


def pads_admission(
    sched: Scheduler, *, start: int, num_tokens: int, running_scheduled: bool
) -> bool:
    """vllm-v1/spec-padded-new-decode: a waiting request whose chunk is one token, in a
    step that ``may_pad``, is padded to ``1 + K`` (K drafts of ``PAD_TOKEN_ID``) so that
    the step's decodes have one width, if some running request was scheduled or it has
    a cache hit, and the padded chunk leaves room below ``max_model_len`` for its
    sampled token."""
    length = sched.max_model_len
    return (
        num_tokens == 1
        and length is not None
        and start + sched.num_speculative_tokens + 2 <= length
        and (running_scheduled or start > 0)
    )


def valid_run(drafts: list[int], run: SequenceABC[int]) -> bool:
    """A run a verify may return for a chunk that ran ``drafts``: one to ``len(drafts)
    + 1`` tokens, all but the last the drafts in order (a pad is never accepted)."""
    accepted = len(run) - 1
    return (
        0 <= accepted <= len(drafts)
        and list(run[:accepted]) == drafts[:accepted]
        and PAD_TOKEN_ID not in drafts[:accepted]
    )


def check_runs(out: SchedulerOutput, runs: SequenceABC[SequenceABC[int]]) -> None:
    """``SampledTokensError`` unless ``runs`` holds one valid run per sampling chunk of
    ``out`` (scheduled, not yet committed), in plan order (``valid_run``)."""
    if len(runs) != out.num_samples:
        raise SampledTokensError(
            f"step {out.step}: {out.num_samples} requests sample, got {len(runs)} runs"
        )
    k = 0
    for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
        if seq.num_computed + n >= seq.num_tokens:
            drafts = drafts_run(seq, seq.num_computed, n)
            if not valid_run(drafts, runs[k]):
                raise SampledTokensError(
                    f"step {out.step}: {seq.request_id!r} ran drafts {drafts}, got the "
                    f"run {list(runs[k])}"
                )
            k += 1


def propose_drafts(
    sched: Scheduler, out: SchedulerOutput, propose: Callable[[list[int]], SequenceABC[int]]
) -> None:
    """vllm-v1/spec-propose, after a committed step: each request it scheduled that is
    still running gets ``propose(prompt + outputs)``, at most ``K``, if it sampled, and
    no drafts if its chunk ended mid-prefill. Others keep theirs."""
    limit = sched.num_speculative_tokens
    running = SequenceStatus.RUNNING
    sampled = set(out.sampled_ids)
    for seq in out.scheduled:
        if seq.status is running:
            in_run = seq.request_id in sampled
            seq.spec_token_ids = list(propose(seq.token_ids))[:limit] if in_run else []


@dataclass(frozen=True, slots=True)
class SpeculativeCounts:
    """What speculative decoding did over a run (``EngineMetrics.speculative``; ``kvsched
    run``'s summary and ``--json``): the drafts verified (a padded admission's aside),
    those delivered as outputs, the sampling chunks that ran drafts, and the forwards
    and the tokens generated in them."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_runs: int = 0
    forwards: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """The tokens a run with drafts delivers on average (vLLM's mean acceptance
        length): 1 + accepted / runs."""
        return 1 + self.accepted_tokens / self.verify_runs if self.verify_runs else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0
