"""``Span.num_logits``: a span asking for its last ``k`` logits rows (a speculative
verify: the last known token and ``k - 1`` drafts) scores each position bit for bit as
a plain decode of that position would, in float64.

The engine's greedy outputs with drafts equal those without only because of this: a
draft is accepted when it equals the argmax of the row before it, and that row must be
the very row a one-token decode would have computed. The K/V the span writes must also
be the decode's, since later steps read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from model import ForwardBatch, LlamaForCausalLM, PagedKVCache, Span, build_tiny_model
from model.plan import CONTEXT_TILE, ROW_TILE

BLOCK = 4
NUM_BLOCKS = 64
TABLE = tuple(range(40))
PREFIX = [int(t) for t in torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3))]
DRAFTS = [17, 4, 200, 4, 17, 99, 3, 3, 250, 1, 0, 64, 128]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_model(seed=0, dtype=torch.float64, device="cpu")


def new_cache(model: LlamaForCausalLM) -> PagedKVCache:
    return model.new_kv_cache(num_blocks=NUM_BLOCKS, block_size=BLOCK)


def prefill(
    model: LlamaForCausalLM, cache: PagedKVCache, tokens: Sequence[int], table: tuple[int, ...]
) -> None:
    if tokens:
        model(ForwardBatch((Span(tuple(tokens), 0, table),)), cache)


def one_at_a_time(
    model: LlamaForCausalLM,
    prefix: Sequence[int],
    tokens: Sequence[int],
    table: tuple[int, ...] = TABLE,
) -> tuple[torch.Tensor, PagedKVCache]:
    """The logits of ``tokens`` decoded one per forward after ``prefix`` (a row per
    token), and the cache they leave."""
    cache = new_cache(model)
    prefill(model, cache, prefix, table)
    rows = []
    for i, token in enumerate(tokens):
        span = Span((token,), len(prefix) + i, table)
        rows.append(model(ForwardBatch((span,)), cache)[0])
    return torch.stack(rows), cache


def verify_span(
    model: LlamaForCausalLM,
    prefix: Sequence[int],
    tokens: Sequence[int],
    num_logits: int,
    table: tuple[int, ...] = TABLE,
) -> tuple[torch.Tensor, PagedKVCache]:
    """The rows of one span of ``tokens`` after ``prefix`` asking for ``num_logits``."""
    cache = new_cache(model)
    prefill(model, cache, prefix, table)
    span = Span(tuple(tokens), len(prefix), table, num_logits=num_logits)
    return model(ForwardBatch((span,)), cache), cache


def assert_same_cache(got: PagedKVCache, want: PagedKVCache) -> None:
    assert torch.equal(got.key, want.key)
    assert torch.equal(got.value, want.value)


def test_the_scenarios_cross_the_tiles() -> None:
    assert len(DRAFTS) + 1 > ROW_TILE  # more rows than one register block of the lm_head
    assert len(PREFIX) < CONTEXT_TILE < len(PREFIX) + len(DRAFTS)  # the context tile too


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8, 9, 14])
def test_verify_rows_equal_one_token_decodes(model: LlamaForCausalLM, k: int) -> None:
    """The last known token and ``k - 1`` drafts, ``num_logits = k``: row ``i`` is
    the logits of decoding token ``i`` alone, and the K/V written is the decodes'."""
    tokens = [PREFIX[-1], *DRAFTS[: k - 1]]
    prefix = PREFIX[:-1]
    rows, cache = verify_span(model, prefix, tokens, num_logits=k)
    expected, expected_cache = one_at_a_time(model, prefix, tokens)
    assert rows.shape == (k, model.config.vocab_size)
    for i in range(k):
        assert torch.equal(rows[i], expected[i]), f"row {i} of {k} differs"
    assert_same_cache(cache, expected_cache)


