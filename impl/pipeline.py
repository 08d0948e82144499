"""Async scheduling (vllm-v1/async-*, docs/semantics.md "Async scheduling"): the steps in
flight and what happens when their outputs come back, over the scheduler's mutable state.

Under async scheduling a step is ``schedule()``, then ``advance`` (the step is on its
way: its chunks count as computed, and each that samples leaves a placeholder for the
token it will bring), then, if ``pops_oldest``, ``apply`` of the oldest step in flight
with the tokens its forward sampled. Only ``apply`` changes outputs. The engine runs a
step's forward while the next one is scheduled; the scheduler alone (no model) gets each
step's tokens at once and keeps them with the step until it is applied.

A step in flight names its requests by their ``Sequence`` objects: an id may be used
again once its request finished or was aborted, and the new request is another object
(vLLM gives each request an internal id of its own for the same reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from impl.phases import finish, recomputed_tokens, retire
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence, SequenceStatus
from spec.types import FinishedRequest, InFlightBatch, ScheduledChunk

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED

#: vllm-v1/async-batch-queue: ``EngineCore``'s batch queue holds two steps.
BATCH_QUEUE_DEPTH = 2


class InFlightStep:
    """A step scheduled and advanced, its outputs not applied yet.

    ``sampling[k]`` says whether chunk ``k`` of ``out`` samples; ``tokens`` are the
    sampled tokens, one per sampling chunk in plan order, once its forward has run
    (None before: the engine's forward is still running).
    """

    __slots__ = ("out", "sampling", "tokens")

    def __init__(self, out: SchedulerOutput, sampling: list[bool]) -> None:
        self.out = out
        self.sampling = sampling
        self.tokens: list[int] | None = None

    def observe(self) -> InFlightBatch:
        """The spec's view of this step in flight."""
        out = self.out
        chunks = zip(out.scheduled, out.starts, out.num_scheduled, strict=True)
        return InFlightBatch(
            step=out.step,
            scheduled=tuple(
                ScheduledChunk(request_id=seq.request_id, start=start, num_tokens=n)
                for seq, start, n in chunks
            ),
            sampling_ids=tuple(
                seq.request_id
                for seq, samples in zip(out.scheduled, self.sampling, strict=True)
                if samples
            ),
            arrivals=tuple(seq.arrival for seq in out.scheduled),
        )

    def pending(self, tokens: list[int]) -> dict[Sequence, int]:
        """The token each sampling request of this step brings, given its forward's."""
        sampling = [seq for seq, s in zip(self.out.scheduled, self.sampling, strict=True) if s]
        return dict(zip(sampling, tokens, strict=True))


def has_requests(sched: Scheduler) -> bool:
    """vllm-v1/async-batch-queue: a step schedules only while a request is live or one
    finished or was aborted since the last ``schedule`` (vLLM's ``has_requests``)."""
    return bool(sched.requests) or sched.has_finished_requests


def advance(sched: Scheduler, out: SchedulerOutput) -> InFlightStep:
    """vllm-v1/async-placeholders: the step just scheduled joins the steps in flight;
    each chunk ``(seq, n)`` makes ``computed += n`` and ``in_flight += n`` now, and one
    placeholder more if it samples (it reaches ``num_tokens + placeholders``)."""
    sampling: list[bool] = []
    starts = out.starts
    recomputed = 0
    for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
        start = seq.num_computed
        starts.append(start)
        if start < seq.recomputed_until:
            recomputed += recomputed_tokens(seq, start, n)
        computed = start + n
        samples = seq.samples_at(computed)
        sampling.append(samples)
        seq.num_computed = computed
        seq.num_in_flight_tokens += n
        seq.num_output_placeholders += samples
    out.num_recomputed_tokens = recomputed
    sched.num_cached_tokens += out.num_batched_tokens
    sched.has_finished_requests = False
    step = InFlightStep(out, sampling)
    sched.in_flight.append(step)
    return step


def pops_oldest(sched: Scheduler, out: SchedulerOutput, depth: int) -> bool:
    """vllm-v1/async-batch-queue: whether the step of ``out`` applies the oldest step in
    flight, the queue holding ``depth`` steps once it joined: unless it was queued and
    left the queue with room while it scheduled something or a request is live; never
    with the queue empty."""
    queued = out.queued
    if queued and depth < BATCH_QUEUE_DEPTH and (out.num_scheduled or sched.requests):
        return False
    return depth >= 1


def apply(sched: Scheduler) -> tuple[list[Sequence], list[int], list[FinishedRequest]]:
    """Apply the oldest step in flight, which leaves the queue (vllm-v1/async-commit,
    -stale-output, -discard): the requests that got a token, their tokens, and the
    requests finished, in plan order.

    Per chunk ``(seq, n)``: a request no longer live (finished or aborted since) is
    skipped, its output dropped; else ``in_flight -= n``, and ``stale -= n`` if it was
    preempted with this step in flight. A sampling chunk's token is appended, a
    placeholder taken off unless stale, and R10 runs: a stop finishes the request from
    ``running`` (its blocks freed) or, stale, from ``waiting``. A running request's
    blocks full of known tokens (``computed - placeholders``) get their keys (PC2).
    """
    step = sched.in_flight.popleft()
    assert step.tokens is not None, "the step's forward has not run"
    tokens = iter(step.tokens)
    got: list[Sequence] = []
    got_tokens: list[int] = []
    finished: list[FinishedRequest] = []
    gpu = sched.gpu
    for seq, n, samples in zip(
        step.out.scheduled, step.out.num_scheduled, step.sampling, strict=True
    ):
        token = next(tokens) if samples else -1
        if seq.status is _FINISHED:
            continue  # vllm-v1/async-discard
        seq.num_in_flight_tokens -= n
        stale = seq.num_stale_output_tokens > 0
        if stale:
            seq.num_stale_output_tokens -= n
        if not samples:
            continue
        seq.token_ids.append(token)
        seq.num_tokens += 1
        got.append(seq)
        got_tokens.append(token)
        if not stale:
            keyed = seq.num_computed - seq.num_output_placeholders
            seq.num_output_placeholders -= 1
            if seq.status is _RUNNING:
                gpu.cache_blocks(seq, keyed, keyed + 1)
        if seq.stops(token):
            finished.append(finish_applied(sched, seq))
    if finished:
        sched.has_finished_requests = True
    return got, got_tokens, finished


def finish_applied(sched: Scheduler, seq: Sequence) -> FinishedRequest:
    """R10 on an applied token: ``seq`` leaves its queue (``running``, its blocks freed;
    or, a stale delivery, ``waiting``) and the engine."""
    if seq.status is _RUNNING:
        sched.running.remove(seq)
        return finish(sched, seq)
    sched.waiting.remove(seq)
    return retire(sched, seq)
