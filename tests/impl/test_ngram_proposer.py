"""NgramProposer, the engine's prompt-lookup drafter, against the spec's restatement of
the same semantics (``spec.oracle.PromptLookupDrafter``), and on hand-made cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.ngram_proposer import NgramProposer
from spec.oracle import PromptLookupDrafter

#: Token values whose int64 bytes overlap across token boundaries (256 = 00 01 00.., 1 =
#: 01 00.., -1 = ff ff..): a byte search finds misaligned "matches" the proposer must skip.
TRICKY_TOKENS = [0, 1, 255, 256, 65_536, 2**32, 2**40 + 1, 2**63 - 1, -1, -256]


@st.composite
def drafter_args(
    draw: st.DrawFn, tokens: st.SearchStrategy[list[int]]
) -> tuple[list[int], int, int, int, int | None]:
    token_ids = draw(tokens)
    k = draw(st.integers(1, 6))
    low = draw(st.integers(1, 4))
    high = draw(st.integers(low, 6))
    max_model_len = draw(st.none() | st.integers(-2, 8).map(lambda extra: len(token_ids) + extra))
    return token_ids, k, low, high, max_model_len


def small_vocab_tokens() -> st.SearchStrategy[list[int]]:
    return st.integers(1, 4).flatmap(lambda vocab: st.lists(st.integers(0, vocab - 1), max_size=40))


def assert_agrees(args: tuple[list[int], int, int, int, int | None]) -> list[int]:
    token_ids, k, low, high, max_model_len = args
    proposer = NgramProposer(
        num_speculative_tokens=k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        max_model_len=max_model_len,
    )
    reference = PromptLookupDrafter(k, low, high, max_model_len=max_model_len)
    before = list(token_ids)
    drafts = proposer.propose(token_ids)
    assert token_ids == before  # not mutated
    assert isinstance(drafts, list)
    assert tuple(drafts) == reference(tuple(token_ids))
    assert len(drafts) <= k
    if max_model_len is not None:
        assert len(token_ids) + len(drafts) <= max(max_model_len, len(token_ids))
    return drafts


@settings(deadline=None)
@given(drafter_args(small_vocab_tokens()))
def test_agrees_with_the_spec_on_small_vocabularies(
    args: tuple[list[int], int, int, int, int | None],
) -> None:
    assert_agrees(args)


@settings(deadline=None)
@given(drafter_args(st.lists(st.sampled_from(TRICKY_TOKENS), max_size=30)))
def test_agrees_with_the_spec_on_byte_overlapping_tokens(
    args: tuple[list[int], int, int, int, int | None],
) -> None:
    assert_agrees(args)


@settings(deadline=None)
@given(
    period=st.lists(st.integers(0, 255), min_size=1, max_size=6),
    repeats=st.integers(2, 6),
    tail=st.integers(0, 5),
    k=st.integers(1, 6),
)
def test_a_periodic_sequence_drafts_its_continuation(
    period: list[int], repeats: int, tail: int, k: int
) -> None:
    """On ``period`` repeated (prompt lookup's best case), with n-grams up to the
    period's length, the drafts continue the period: the last period occurred a period
    earlier, and every occurrence of it is followed by the same continuation."""
    p = len(period)
    tokens = (period * (repeats + 1))[: p * repeats + tail]
    drafts = assert_agrees((tokens, k, 1, p, None))
    n = len(tokens)
    assert min(k, p) <= len(drafts)
    assert drafts == [period[i % p] for i in range(n, n + len(drafts))]


def propose(
    tokens: list[int], *, k: int, low: int, high: int, max_model_len: int | None = None
) -> list[int]:
    drafts = NgramProposer(
        num_speculative_tokens=k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        max_model_len=max_model_len,
    ).propose(tokens)
    assert tuple(drafts) == PromptLookupDrafter(k, low, high, max_model_len=max_model_len)(
        tuple(tokens)
    )
    return drafts


def test_the_longest_ngram_wins() -> None:
    # Suffix 1 2 3: the 3-gram occurs at 4 (then 8 8), the 2-gram 2 3 earlier, at 0.
    tokens = [2, 3, 7, 7, 1, 2, 3, 8, 8, 0, 1, 2, 3]
    assert propose(tokens, k=2, low=1, high=3) == [8, 8]
    assert propose(tokens, k=2, low=1, high=2) == [7, 7]  # no 3-grams: the 2-gram's
    assert propose(tokens, k=2, low=3, high=5) == [8, 8]  # no 4- or 5-gram matches


def test_the_earliest_occurrence_wins() -> None:
    tokens = [5, 1, 4, 5, 2, 6, 5]
    assert propose(tokens, k=2, low=1, high=1) == [1, 4]
    assert propose(tokens, k=3, low=1, high=3) == [1, 4, 5]


def test_the_occurrence_must_end_before_the_last_token() -> None:
    assert propose([1, 2, 3], k=3, low=1, high=3) == []  # the suffix itself is no match
    assert propose([3], k=3, low=1, high=1) == []
    assert propose([3, 3], k=3, low=1, high=1) == [3]
    # 4 4 4: the 2-gram 4 4 at 0 ends at 1, before the last; one token follows it.
    assert propose([4, 4, 4], k=5, low=1, high=2) == [4]


def test_nothing_past_the_end_of_the_tokens() -> None:
    tokens = [9, 8, 7, 6, 9]
    assert propose(tokens, k=10, low=1, high=1) == [8, 7, 6, 9]
    assert propose(tokens, k=2, low=1, high=1) == [8, 7]


def test_fewer_tokens_than_the_shortest_ngram() -> None:
    assert propose([1, 1], k=2, low=3, high=4) == []
    assert propose([], k=2, low=1, high=1) == []
    assert propose([1, 1, 1], k=2, low=3, high=4) == []  # the only 3-gram is the suffix


def test_max_model_len_leaves_room() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # suffix 1 2 matches at 0: 3 4 5 6 ...
    assert propose(tokens, k=4, low=1, high=2) == [3, 4, 5, 6]
    assert propose(tokens, k=4, low=1, high=2, max_model_len=14) == [3, 4, 5, 6]
    assert propose(tokens, k=4, low=1, high=2, max_model_len=12) == [3, 4]
    assert propose(tokens, k=4, low=1, high=2, max_model_len=11) == [3]
    assert propose(tokens, k=4, low=1, high=2, max_model_len=10) == []
    assert propose(tokens, k=4, low=1, high=2, max_model_len=9) == []


def test_a_misaligned_byte_match_is_no_match() -> None:
    # 256 0 as int64 bytes: 00 01 00 00 00 00 00 00 | 00 ..., which holds the bytes of
    # token 1 (01 00 00 00 00 00 00 00) one byte in.
    assert propose([256, 0, 7, 1], k=2, low=1, high=1) == []
    # ... and an aligned occurrence after a misaligned one is found.
    assert propose([256, 0, 1, 5, 1], k=2, low=1, high=1) == [5, 1]


@pytest.mark.parametrize(
    ("k", "low", "high"),
    [(0, 1, 1), (-1, 1, 2), (1, 0, 1), (1, 0, 0), (1, 3, 2), (2, -1, 3)],
)
def test_invalid_arguments_raise(k: int, low: int, high: int) -> None:
    with pytest.raises(ValueError):
        NgramProposer(num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)