@pytest.mark.parametrize(("n", "k"), [(5, 1), (5, 3), (12, 4), (12, 11), (3, 3)])
def test_the_rows_are_the_spans_last_positions(model: LlamaForCausalLM, n: int, k: int) -> None:
    """A span of ``n`` tokens with ``num_logits = k`` returns the logits of its last
    ``k`` positions, in order; its last row is what ``num_logits = 1`` returns."""
    prefix = PREFIX[:40]
    tokens = DRAFTS[:n]
    rows, _ = verify_span(model, prefix, tokens, num_logits=k)
    expected, _ = one_at_a_time(model, prefix, tokens)
    assert torch.equal(rows, expected[n - k :])
    last, _ = verify_span(model, prefix, tokens, num_logits=1)
    assert torch.equal(rows[-1], last[0])


def test_a_prompt_scored_at_every_position(model: LlamaForCausalLM) -> None:
    """A span from position 0 asking for every row: each is the decode of its prefix."""
    tokens = PREFIX[:20]
    rows, cache = verify_span(model, [], tokens, num_logits=len(tokens))
    expected, expected_cache = one_at_a_time(model, [], tokens)
    assert torch.equal(rows, expected)
    assert_same_cache(cache, expected_cache)


def test_verify_spans_among_batch_mates(model: LlamaForCausalLM) -> None:
    """Rows come span after span, each span's ``num_logits`` of them, and equal each
    span's rows run alone: batch-mates (decodes, a prefill chunk, another verify) do
    not change a bit."""
    tables = [tuple(range(30)), tuple(range(30, 40)), (40, 41), tuple(range(42, 50))]
    prefixes = [PREFIX, PREFIX[:30], [5], PREFIX[50:60]]
    spans_tokens = [
        [11, *DRAFTS[:5]],  # a verify of 1 + 5 across the tile
        DRAFTS[:9],  # a prefill chunk, one row
        [7],  # a decode
        [8, 9, 10],  # a verify of 1 + 2
    ]
    num_logits = [6, 1, 1, 3]
    cache = new_cache(model)
    for prefix, table in zip(prefixes, tables, strict=True):
        prefill(model, cache, prefix, table)
    spans = tuple(
        Span(tuple(tokens), len(prefix), table, num_logits=k)
        for prefix, tokens, table, k in zip(prefixes, spans_tokens, tables, num_logits, strict=True)
    )
    rows = model(ForwardBatch(spans), cache)
    assert rows.shape[0] == sum(num_logits)
    at = 0
    for prefix, tokens, table, k in zip(prefixes, spans_tokens, tables, num_logits, strict=True):
        alone, _ = one_at_a_time(model, prefix, tokens, table)
        assert torch.equal(rows[at : at + k], alone[len(tokens) - k :])
        at += k


def test_decoding_after_a_verify_reads_the_decodes_kv(model: LlamaForCausalLM) -> None:
    """A decode after a verify span (its drafts all kept) equals a decode after the
    same tokens decoded one by one: the verify left the K/V a later step reads."""
    prefix = PREFIX[:-1]
    tokens = [PREFIX[-1], *DRAFTS[:4]]
    _, cache = verify_span(model, prefix, tokens, num_logits=len(tokens))
    position = len(prefix) + len(tokens)
    after = model(ForwardBatch((Span((42,), position, TABLE),)), cache)
    expected, _ = one_at_a_time(model, prefix, [*tokens, 42])
    assert torch.equal(after[0], expected[-1])


@pytest.mark.parametrize(("n", "k"), [(1, 0), (3, 0), (3, -1), (1, 2), (4, 5), (4, 40)])
def test_invalid_num_logits_raises_before_writing(model: LlamaForCausalLM, n: int, k: int) -> None:
    cache = new_cache(model)
    prefill(model, cache, PREFIX[:10], TABLE)
    key, value = cache.key.clone(), cache.value.clone()
    span = Span(tuple(DRAFTS[:n]), 10, TABLE, num_logits=k)
    with pytest.raises(ValueError, match="num_logits"):
        model(ForwardBatch((span,)), cache)
    # Also as the second span of a batch whose first is valid.
    ok = Span((1, 2), 0, (50,))
    with pytest.raises(ValueError, match="num_logits"):
        model(ForwardBatch((ok, span)), cache)
    assert torch.equal(cache.key, key)
    assert torch.equal(cache.value, value)
