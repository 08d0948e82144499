"""The step's ``StepPlan``, built from a committed ``SchedulerOutput``.

The plan is columns (``spec.types.StepPlan``): the ids come from the scheduled
requests, the token counts are ``num_scheduled`` as phases A-C recorded them, and the
starts and sampled ids are what ``commit`` recorded on its one pass over the chunks
(the sampled ids only when some chunk does not sample: otherwise they are the
scheduled ids). So a step costs a few tuples, not an object per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence as Seq
from spec.types import FinishedRequest, Preemption, StepPlan


def make_plan(out: SchedulerOutput, finished: Sequence[FinishedRequest]) -> StepPlan:
    """The step's ``StepPlan``, after ``commit(out, ...)`` returned ``finished``."""
    scheduled_ids = tuple([seq.request_id for seq in out.scheduled])
    # Filled by commit only when some chunk does not sample, and by a verify step always
    # (a request's run is as many entries): else they are the scheduled ids.
    if out.sampled_ids or not out.every_chunk_samples():
        sampled_ids = tuple(out.sampled_ids)
    else:
        sampled_ids = scheduled_ids
    return _plan(out, scheduled_ids, sampled_ids, out.sampled_token_ids, finished)


def make_async_plan(
    out: SchedulerOutput,
    sampled: Sequence[Seq],
    sampled_token_ids: Sequence[int],
    finished: Sequence[FinishedRequest],
) -> StepPlan:
    """An async step's ``StepPlan`` (impl/pipeline.py): the decisions of ``out`` (advanced,
    so its starts are recorded) with the tokens and finished requests of the step it
    applied."""
    scheduled_ids = tuple([seq.request_id for seq in out.scheduled])
    sampled_ids = tuple([seq.request_id for seq in sampled])
    return _plan(out, scheduled_ids, sampled_ids, tuple(sampled_token_ids), finished)


def _plan(
    out: SchedulerOutput,
    scheduled_ids: tuple[str, ...],
    sampled_ids: tuple[str, ...],
    sampled_token_ids: tuple[int, ...],
    finished: Sequence[FinishedRequest],
) -> StepPlan:
    # Victims and swap-ins are rare: most steps skip building their (empty) columns.
    preempted = out.preempted
    swapped_in = out.swapped_in
    return StepPlan(
        step=out.step,
        scheduled_ids=scheduled_ids,
        num_computed_tokens=tuple(out.starts),
        num_scheduled_tokens=tuple(out.num_scheduled),
        preempted=tuple([Preemption(request_id=r.seq.request_id, mode=r.mode) for r in preempted])
        if preempted
        else (),
        swapped_in=tuple([seq.request_id for seq, _ in swapped_in]) if swapped_in else (),
        sampled_ids=sampled_ids,
        sampled_token_ids=sampled_token_ids,
        finished=tuple(finished),
    )
