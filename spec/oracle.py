"""Pure toy token oracles: the next token as a function of the prefix alone.

A step takes either explicit sampled tokens or an oracle ``next_token(prefix) -> int``
called with the request's prompt + outputs so far. Because an oracle sees nothing but
the prefix, a request's outputs cannot depend on what it was batched with, preempted
by or how its prefill was chunked: the property tests use this to check that
preemption (recompute, swap, even restart) never changes a request's outputs. They
stand in for a batch-invariant greedy model.

The oracles are frozen dataclasses (comparable, printable, hashable) with a
``__call__``; none validates in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass

_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class HashOracle:
    """A pseudo-random token: an FNV-1a hash of the whole prefix (and ``salt``), mod vocab.

    With a small ``vocab_size`` it samples any given token (an EOS, say) often, which
    is what tests of the stop rule want.
    """

    vocab_size: int
    salt: int = 0

    def __call__(self, prefix: tuple[int, ...]) -> int:
        """pre: self.vocab_size >= 1
        post: 0 <= __return__ < self.vocab_size
        """
        h = ((self.salt * _GOLDEN) ^ len(prefix)) & _MASK
        for token in prefix:
            h = ((h ^ (token & _MASK)) * _FNV_PRIME) & _MASK
        h ^= h >> 29
        return h % self.vocab_size


@dataclass(frozen=True, slots=True)
class ConstantOracle:
    """Always the same token."""

    token: int = 0

    def __call__(self, prefix: tuple[int, ...]) -> int:
        """post: __return__ == self.token"""
        return self.token


@dataclass(frozen=True, slots=True)
class SuccessorOracle:
    """The last token plus one, mod ``vocab_size``: cheap, and easy to read in a trace.

    pre of ``__call__``: a non-empty prefix (a request always has a prompt).
    """

    vocab_size: int

    def __call__(self, prefix: tuple[int, ...]) -> int:
        """pre: self.vocab_size >= 1
        pre: len(prefix) >= 1
        post: 0 <= __return__ < self.vocab_size
        """
        return (prefix[-1] + 1) % self.vocab_size
