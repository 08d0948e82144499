"""The first difference between two values, found by walking dataclasses.

``kvsched conform`` compares a spec value with an engine value (a ``StepPlan``, a
``SchedulerState``) and reports the first field that differs, with a path such as
``running[2].num_computed_tokens``. Sequences are compared element by element, so a
different victim shows up as ``preempted[0].request_id: 'r3' != 'r5'`` rather than as
two long tuples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from spec.types import StepPlan


class _Absent:
    """The value on the side of a sequence or mapping that has no such element."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


@dataclass(frozen=True, slots=True)
class Difference:
    path: str
    left: object
    right: object


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


_PLAN_ROWS = ("step", "scheduled", "preempted", "swapped_in", "sampled", "finished")


def first_difference(left: object, right: object, path: str = "") -> Difference | None:
    """The first place where ``left`` and ``right`` differ, or ``None`` if they are equal."""
    if isinstance(left, StepPlan) and isinstance(right, StepPlan):
        # A plan stores its chunks and samples as columns; compared as rows, a difference
        # names the request's chunk (``scheduled[1]``), not one column's index.
        for name in _PLAN_ROWS:
            d = first_difference(getattr(left, name), getattr(right, name), _join(path, name))
            if d is not None:
                return d
        return None
    if dataclasses.is_dataclass(left) and not isinstance(left, type):
        if type(left) is not type(right):
            return Difference(path, left, right)
        for f in dataclasses.fields(left):
            d = first_difference(getattr(left, f.name), getattr(right, f.name), _join(path, f.name))
            if d is not None:
                return d
        return None
    if isinstance(left, tuple | list) and isinstance(right, tuple | list):
        for i, (a, b) in enumerate(zip(left, right, strict=False)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d is not None:
                return d
        if len(left) != len(right):
            i = min(len(left), len(right))
            return Difference(
                f"{path}[{i}]",
                left[i] if i < len(left) else ABSENT,
                right[i] if i < len(right) else ABSENT,
            )
        return None
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        for key in sorted(set(left) | set(right), key=repr):
            d = first_difference(left.get(key, ABSENT), right.get(key, ABSENT), f"{path}[{key!r}]")
            if d is not None:
                return d
        return None
    if left != right:
        return Difference(path, left, right)
    return None


def short_repr(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
