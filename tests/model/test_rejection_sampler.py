"""verify_drafts: greedy acceptance at temperature 0, and rejection sampling at
temperature > 0 that leaves each output token distributed exactly as without drafts.

The distributional tests draw the runs of many seeds (fixed: the statistics are the same
numbers on every run) and compare the empirical distribution of each run position,
given the drafts before it were accepted, with ``softmax(row / T)`` by a chi-square
statistic. The bound is the chi-square quantile of a one-in-a-million false alarm, so it
was not tuned to these seeds; deliberately wrong samplers written here (accept every
draft, resample from ``p`` with the draft left in, one uniform for every draft, the
bonus token from the wrong row) exceed it by orders of magnitude, and a correct sampler
written independently here stays below it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.rejection_sampler import verify_drafts
from model.sampling import sample_token

#: The chi-square quantile of 1 - 1e-6 with 4 degrees of freedom (a vocabulary of 5):
#: ``scipy.stats.chi2.ppf(1 - 1e-6, 4)``.
CHI2_LIMIT = 33.38
#: Each cell of a checked row expects at least this many samples (chi-square's rule).
MIN_EXPECTED = 5.0
NUM_SEEDS = 12_000
OUTPUT_INDEX = 3

#: vocab 5: row i scores the token after draft i - 1, the last row is the bonus row.
LOGITS = torch.tensor(
    [
        [0.0, 2.0, 0.5, -1.0, 1.0],
        [1.0, -1.0, 0.0, 0.5, -0.5],
        [0.3, -0.2, 1.0, 0.0, -1.0],
    ],
    dtype=torch.float64,
)
TEMPERATURE = 1.3

Sampler = Callable[..., list[int]]


def probs_of(logits: torch.Tensor, temperature: float) -> list[list[float]]:
    rows: list[list[float]] = torch.softmax(logits / temperature, dim=1).tolist()
    return rows


def chi_square(counts: Counter[int], probs: Sequence[float]) -> float:
    """Pearson's statistic of ``counts`` against ``probs``; infinite for a token
    outside the vocabulary."""
    n = sum(counts.values())
    if any(not 0 <= token < len(probs) for token in counts):
        return float("inf")
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(probs))


def row_statistics(
    sampler: Sampler, drafts: tuple[int, ...], *, num_seeds: int = NUM_SEEDS
) -> dict[int, float]:
    """For each run position ``i`` with enough samples: the chi-square of ``run[i]``
    over the seeds whose run accepted ``drafts[:i]``, against ``softmax(row i / T)``."""
    probs = probs_of(LOGITS, TEMPERATURE)
    runs = [
        sampler(LOGITS, drafts, temperature=TEMPERATURE, seed=seed, output_index=OUTPUT_INDEX)
        for seed in range(num_seeds)
    ]
    stats: dict[int, float] = {}
    for i in range(len(drafts) + 1):
        counts = Counter(run[i] for run in runs if len(run) > i and run[:i] == list(drafts[:i]))
        if sum(counts.values()) * min(probs[i]) >= MIN_EXPECTED:
            stats[i] = chi_square(counts, probs[i])
    return stats


def reference_sampler(flaw: str) -> Sampler:
    """A rejection sampler written here, from ``random.Random``, correct for ``flaw ==
    "none"`` and otherwise wrong in the one way ``flaw`` names."""

    def sample(
        logits: torch.Tensor,
        drafts: Sequence[int],
        *,
        temperature: float,
        seed: int,
        output_index: int,
    ) -> list[int]:
        rng = random.Random(seed * 1_000_003 + output_index)
        probs = probs_of(logits, temperature)
        tokens = range(len(probs[0]))
        shared = rng.random()
        run: list[int] = []
        for i, draft in enumerate(drafts):
            u = shared if flaw == "shared_uniform" else rng.random()
            if flaw == "accept_always" or u < probs[i][draft]:
                run.append(draft)
                continue
            residual = list(probs[i])
            if flaw != "resample_from_p":
                residual[draft] = 0.0
            run.append(rng.choices(tokens, weights=residual)[0])
            return run
        last = len(drafts) - 1 if flaw == "bonus_from_previous_row" else len(drafts)
        run.append(rng.choices(tokens, weights=probs[last])[0])
        return run

    return sample


# --- temperature 0 ------------------------------------------------------------------------


GREEDY_LOGITS = torch.tensor(
    [
        [0.0, 3.0, 1.0, 2.0],  # argmax 1
        [5.0, 5.0, 1.0, 0.0],  # a tie: the lowest id, 0
        [0.0, 1.0, 2.0, 9.0],  # argmax 3
        [1.0, 0.0, 4.0, 2.0],  # argmax 2 (the bonus row)
    ],
    dtype=torch.float64,
)
GREEDY_TARGETS = [1, 0, 3, 2]


@pytest.mark.parametrize("first_wrong", range(4))
def test_greedy_accepts_drafts_up_to_the_first_mismatch(first_wrong: int) -> None:
    drafts = list(GREEDY_TARGETS[:3])
    if first_wrong < 3:
        drafts[first_wrong] = (drafts[first_wrong] + 1) % 4
    run = verify_drafts(GREEDY_LOGITS, drafts, temperature=0.0, seed=5, output_index=7)
    assert run == GREEDY_TARGETS[: first_wrong + 1]


def test_greedy_all_accepted_ends_with_the_bonus_rows_argmax() -> None:
    run = verify_drafts(GREEDY_LOGITS, [1, 0, 3], temperature=0.0, seed=None, output_index=0)
    assert run == [1, 0, 3, 2]


def test_greedy_tie_is_not_broken_towards_the_draft() -> None:
    # Token 1 ties token 0 at row 1; the tie goes to 0 as in sample_token.
    run = verify_drafts(GREEDY_LOGITS, [1, 1, 3], temperature=0.0, seed=None, output_index=0)
    assert run == [1, 0]


@pytest.mark.parametrize("pad_at", range(3))
def test_greedy_never_accepts_a_pad(pad_at: int) -> None:
    drafts = list(GREEDY_TARGETS[:3])
    drafts[pad_at] = -1
    run = verify_drafts(GREEDY_LOGITS, drafts, temperature=0.0, seed=None, output_index=0)
    assert run == GREEDY_TARGETS[: pad_at + 1]
    assert -1 not in run


def test_a_uniform_row_with_a_pad_gives_token_zero_not_the_pad() -> None:
    run = verify_drafts(
        torch.zeros(2, 6, dtype=torch.float64), [-1], temperature=0.0, seed=None, output_index=0
    )
    assert run == [0]


@settings(deadline=None)
@given(
    data=st.data(),
    num_drafts=st.integers(0, 5),
    vocab=st.integers(1, 6),
)
def test_greedy_run_is_one_token_at_a_time_greedy_decoding(
    data: st.DataObject, num_drafts: int, vocab: int
) -> None:
    """The run equals greedy decoding row by row (sample_token at temperature 0, ties
    to the lowest id) for as long as the drafts agree with it."""
    # Small integer logits make ties common.
    values = data.draw(
        st.lists(
            st.lists(st.integers(-2, 2), min_size=vocab, max_size=vocab),
            min_size=num_drafts + 1,
            max_size=num_drafts + 1,
        )
    )
    logits = torch.tensor(values, dtype=torch.float64)
    targets = [sample_token(row, temperature=0.0, seed=None, output_index=0) for row in logits]
    drafts = [
        data.draw(st.sampled_from([targets[i], targets[i], -1, vocab, *range(vocab)]))
        for i in range(num_drafts)
    ]
    expected: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        expected.append(draft)
    expected.append(targets[len(expected)])
    run = verify_drafts(logits, drafts, temperature=0.0, seed=3, output_index=1)
    assert run == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rows", [0, 1, 2, 4])
def test_wrong_row_count_raises(temperature: float, rows: int) -> None:
    logits = torch.zeros(rows, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits rows"):
        verify_drafts(logits, [1, 2], temperature=temperature, seed=0, output_index=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize(("nan_row", "drafts"), [(0, []), (0, [1]), (1, [1])])
def test_nan_logits_raise_as_in_the_sampler(
    temperature: float, nan_row: int, drafts: list[int]
) -> None:
    """A NaN is refused, as sample_token refuses it, never taken for the argmax (it
    was: at temperature 0 the NaN's id was returned, and a draft equal to it accepted)."""
    logits = torch.tensor([[0.0, 1.0, 3.0]] * (len(drafts) + 1), dtype=torch.float64)
    logits[nan_row, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sample_token(logits[nan_row], temperature=temperature, seed=0, output_index=0)
    with pytest.raises(ValueError, match="NaN"):
        verify_drafts(logits, drafts, temperature=temperature, seed=0, output_index=0)


def test_one_dimensional_logits_raise() -> None:
    with pytest.raises(ValueError, match="logits rows"):
        verify_drafts(
            torch.zeros(5, dtype=torch.float64), [], temperature=0.0, seed=0, output_index=0
        )


# --- temperature > 0: exact draws ---------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 2.0])
def test_without_drafts_the_token_is_sample_tokens(temperature: float) -> None:
    row = LOGITS[1]
    for seed in (None, 0, 1, 17, 2**40):
        for index in (0, 1, 9, 123):
            run = verify_drafts(
                row[None], [], temperature=temperature, seed=seed, output_index=index
            )
            expected = sample_token(row, temperature=temperature, seed=seed, output_index=index)
            assert run == [expected]


def test_runs_are_a_function_of_seed_and_output_index() -> None:
    drafts = [1, 0]
    first = [
        verify_drafts(LOGITS, drafts, temperature=TEMPERATURE, seed=s, output_index=4)
        for s in range(300)
    ]
    torch.manual_seed(12345)  # the global RNG state must not matter ...
    torch.rand(10)
    expected_global = torch.rand(3)
    torch.manual_seed(12345)
    torch.rand(10)
    again = [
        verify_drafts(LOGITS.clone(), drafts, temperature=TEMPERATURE, seed=s, output_index=4)
        for s in range(300)
    ]
    assert torch.equal(torch.rand(3), expected_global)  # ... nor be consumed
    assert again == first
    # Logits of another dtype are widened to float64 first: the runs of the widened ones.
    low = LOGITS.to(torch.float32)
    assert [
        verify_drafts(low, drafts, temperature=TEMPERATURE, seed=s, output_index=4)
        for s in range(100)
    ] == [
        verify_drafts(low.double(), drafts, temperature=TEMPERATURE, seed=s, output_index=4)
        for s in range(100)
    ]
    # Another output index draws otherwise, and so does another seed.
    shifted = [
        verify_drafts(LOGITS, drafts, temperature=TEMPERATURE, seed=s, output_index=5)
        for s in range(300)
    ]
    assert shifted != first
    assert len({tuple(run) for run in first}) > 5
    none_seed = verify_drafts(LOGITS, drafts, temperature=TEMPERATURE, seed=None, output_index=4)
    assert none_seed == first[0]  # seed None is seed 0


@pytest.mark.parametrize("bad_draft", [-1, 5, 1000])
def test_no_draft_outside_the_vocabulary_is_accepted(bad_draft: int) -> None:
    for seed in range(300):
        run = verify_drafts(
            LOGITS, [bad_draft, 0], temperature=TEMPERATURE, seed=seed, output_index=0
        )
        assert len(run) == 1
        assert 0 <= run[0] < 5


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never() -> None:
    inf = float("inf")
    logits = torch.tensor(
        [[-inf, 0.0, -inf, -inf], [0.0, 0.0, -inf, 0.0], [1.0, 2.0, 3.0, 4.0]],
        dtype=torch.float64,
    )
    for seed in range(200):
        run = verify_drafts(logits, [1, 2], temperature=0.7, seed=seed, output_index=2)
        assert run[0] == 1  # p = 1: accepted
        assert len(run) == 2  # p = 0: rejected ...
        assert run[1] in (0, 1, 3)  # ... and the row's token drawn from its support


# --- temperature > 0: the distribution ----------------------------------------------------


#: (drafts, the run positions with enough samples to check): likely drafts (p 0.48,
#: then 0.37) check the bonus row too; unlikely ones (p 0.05, then 0.08) fewer rows.
DRAFT_CASES = [((1, 0), {0, 1, 2}), ((3, 1), {0, 1})]


@pytest.mark.parametrize(("drafts", "rows"), DRAFT_CASES)
def test_each_run_token_is_distributed_as_the_model(
    drafts: tuple[int, ...], rows: set[int]
) -> None:
    stats = row_statistics(verify_drafts, drafts)
    assert set(stats) == rows
    assert all(value < CHI2_LIMIT for value in stats.values()), stats


@pytest.mark.parametrize(("drafts", "rows"), DRAFT_CASES)
def test_an_independent_correct_sampler_passes_the_same_statistic(
    drafts: tuple[int, ...], rows: set[int]
) -> None:
    stats = row_statistics(reference_sampler("none"), drafts)
    assert set(stats) == rows
    assert all(value < CHI2_LIMIT for value in stats.values()), stats


@pytest.mark.parametrize(
    ("flaw", "caught_at"),
    [
        ("accept_always", 0),
        ("resample_from_p", 0),
        ("shared_uniform", 1),  # row 0 is right: only the conditional statistic sees it
        ("bonus_from_previous_row", 2),  # only the bonus row's statistic sees it
    ],
)
def test_a_wrong_sampler_fails_the_statistic(flaw: str, caught_at: int) -> None:
    stats = row_statistics(reference_sampler(flaw), (1, 0))
    assert stats[caught_at] > 3 * CHI2_LIMIT, stats
    assert all(stats[i] < CHI2_LIMIT for i in range(caught_at)), stats
