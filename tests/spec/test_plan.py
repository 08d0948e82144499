"""``StepPlan`` is columns: built from chunk lists, read back as chunks, compared with ``==``."""

from __future__ import annotations

import pytest

from spec.types import (
    FinishedRequest,
    FinishReason,
    Preemption,
    PreemptionMode,
    SampledToken,
    ScheduledChunk,
    StepPlan,
)

CHUNKS = (
    ScheduledChunk(request_id="a", start=4, num_tokens=1),
    ScheduledChunk(request_id="b", start=0, num_tokens=3),
)
SAMPLED = (SampledToken(request_id="a", token_id=7),)
FINISHED = (
    FinishedRequest(
        request_id="a", output_token_ids=(7,), finish_reason=FinishReason.LENGTH, num_preemptions=0
    ),
)


def plan(chunks: tuple[ScheduledChunk, ...] = CHUNKS) -> StepPlan:
    return StepPlan.of(
        step=3,
        scheduled=chunks,
        preempted=[Preemption(request_id="c", mode=PreemptionMode.SWAP)],
        swapped_in=(),
        sampled=SAMPLED,
        finished=FINISHED,
    )


def test_of_stores_columns_and_reads_back_the_chunks() -> None:
    p = plan()
    assert p.scheduled_ids == ("a", "b")
    assert p.num_computed_tokens == (4, 0)
    assert p.num_scheduled_tokens == (1, 3)
    assert (p.sampled_ids, p.sampled_token_ids) == (("a",), (7,))
    assert p.scheduled == CHUNKS and p.sampled == SAMPLED and p.finished == FINISHED


def test_plans_compare_by_value() -> None:
    assert plan() == plan()
    other = (CHUNKS[0], ScheduledChunk(request_id="b", start=0, num_tokens=2))
    assert plan() != plan(other)
    assert StepPlan(step=0) == StepPlan.of(step=0)


def test_columns_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk columns"):
        StepPlan(step=0, scheduled_ids=("a",), num_computed_tokens=(), num_scheduled_tokens=(1,))
    with pytest.raises(ValueError, match="sampled columns"):
        StepPlan(step=0, sampled_ids=("a",))
