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

from collections.abc import Callable
from dataclasses import dataclass

#: A pure next-token function: ``next_token(prompt + outputs so far) -> token id``.
TokenOracle = Callable[[tuple[int, ...]], int]

#: Draft tokens as a function of a request's tokens (prompt + outputs) alone.
Drafter = Callable[[tuple[int, ...]], tuple[int, ...]]

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


def seen_before(tokens: tuple[int, ...], draft: tuple[int, ...]) -> bool:
    """Whether ``draft`` is empty or occurs in ``tokens`` at some position after the first."""
    return draft == () or any(tokens[s : s + len(draft)] == draft for s in range(1, len(tokens)))


@dataclass(frozen=True, slots=True)
class PromptLookupDrafter:
    """Draft tokens by prompt lookup: vLLM's speculative ``method: "ngram"``, as a pure
    function of the request's tokens (prompt + outputs), like the token oracles.

    The n-gram is the longest suffix of ``tokens``, of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens, that also occurs earlier (ending before the last
    token); of its occurrences the earliest is used, and the drafts are the up to
    ``num_speculative_tokens`` tokens that follow it, never past the end of ``tokens``
    nor, with ``max_model_len``, past ``max_model_len - len(tokens)`` (the semantics of
    ``_find_longest_matched_ngram_and_propose_tokens``, v1/spec_decode/ngram_proposer.py:
    209-295). No match, or fewer than ``prompt_lookup_min`` tokens: no drafts.
    """

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_model_len: int | None = None

    def __call__(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """pre: 1 <= self.prompt_lookup_min <= self.prompt_lookup_max
        pre: self.num_speculative_tokens >= 1
        post: len(__return__) <= self.num_speculative_tokens and seen_before(tokens, __return__)
        """
        total = len(tokens)
        room = self.num_speculative_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - total)
        if total < self.prompt_lookup_min or room <= 0:
            return ()
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            suffix = tokens[total - n :]
            for start in range(total - n):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + room]
        return ()


@dataclass(frozen=True, slots=True)
class OracleDrafter:
    """Drafts a token oracle's own next ``k`` tokens, but for a wrong one at
    ``first_wrong`` (``k`` or more: every draft right), so that a greedy model sampling
    ``oracle`` accepts exactly ``first_wrong`` of them: a drafter whose acceptance a
    test chooses (prompt lookup on random tokens is mostly rejected).
    """

    oracle: TokenOracle
    k: int
    first_wrong: int

    def __call__(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """pre: self.k >= 0
        post: len(__return__) == self.k
        """
        drafts: list[int] = []
        for i in range(self.k):
            token = self.oracle((*tokens, *drafts))
            drafts.append(token + 1 if i == self.first_wrong else token)
        return tuple(drafts)
