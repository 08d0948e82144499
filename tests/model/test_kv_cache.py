"""Paged KV cache: slot addressing, isolation between requests, block copies."""

from __future__ import annotations

import pytest
import torch

from model import (
    ForwardBatch,
    LlamaForCausalLM,
    PagedKVCache,
    Span,
    build_tiny_model,
    resolve_device,
)
from model.rope import RotaryTable, apply_rope
from tests.model.helpers import DrivenRequest, drive, greedy_generate

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_model(seed=21, dtype=torch.float64)


def expected_layer0_kv(
    model: LlamaForCausalLM, tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-0 K (rotated) and V of a prompt, computed directly from the weights."""
    config = model.config
    layer = model.decoder_layers[0]
    x = model.embed_tokens[torch.tensor(tokens)]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    h = h * layer.input_layernorm.weight
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    w = layer.self_attn.qkv_proj
    k = (h @ w[q_rows : q_rows + kv_rows].T).view(len(tokens), -1, config.head_dim)
    v = (h @ w[q_rows + kv_rows :].T).view(len(tokens), -1, config.head_dim)
    table = RotaryTable(head_dim=config.head_dim, theta=config.rope_theta)
    cos, sin = table.lookup(torch.arange(len(tokens)), max_position=len(tokens), dtype=k.dtype)
    return apply_rope(k, cos, sin), v


def slot_view(
    cache: PagedKVCache, table: tuple[int, ...], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-0 K/V of positions 0..n-1 read back through a block table."""
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    key, value = cache.layer_slots(0)
    return key[slots], value[slots]


def test_kv_written_to_block_table_slots(model: LlamaForCausalLM) -> None:
    cache = model.new_kv_cache(num_blocks=12, block_size=BLOCK)
    a_tokens, b_tokens = list(range(10, 21)), list(range(50, 59))
    a_table, b_table = (9, 2, 6), (3, 11, 0)  # interleaved, non-contiguous, unordered
    batch = ForwardBatch((Span(tuple(a_tokens), 0, a_table), Span(tuple(b_tokens), 0, b_table)))
    model(batch, cache)
    for tokens, table in ((a_tokens, a_table), (b_tokens, b_table)):
        k_expected, v_expected = expected_layer0_kv(model, tokens)
        k_got, v_got = slot_view(cache, table, len(tokens))
        torch.testing.assert_close(k_got, k_expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v_got, v_expected, rtol=1e-12, atol=1e-12)
    # Blocks nobody owns, and the unused tail slots of partly filled blocks, stay zero.
    untouched = [1, 4, 5, 7, 8, 10]
    assert not cache.key[:, untouched].any() and not cache.value[:, untouched].any()
    assert not cache.key[:, 6, 3:].any()  # a holds 11 tokens: block 6 has slots 0..2 only
    assert not cache.key[:, 0, 1:].any()  # b holds 9 tokens: block 0 has slot 0 only


def test_interleaved_requests_do_not_disturb_each_other(model: LlamaForCausalLM) -> None:
    prompt_a, prompt_b = [1, 2, 3, 4, 5, 6, 7], [200, 100, 50, 25, 12]
    table_a, table_b = (0, 2, 4, 6, 8), (1, 3, 5, 7, 9)
    alone_a, _ = greedy_generate(model, prompt_a, 10, block_size=BLOCK, block_ids=table_a)
    alone_b, _ = greedy_generate(model, prompt_b, 10, block_size=BLOCK, block_ids=table_b)
    cache = model.new_kv_cache(num_blocks=10, block_size=BLOCK)
    a = DrivenRequest(prompt_a, 10, table_a, chunk=3)
    b = DrivenRequest(prompt_b, 10, table_b, join_step=2)
    drive(model, cache, [a, b])
    assert a.generated == alone_a and b.generated == alone_b


def run_steps(
    model: LlamaForCausalLM, cache: PagedKVCache, request: DrivenRequest, steps: int
) -> None:
    """Drive one request alone for `steps` forwards."""
    for _ in range(steps):
        span = request.next_span()
        request.accept(span, model(ForwardBatch((span,)), cache)[0])


def test_copy_blocks_round_trip_gives_identical_continuation() -> None:
    # Device pool on CUDA when there is one, host pool always on the CPU.
    model = build_tiny_model(seed=21, dtype=torch.float64, device=resolve_device("auto"))
    prompt = list(range(30, 47))
    reference = DrivenRequest(prompt, 7, range(6))
    drive(model, model.new_kv_cache(num_blocks=16, block_size=BLOCK), [reference])

    device_pool = model.new_kv_cache(num_blocks=16, block_size=BLOCK)
    host_pool = model.new_kv_cache(
        num_blocks=8, block_size=BLOCK, device=torch.device("cpu"), pin_memory=True
    )
    request = DrivenRequest(prompt, 7, (10, 3, 7, 0, 12, 5))
    run_steps(model, device_pool, request, 5)  # prefill + 4 decodes
    device_pool.copy_blocks_to(host_pool, list(request.block_table), [7, 6, 5, 4, 3, 2])
    # Scribble over the freed device blocks with another request.
    drive(model, device_pool, [DrivenRequest(list(range(100, 123)), 1, request.block_table)])
    new_table = (1, 2, 4, 6, 8, 9)
    host_pool.copy_blocks_to(device_pool, [7, 6, 5, 4, 3, 2], list(new_table))
    request.block_table = new_table
    run_steps(model, device_pool, request, 2)
    assert request.generated == reference.generated
    for got, want in zip(request.logits, reference.logits, strict=True):
        assert torch.equal(got, want)


def test_snapshot_restore(model: LlamaForCausalLM) -> None:
    cache = model.new_kv_cache(num_blocks=8, block_size=BLOCK)
    prompt = [9, 9, 8, 8, 7, 7, 6]
    reference = DrivenRequest(prompt, 6, (0, 1, 2, 3))
    drive(model, model.new_kv_cache(num_blocks=8, block_size=BLOCK), [reference])

    request = DrivenRequest(prompt, 6, (0, 1, 2, 3))
    run_steps(model, cache, request, 2)
    saved = cache.snapshot([0, 1, 2])
    before = cache.key.clone()
    drive(model, cache, [DrivenRequest(list(range(12)), 1, (0, 1, 2))])
    assert not torch.equal(cache.key, before)
    cache.restore([5, 6, 7], saved)  # restore into other blocks
    request.block_table = (5, 6, 7, 3)
    run_steps(model, cache, request, 4)
    assert request.generated == reference.generated


def test_snapshot_is_a_copy(model: LlamaForCausalLM) -> None:
    cache = model.new_kv_cache(num_blocks=4, block_size=BLOCK)
    model(ForwardBatch((Span((1, 2, 3), 0, (2,)),)), cache)
    key, value = cache.snapshot([2])
    assert key.shape == (model.config.num_hidden_layers, 1, BLOCK, 2, model.config.head_dim)
    cache.key.zero_()
    assert key.any() and value.any()


def cpu_cache(
    *, num_layers: int, num_blocks: int, dtype: torch.dtype = torch.float64
) -> PagedKVCache:
    """A cache on the CPU with the tiny model's KV heads and head size (2 x 16)."""
    return PagedKVCache(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def test_cache_argument_errors(model: LlamaForCausalLM) -> None:
    cache = model.new_kv_cache(num_blocks=4, block_size=BLOCK)
    with pytest.raises(IndexError):
        cache.snapshot([4])
    with pytest.raises(ValueError, match="duplicate"):
        cache.restore([1, 1], cache.snapshot([0, 1]))
    with pytest.raises(ValueError, match="destination"):
        cache.copy_blocks_to(cache, [0, 1], [2])
    other = cpu_cache(num_layers=1, num_blocks=4)
    with pytest.raises(ValueError, match="layout"):
        cache.copy_blocks_to(other, [0], [0])
    with pytest.raises(ValueError):
        cpu_cache(num_layers=1, num_blocks=0)


def test_forward_validation(model: LlamaForCausalLM) -> None:
    cache = model.new_kv_cache(num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="cannot hold"):
        model(ForwardBatch((Span((1, 2, 3, 4, 5), 0, (0,)),)), cache)
    with pytest.raises(IndexError, match="block id"):
        model(ForwardBatch((Span((1,), 0, (4,)),)), cache)
    with pytest.raises(IndexError, match="token id"):
        model(ForwardBatch((Span((256,), 0, (0,)),)), cache)
    with pytest.raises(ValueError, match="no spans"):
        model(ForwardBatch(()), cache)
    with pytest.raises(ValueError, match="at least one token"):
        model(ForwardBatch((Span((), 0, (0,)),)), cache)
    with pytest.raises(ValueError, match="same KV cache slot"):
        model(ForwardBatch((Span((1, 2), 0, (1,)), Span((3,), 1, (1,)))), cache)
    wrong_dtype = cpu_cache(num_layers=2, num_blocks=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        model(ForwardBatch((Span((1,), 0, (0,)),)), wrong_dtype)
