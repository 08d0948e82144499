"""argparse value types whose errors read as one line (``argument --x: ...``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvsched.distributions import DistributionSyntaxError, IntDistribution, parse_distribution


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def any_int(text: str) -> int:
    return _int(text)


def torch_seed(text: str) -> int:
    """A seed ``torch.Generator.manual_seed`` takes: a 64-bit value, signed or not."""
    value = _int(text)
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in -2**63..2**64-1, got {text!r}")
    return value


def thread_count(text: str) -> int:
    """1 to the CPUs usable, as the engine counts them (``impl.engine``, which imports
    torch: so ``--threads`` is the one option whose check waits for torch)."""
    value = _int(text)
    from impl.engine import available_cpus  # noqa: PLC0415  (see above)

    cpus = available_cpus()
    if not 1 <= value <= cpus:
        raise argparse.ArgumentTypeError(
            f"must be an integer in 1..{cpus} (the CPUs this process may use), got {text!r}"
        )
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def distribution(minimum: int) -> Callable[[str], IntDistribution]:
    def parse(text: str) -> IntDistribution:
        try:
            return parse_distribution(text, minimum=minimum)
        except DistributionSyntaxError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "distribution"
    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse
