"""How the differential machines fail: a named invariant, or a fault armed on purpose.

A failure is an ``InvariantViolation`` whose message starts with ``[invariant-name]``
(scripts/mutation_check.py reports that name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


class InvariantViolation(AssertionError):
    """A named invariant broke; the message starts with ``[name]``."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


class InjectedFault(RuntimeError):
    """Raised on purpose by a fault the machine armed (a forward or a swap copy)."""


def fail(invariant: str, message: str) -> NoReturn:
    raise InvariantViolation(invariant, message)


def require(ok: bool, invariant: str, message: str | Callable[[], str]) -> None:
    """Raise ``InvariantViolation(invariant, ...)`` unless ``ok``; a callable message is
    only built on failure (most checks run on every step)."""
    if not ok:
        raise InvariantViolation(invariant, message if isinstance(message, str) else message())
