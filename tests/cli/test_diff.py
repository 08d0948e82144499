"""first_difference walks dataclasses, sequences and mappings to the first differing leaf."""

from __future__ import annotations

from kvsched.diff import ABSENT, Difference, first_difference, short_repr
from spec.types import Preemption, PreemptionMode, ScheduledChunk, StepPlan


def _plan(victim: str, n: int = 3) -> StepPlan:
    return StepPlan.of(
        step=4,
        scheduled=(ScheduledChunk(request_id="a", start=0, num_tokens=n),),
        preempted=(Preemption(request_id=victim, mode=PreemptionMode.RECOMPUTE),),
    )


def test_equal_is_none() -> None:
    assert first_difference(_plan("b"), _plan("b")) is None


def test_finds_nested_field() -> None:
    assert first_difference(_plan("b"), _plan("c"), "plan") == Difference(
        "plan.preempted[0].request_id", "b", "c"
    )
    # A plan's chunks are compared as rows: the path names the chunk, not a column.
    assert first_difference(_plan("b", 3), _plan("c", 4), "plan") == Difference(
        "plan.scheduled[0].num_tokens", 3, 4
    )


def test_length_mismatch_names_the_extra_element() -> None:
    d = first_difference((1, 2), (1, 2, 3), "x")
    assert d == Difference("x[2]", ABSENT, 3)


def test_mappings_and_types() -> None:
    assert first_difference({"a": 1}, {"a": 2}) == Difference("['a']", 1, 2)
    assert first_difference({"a": 1}, {}) == Difference("['a']", 1, ABSENT)
    a = ScheduledChunk(request_id="a", start=0, num_tokens=1)
    assert first_difference(a, "a", "v") == Difference("v", a, "a")


def test_absent_reads_as_such() -> None:
    assert repr(ABSENT) == "(absent)"


def test_short_repr() -> None:
    assert short_repr("x" * 500, limit=20) == "'" + "x" * 16 + "..."
