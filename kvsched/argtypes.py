"""argparse value types whose errors read as one line (``argument --x: ...``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from kvsched.distributions import DistributionSyntaxError, IntDistribution, parse_distribution
from spec.oracle import PromptLookupDrafter


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


#: vLLM's ``speculative_config`` keys this project reads (``config/speculative.py``).
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_config(text: str) -> PromptLookupDrafter:
    """``--speculative-config JSON``: vLLM's n-gram ``speculative_config``, with vLLM's
    keys and defaulting (``config/speculative.py:1197-1220``): ``method`` ``"ngram"``,
    ``num_speculative_tokens`` required, ``prompt_lookup_min``/``_max`` 5 when both are
    missing, else the missing one equals the other, and min <= max."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg} (got {text!r})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
    if unknown:
        known = ", ".join(SPECULATIVE_KEYS)
        raise argparse.ArgumentTypeError(f"unknown key(s) {unknown} (known: {known})")
    if value.get("method") != "ngram":
        raise argparse.ArgumentTypeError(
            f'method must be "ngram" (the n-gram drafter), got {value.get("method")!r}'
        )
    numbers: dict[str, int] = {}
    for key in SPECULATIVE_KEYS[1:]:
        number = value.get(key)
        if number is None:
            continue
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise argparse.ArgumentTypeError(f"{key} must be a positive integer, got {number!r}")
        numbers[key] = number
    if "num_speculative_tokens" not in numbers:
        raise argparse.ArgumentTypeError("num_speculative_tokens is required")
    low = numbers.get("prompt_lookup_min", numbers.get("prompt_lookup_max", 5))
    high = numbers.get("prompt_lookup_max", low)
    if low > high:
        raise argparse.ArgumentTypeError(
            f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
        )
    return PromptLookupDrafter(
        num_speculative_tokens=numbers["num_speculative_tokens"],
        prompt_lookup_min=low,
        prompt_lookup_max=high,
    )
