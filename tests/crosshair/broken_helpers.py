"""Deliberately broken copies of spec helpers: the planted bugs CrossHair must find.

Not part of the spec (nothing imports this module but the tests): each function keeps
the contract of the spec function it copies, with a bug of the kind the differential
suite's mutants plant. ``tests/crosshair/test_crosshair.py`` runs ``crosshair check``
on this module and expects a counterexample for each, and ``crosshair diffbehavior``
on ``engine_blocks_needed_floor`` against the spec and expects a difference.
"""

from __future__ import annotations

from spec.kv import cdiv
from spec.types import RequestState
from tests.crosshair.adapters import blocks_needed_domain


def blocks_needed_off_by_one(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> int:
    """``spec.kv.blocks_needed`` with the held blocks rounded down (a partly filled last
    block forgotten): off by one whenever ``computed`` is not a multiple of the size.

    pre: num_computed_tokens >= 0
    pre: num_new_tokens >= 0
    pre: block_size >= 1
    post: 0 <= __return__ <= cdiv(num_new_tokens, block_size)
    """
    return cdiv(num_computed_tokens + num_new_tokens, block_size) - (
        num_computed_tokens // block_size
    )


def lifo_victim_wrong_end(candidates: tuple[RequestState, ...]) -> int:
    """``spec.policies.lifo_victim`` taken from the wrong end: the oldest candidate.

    pre: len(candidates) >= 1
    post: __return__ == len(candidates) - 1
    """
    return 0


def engine_blocks_needed_floor(
    num_computed_tokens: int, num_new_tokens: int, block_size: int
) -> int:
    """An engine-style ``need`` with the same rounding bug, for ``diffbehavior``
    against ``tests.crosshair.adapters.spec_blocks_needed`` (no contract: the diff finds it).
    """
    blocks_needed_domain(num_computed_tokens, num_new_tokens, block_size)
    return (
        (num_computed_tokens + num_new_tokens - 1) // block_size
        + 1
        - (num_computed_tokens // block_size)
    )
