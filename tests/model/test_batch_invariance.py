"""float64 logits of a request must not depend on batch-mates, chunking or KV placement.

The target request's prompt is long enough (100 tokens + 10 generated) that its context
crosses the attention context tile, and batch-mates have longer contexts still, so the
padded shapes its tokens are computed in really do vary between scenarios.
"""

from __future__ import annotations

import pytest
import torch

from model import ForwardBatch, LlamaForCausalLM, Span, build_tiny_model
from model.plan import CONTEXT_TILE
from tests.model.helpers import DrivenRequest, blocks_needed, drive

BLOCK = 4
NEW = 10
PROMPT = [int(t) for t in torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(5))]
NEEDED = blocks_needed(len(PROMPT) + NEW, BLOCK)
TABLE = tuple(range(NEEDED))
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_model(seed=11, dtype=torch.float64)


def run_target(
    model: LlamaForCausalLM,
    target: DrivenRequest,
    others: list[DrivenRequest] | None = None,
    evictions: dict[int, tuple[int, tuple[int, ...]]] | None = None,
) -> DrivenRequest:
    requests = [target, *(others or [])]
    drive(
        model,
        model.new_kv_cache(num_blocks=NUM_BLOCKS, block_size=BLOCK),
        requests,
        evictions=evictions,
    )
    return target


@pytest.fixture(scope="module")
def alone(model: LlamaForCausalLM) -> DrivenRequest:
    return run_target(model, DrivenRequest(PROMPT, NEW, TABLE))


def assert_bitwise_equal(actual: DrivenRequest, expected: DrivenRequest) -> None:
    assert actual.generated == expected.generated
    assert len(actual.logits) == len(expected.logits) == NEW
    for step, (got, want) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        assert torch.equal(got, want), f"logits differ at generated token {step}"


def test_prompt_crosses_context_tile() -> None:
    assert len(PROMPT) < 2 * CONTEXT_TILE < len(PROMPT) + 200


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill(model: LlamaForCausalLM, alone: DrivenRequest, chunk: int) -> None:
    assert_bitwise_equal(run_target(model, DrivenRequest(PROMPT, NEW, TABLE, chunk=chunk)), alone)


def test_mixed_with_other_requests(model: LlamaForCausalLM, alone: DrivenRequest) -> None:
    # Batch-mates join at different steps, so the target shares forwards with decode spans
    # and prefill chunks of several lengths, and decode groups whose longest context
    # (up to ~230 tokens) is far beyond its own.
    others = [
        DrivenRequest([3, 4, 5, 6, 7, 8, 9, 10, 11], 25, range(100, 109), chunk=2),
        DrivenRequest([1] * 200, 8, range(109, 161), chunk=50, join_step=1),
        DrivenRequest([9, 8], 30, range(161, 170)),
        DrivenRequest(list(range(150)), 4, range(170, 209), chunk=160, join_step=3),
        DrivenRequest(list(range(220, 256)), 6, range(209, 220), chunk=5, join_step=5),
    ]
    target = DrivenRequest(PROMPT, NEW, TABLE, chunk=6, join_step=2)
    assert_bitwise_equal(run_target(model, target, others), alone)


@pytest.mark.parametrize("evict_step", [0, 2, 5, 9])
def test_recompute_into_other_blocks(
    model: LlamaForCausalLM, alone: DrivenRequest, evict_step: int
) -> None:
    # The prompt prefills in steps 0-2 (chunks of 40). Evicting at step 0 only relocates;
    # at step 2 it interrupts the prefill; at steps 5 and 9 generated tokens are
    # recomputed as prefill. The new blocks are other ids, in reverse order.
    other = DrivenRequest([2, 3], 12, range(NEEDED, NEEDED + 4))
    new_table = tuple(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - NEEDED, -1))
    target = DrivenRequest(PROMPT, NEW, TABLE, chunk=40)
    evictions = {evict_step: (0, new_table)}
    assert_bitwise_equal(run_target(model, target, [other], evictions), alone)


def test_same_token_in_one_forward_vs_many(model: LlamaForCausalLM) -> None:
    # Five spans in one forward give the same logits as the five spans run one by one.
    spans = [
        Span(tuple(PROMPT[:37]), 0, tuple(range(10))),
        Span((5,), 0, (10,)),
        Span(tuple(PROMPT[:2]), 0, (11,)),
        Span(tuple(range(16)), 0, (12, 13, 14, 15)),
        Span((77,), 0, (16,)),
    ]
    batched = model(ForwardBatch(tuple(spans)), model.new_kv_cache(num_blocks=20, block_size=BLOCK))
    for i, span in enumerate(spans):
        single = model(ForwardBatch((span,)), model.new_kv_cache(num_blocks=20, block_size=BLOCK))
        assert torch.equal(single[0], batched[i])


def test_fast_mode_agrees_up_to_rounding() -> None:
    fast = build_tiny_model(seed=11, dtype=torch.float64, batch_invariant=False)
    target = DrivenRequest(PROMPT, NEW, TABLE, chunk=7)
    others = [
        DrivenRequest([3, 4, 5], 12, range(100, 104)),
        DrivenRequest([1] * 30, 4, range(104, 113), chunk=9),
    ]
    run_target(fast, target, others)
    exact = run_target(
        build_tiny_model(seed=11, dtype=torch.float64), DrivenRequest(PROMPT, NEW, TABLE)
    )
    assert target.generated == exact.generated
    for got, want in zip(target.logits, exact.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
