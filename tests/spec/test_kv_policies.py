"""Block arithmetic (R2, R4), the policies (R9) and the toy oracles, one by one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec import (
    POLICIES,
    ConfigError,
    ConstantOracle,
    HashOracle,
    Policy,
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SuccessorOracle,
    blocks_needed,
    cdiv,
    get_policy,
    largest_prefill,
    max_cached_tokens,
    never_fits,
    select_victim,
)
from spec.oracle import PromptLookupDrafter
from tests.spec.helpers import config


@given(st.integers(0, 10**6), st.integers(1, 10**3))
def test_cdiv_is_ceiling_division(a: int, b: int) -> None:
    assert cdiv(a, b) == math.ceil(a / b)


@given(st.integers(0, 500), st.integers(0, 500), st.sampled_from([1, 2, 4, 16]))
def test_blocks_needed_grows_the_held_blocks(computed: int, n: int, bs: int) -> None:
    need = blocks_needed(computed, n, bs)
    assert cdiv(computed, bs) + need == cdiv(computed + n, bs)
    assert 0 <= need <= cdiv(n, bs)


def test_blocks_needed_fills_the_last_block_first() -> None:
    assert blocks_needed(5, 3, 4) == 0  # 5 -> 8 tokens: still 2 blocks
    assert blocks_needed(4, 1, 4) == 1  # a decode that opens a new block
    assert blocks_needed(5, 1, 4) == 0  # a decode into the last block's free slot


@st.composite
def r4_cases(draw: st.DrawFn) -> tuple[int, int, SchedulerConfig]:
    cfg = config(
        draw(st.integers(1, 20)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.integers(1, 80)),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(list(PreemptionMode))),
    )
    return draw(st.integers(1, 60)), draw(st.integers(1, 60)), cfg


@given(r4_cases())
def test_never_fits_restates_r4(case: tuple[int, int, SchedulerConfig]) -> None:
    prompt_len, max_tokens, cfg = case
    cached = prompt_len + max_tokens - 1
    mode = cfg.preemption_mode
    prefill = prompt_len if mode is PreemptionMode.RESTART else cached
    expected = math.ceil(cached / cfg.block_size) > cfg.num_gpu_blocks or (
        not cfg.enable_chunked_prefill and prefill > cfg.max_num_batched_tokens
    )
    assert never_fits(cfg, prompt_len, max_tokens) == expected
    assert max_cached_tokens(prompt_len, max_tokens) == cached
    assert largest_prefill(prompt_len, max_tokens, mode) == prefill


def rs(
    rid: str, arrival: int, *, prompt_len: int = 2, outputs: int = 0, priority: int = 0
) -> RequestState:
    request = Request(
        request_id=rid,
        prompt_token_ids=(1,) * prompt_len,
        params=SamplingParams(max_tokens=50, priority=priority),
        arrival=arrival,
    )
    return RequestState(request=request, output_token_ids=(3,) * outputs, num_computed_tokens=1)


def test_registry_and_unknown_policy() -> None:
    assert set(POLICIES) == {"lifo", "priority", "fewest-outputs", "reserve"}
    assert get_policy("lifo").name == "lifo"
    with pytest.raises(ConfigError):
        get_policy("fcfs")
    with pytest.raises(TypeError):
        POLICIES["mine"] = POLICIES["lifo"]  # type: ignore[index]


def test_lifo_victim_is_the_last_candidate() -> None:
    candidates = (rs("a", 0), rs("b", 5), rs("c", 1))
    assert get_policy("lifo").select_victim(candidates) == 2
    assert get_policy("lifo").order_waiting(candidates) == candidates


def test_priority_victim_and_order() -> None:
    policy = get_policy("priority")
    candidates = (rs("a", 0, priority=1), rs("b", 3, priority=0), rs("c", 1, priority=1))
    # largest (priority, arrival): (1, 1) -> c
    assert policy.select_victim(candidates) == 2
    order = policy.order_waiting(candidates)
    assert [r.request_id for r in order] == ["b", "a", "c"]


def test_fewest_outputs_victim_tie_breaks() -> None:
    policy = get_policy("fewest-outputs")
    assert policy.select_victim((rs("a", 0, outputs=3), rs("b", 1, outputs=1))) == 1
    # tie on outputs: the longest prompt
    tied = (rs("a", 0, outputs=1, prompt_len=5), rs("b", 1, outputs=1, prompt_len=2))
    assert policy.select_victim(tied) == 0
    # tie on both: the latest in running order
    same = (rs("a", 0, outputs=1), rs("b", 1, outputs=1), rs("c", 2, outputs=2))
    assert policy.select_victim(same) == 1
    assert policy.order_waiting(same) == same


def test_select_victim_rejects_an_out_of_range_index() -> None:
    bad = Policy(name="bad", select_victim=len, order_waiting=lambda w: w)
    with pytest.raises(ConfigError):
        select_victim(bad, (rs("a", 0),))


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=30), st.integers(1, 300))
def test_oracles_are_pure_and_in_range(prefix: list[int], vocab: int) -> None:
    tokens = tuple(prefix)
    for oracle in (HashOracle(vocab), HashOracle(vocab, salt=3), SuccessorOracle(vocab)):
        first = oracle(tokens)
        assert 0 <= first < vocab
        assert oracle(tokens) == first
    assert ConstantOracle(5)(tokens) == 5


@pytest.mark.parametrize(
    ("tokens", "max_model_len", "drafts"),
    [
        ((1, 2, 3, 1, 2), None, (3, 1, 2)),  # the suffix (1, 2) occurred at 0
        ((3, 2, 4, 1, 2, 5, 1, 2), None, (5, 1, 2)),  # the longest n-gram, not (2)'s first
        ((5, 1, 9, 1, 7, 1), None, (9, 1, 7)),  # of its occurrences, the earliest
        ((1, 2, 3, 1, 2, 3, 1, 2, 6, 3), None, (1, 2, 3)),
        ((4, 4), None, (4,)),  # never past the end of the tokens
        ((1, 2, 3, 1, 2), 6, (3,)),  # nor past max_model_len
        ((1, 2, 3, 1, 2), 5, ()),
        ((1, 2, 3, 4), None, ()),  # no n-gram occurs earlier
        ((7,), None, ()),
    ],
)
def test_prompt_lookup_drafts_follow_the_longest_earlier_ngram(
    tokens: tuple[int, ...], max_model_len: int | None, drafts: tuple[int, ...]
) -> None:
    """vLLM's method "ngram" (scripts/crosscheck_prompt_lookup.py compares with vLLM)."""
    drafter = PromptLookupDrafter(3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert replace(drafter, max_model_len=max_model_len)(tokens) == drafts


def test_prompt_lookup_needs_prompt_lookup_min_tokens_of_match() -> None:
    drafter = PromptLookupDrafter(2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert drafter((5, 1, 9, 1)) == ()  # only a one-token n-gram repeats
    assert drafter((5, 1, 9, 5, 1)) == (9, 5)
