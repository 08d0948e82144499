"""Integer distributions for generated workloads, written on the command line.

Syntax (all bounds inclusive, all values positive or zero as the caller requires):

- ``N``: always ``N``;
- ``MIN:MAX`` or ``uniform:MIN:MAX``: uniform over ``MIN..MAX``;
- ``longtail:MIN:MAX[:ALPHA]``: a bounded Pareto over ``MIN..MAX`` with shape
  ``ALPHA`` (default 1.2): most draws near ``MIN``, a few near ``MAX`` (the usual
  shape of output lengths in serving traces).

Draws come from a caller's ``random.Random``, so a seed fixes a whole workload.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DEFAULT_ALPHA = 1.2


class DistributionSyntaxError(ValueError):
    """A distribution string does not parse; argparse shows the message."""


@dataclass(frozen=True, slots=True)
class IntDistribution:
    """``kind`` is ``uniform`` or ``longtail``; a constant is ``uniform`` with ``low == high``."""

    kind: str
    low: int
    high: int
    alpha: float = DEFAULT_ALPHA

    def sample(self, rng: random.Random) -> int:
        if self.low == self.high:
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        # Bounded Pareto on [low, high + 1) by inverse CDF, floored to an integer.
        lo = float(max(self.low, 1))
        hi = float(self.high + 1)
        u = rng.random()
        ratio = (lo / hi) ** self.alpha
        x: float = lo / (1.0 - u * (1.0 - ratio)) ** (1.0 / self.alpha)
        return max(self.low, min(self.high, math.floor(x)))

    def __str__(self) -> str:
        if self.low == self.high:
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}:{self.high}"
        return f"longtail:{self.low}:{self.high}:{self.alpha:g}"


def _int(text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DistributionSyntaxError(f"{spec!r}: {text!r} is not an integer") from None


def parse_distribution(spec: str, *, minimum: int = 0) -> IntDistribution:
    """Parse ``spec``; every value it can draw must be ``>= minimum``."""
    parts = spec.strip().split(":")
    kind = "uniform"
    alpha = DEFAULT_ALPHA
    if parts[0] in ("uniform", "longtail"):
        kind = parts.pop(0)
    if kind == "longtail":
        if len(parts) not in (2, 3):
            raise DistributionSyntaxError(
                f"{spec!r}: expected longtail:MIN:MAX or longtail:MIN:MAX:ALPHA"
            )
        if len(parts) == 3:
            try:
                alpha = float(parts[2])
            except ValueError:
                raise DistributionSyntaxError(f"{spec!r}: {parts[2]!r} is not a number") from None
            if not (math.isfinite(alpha) and alpha > 0):
                raise DistributionSyntaxError(f"{spec!r}: ALPHA must be a positive number")
            parts = parts[:2]
    if len(parts) == 1 and kind == "uniform" and spec.strip() == parts[0]:
        low = high = _int(parts[0], spec)
    elif len(parts) == 2:
        low, high = _int(parts[0], spec), _int(parts[1], spec)
    else:
        raise DistributionSyntaxError(
            f"{spec!r}: expected N, MIN:MAX, uniform:MIN:MAX or longtail:MIN:MAX[:ALPHA]"
        )
    if low > high:
        raise DistributionSyntaxError(f"{spec!r}: MIN {low} is greater than MAX {high}")
    if low < minimum:
        raise DistributionSyntaxError(f"{spec!r}: values must be >= {minimum}")
    return IntDistribution(kind=kind, low=low, high=high, alpha=alpha)
