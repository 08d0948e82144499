"""Index tensors that map a ForwardBatch onto flat token rows and cache slots.

Built once per forward and shared by every layer, so per-layer work is pure tensor ops
and the Python cost is per span (or per cache block), never per token.

Batch invariance lives here, as *shapes*. What was measured on this project's CPU
build (torch 2.13, MKL, AVX-512; same in float64, float32 and bfloat16):

* a GEMM rounds an output element identically whatever the matrix sizes *only* when the
  element lies in a full register block: 4 rows (of torch's row-major M) and 24 columns
  (N). The ragged last M % 4 rows and N % 24 columns take other kernels (M = 1 is a
  GEMV) and differ in the last bits;
* padding the reduction dimension K with zeros never changes a result, nor does the
  number of batch entries of a bmm, nor the thread count.

So every GEMM is padded so that real elements sit only in full blocks:

* flat token rows are padded to a multiple of ROW_TILE before the first projection, so
  every real row of every linear layer (q/k/v/o, MLP, lm_head) is in a full row block
  (the linear layers' N is the fixed weight width, so columns never vary);
* attention folds the query heads that share a KV head into the GEMM rows, so each
  span's queries are padded until those rows (groups x queries) are a multiple of
  ROW_TILE: queries to a multiple of ROW_TILE / gcd(ROW_TILE, groups), e.g. 4 with two
  query heads per KV head. Its context (the N of q @ k^T, the K of probs @ v) is padded
  to a multiple of CONTEXT_TILE, masked to exact-zero probabilities. 96 is a multiple of
  24 and also of 32, for BLAS kernels with other block widths. CONTEXT_TILE = 32 was
  measured to break invariance beyond 24 tokens.

Removing either padding breaks bitwise equality in every scenario of
tests/model/test_batch_invariance.py. Attention never mixes requests: each group
attends over its own gathered slots. With `invariant=False` the padding is dropped
(tile 1): a single decode span then runs its linear layers as GEMVs, 1.4-3.5x faster
than the padded 8-row GEMMs on CPU for 768x3072-sized weights (no difference once 8 or
more rows are in flight), but a request's low bits then depend on its batch-mates.

The guarantee is float64's: it is what the tests check. In float32 the same padding was
measured not to be enough (a batched or chunked request's logits differed from its solo
run in the last bits for 99 of 246 requests), so float32 greedy outputs can differ from
solo runs at near-ties.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate, chain, repeat

import torch

from model.batch import ForwardBatch, Span

ROW_TILE = 8
CONTEXT_TILE = 96


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Spans of equal length attended in one batched call, padded to one query/context length.

    Index tensors address flat row views, so that one `index_select` each gathers the
    queries and the K/V straight into the batched-GEMM layout [kv_heads * num_spans, ...]
    (query head h = kv * groups + g, Hugging Face's order), with no permute copies:

    query_index   [kv_heads * num_spans * groups * query_len]: rows of the queries viewed
                  as [tokens * heads, head_dim]; the first span_len query cells of a span
                  are its tokens, the rest padding
    context_index [kv_heads * num_spans * context_len]: rows of one layer's K (or V) viewed
                  as [slots * kv_heads, head_dim]
    bias          [num_spans, 1, span_len, context_len]: 0 where a real query attends,
                  -inf where masked
    out_src/out_dst: the real (kv head, span, group, query) cells of the attention output
                  and their rows in the [tokens * heads, head_dim] view of `out`.
    """

    num_spans: int
    span_len: int
    query_len: int
    context_len: int
    query_index: torch.Tensor
    context_index: torch.Tensor
    bias: torch.Tensor
    out_src: torch.Tensor
    out_dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything a forward needs besides weights and cache contents."""

    num_tokens: int
    token_ids: torch.Tensor  # [padded_tokens]; padding rows use token 0
    positions: torch.Tensor  # [padded_tokens]
    write_slots: torch.Tensor  # [num_tokens], slot of each real token
    last_rows: torch.Tensor  # [padded_logits], rows of each span's last num_logits tokens
    num_logits: int  # real rows of last_rows
    max_position: int
    groups: tuple[AttentionGroup, ...]


def build_plan(
    batch: ForwardBatch,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    num_heads: int,
    num_kv_heads: int,
    invariant: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> ForwardPlan:
    """Validate `batch` against the cache geometry and precompute its index tensors."""
    spans = batch.spans
    _validate(spans, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
    row_tile = ROW_TILE if invariant else 1
    offsets = list(accumulate((len(s.token_ids) for s in spans), initial=0))
    num_tokens = offsets[-1]
    padding = round_up(num_tokens, row_tile) - num_tokens
    token_ids = _long_tensor(
        chain(chain.from_iterable(s.token_ids for s in spans), repeat(0, padding))
    )
    positions = _long_tensor(
        chain(chain.from_iterable(range(s.start_pos, s.end_pos) for s in spans), repeat(0, padding))
    )
    slots = array(
        "q", chain.from_iterable(r for span in spans for r in _slot_ranges(span, block_size))
    )
    if len(set(slots)) < num_tokens:
        # Two spans claiming one slot is a scheduler bug that would corrupt the cache silently.
        raise ValueError("spans of one ForwardBatch write the same KV cache slot")
    num_logits = sum(s.num_logits for s in spans)
    last_rows = _long_tensor(
        chain(
            chain.from_iterable(
                range(end - s.num_logits, end) for s, end in zip(spans, offsets[1:], strict=True)
            ),
            repeat(0, round_up(num_logits, row_tile) - num_logits),
        )
    )

    groups = tuple(
        _group(
            [spans[i] for i in members],
            [offsets[i] for i in members],
            block_size=block_size,
            heads=(num_heads, num_kv_heads),
            # The attention GEMM's rows are (query group, query) pairs: padding queries to a
            # multiple of ROW_TILE / gcd(ROW_TILE, groups) keeps those rows in full
            # ROW_TILE blocks, like the linear layers' rows, with the least padding.
            query_tile=row_tile // math.gcd(row_tile, num_heads // num_kv_heads),
            context_tile=CONTEXT_TILE if invariant else 1,
            dtype=dtype,
            device=device,
        )
        for members in _partition(spans)
    )
    return ForwardPlan(
        num_tokens=num_tokens,
        token_ids=token_ids.to(device),
        positions=positions.to(device),
        write_slots=torch.frombuffer(slots, dtype=torch.long).to(device),
        last_rows=last_rows.to(device),
        num_logits=num_logits,
        max_position=max(s.end_pos for s in spans) - 1,
        groups=groups,
    )


def _long_tensor(values: Iterable[int]) -> torch.Tensor:
    """1-D int64 CPU tensor of `values`.

    Built through `array`: several times faster than `torch.tensor` on a long Python list.
    """
    return torch.frombuffer(array("q", values), dtype=torch.long)


def _validate(
    spans: tuple[Span, ...], *, block_size: int, num_blocks: int, vocab_size: int
) -> None:
    if not spans:
        raise ValueError("ForwardBatch has no spans")
    for span in spans:
        if not span.token_ids:
            raise ValueError("a Span must carry at least one token")
        if not 1 <= span.num_logits <= len(span.token_ids):
            raise ValueError(
                f"Span.num_logits must be 1 to its {len(span.token_ids)} tokens, "
                f"got {span.num_logits}"
            )
        if span.start_pos < 0:
            raise ValueError(f"Span.start_pos must be >= 0, got {span.start_pos}")
        if len(span.block_table) * block_size < span.end_pos:
            raise ValueError(
                f"block table of {len(span.block_table)} blocks x {block_size} slots cannot "
                f"hold positions up to {span.end_pos - 1}"
            )
    # Range checks over the whole batch at once (min/max run in C); the span is only
    # looked up to word the error.
    blocks = array("q", chain.from_iterable(s.block_table for s in spans))
    if min(blocks) < 0 or max(blocks) >= num_blocks:
        table = next(
            s.block_table
            for s in spans
            if not 0 <= min(s.block_table) <= max(s.block_table) < num_blocks
        )
        raise IndexError(f"block id out of range [0, {num_blocks}): {table}")
    tokens = array("q", chain.from_iterable(s.token_ids for s in spans))
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise IndexError(f"token id out of range [0, {vocab_size})")


def _partition(spans: tuple[Span, ...]) -> list[list[int]]:
    """Single-token (decode) spans are grouped by context tile; each longer span is alone.

    Decode spans have equal query counts, so batching them wastes nothing on queries and
    saves a Python round trip per request; splitting them by CONTEXT_TILE bucket keeps a
    short context from being padded to a long batch-mate's (the gather, both GEMMs and
    the softmax scale with the padded context). A prefill chunk padded to a batch-mate's
    length would waste quadratic work, so it stays alone. Either way the spans of a
    group have one length, which `AttentionGroup` relies on.
    """
    decode: dict[int, list[int]] = {}
    prefill: list[list[int]] = []
    for i, span in enumerate(spans):
        if len(span.token_ids) == 1:
            decode.setdefault(-(-span.end_pos // CONTEXT_TILE), []).append(i)
        else:
            prefill.append([i])
    return [decode[tile] for tile in sorted(decode)] + prefill


def _slot_ranges(span: Span, block_size: int) -> Iterator[range]:
    """Cache slots of the span's positions, as one range per block (not per token)."""
    for block in range(span.start_pos // block_size, (span.end_pos - 1) // block_size + 1):
        first = block * block_size
        base = span.block_table[block] * block_size - first
        yield range(base + max(span.start_pos, first), base + min(span.end_pos, first + block_size))


def _group(
    spans: list[Span],
    offsets: list[int],
    *,
    block_size: int,
    heads: tuple[int, int],
    query_tile: int,
    context_tile: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionGroup:
    """Index tensors of one group of equally long spans; `offsets`: their first token rows."""
    num_spans = len(spans)
    num_heads, num_kv_heads = heads
    span_len = len(spans[0].token_ids)
    query_len = round_up(span_len, query_tile)
    context_len = round_up(max(s.end_pos for s in spans), context_tile)
    offset, start = _long_tensor(chain(offsets, (s.start_pos for s in spans))).view(2, num_spans, 1)

    # Cell (kv, span, g, query) reads query head kv * groups + g of its token row. Padding
    # query cells repeat the span's last query: rows of finite values, discarded later.
    column = torch.arange(query_len)
    head = torch.arange(num_heads).view(num_kv_heads, 1, -1, 1)
    query_index = (offset + column.clamp(max=span_len - 1))[None, :, None, :] * num_heads + head

    # Slot of every key position below context_len; block tables are cut or padded (with
    # block 0: finite values, always masked) to the blocks that cover context_len.
    width = -(-context_len // block_size)
    tables = _long_tensor(
        chain.from_iterable(
            chain(s.block_table[:width], repeat(0, width - len(s.block_table))) for s in spans
        )
    )
    slots = (tables.view(num_spans, width, 1) * block_size + torch.arange(block_size)).view(
        num_spans, -1
    )[:, :context_len]
    context_index = slots[None] * num_kv_heads + torch.arange(num_kv_heads).view(-1, 1, 1)

    # Causal: a query sees keys at positions <= its own; padding keys (beyond the span's
    # end) are above every real query position, so this also masks them. Adding -inf
    # masks exactly like masked_fill (and adding 0 leaves a score unchanged) at a fraction
    # of masked_fill's cost with a broadcast mask.
    query_pos = start + column[:span_len]
    blocked = torch.arange(context_len) > query_pos[:, :, None]
    bias = torch.where(blocked, float("-inf"), torch.zeros((), dtype=dtype))

    cells = torch.arange(query_index.numel()).view(query_index.shape)
    return AttentionGroup(
        num_spans=num_spans,
        span_len=span_len,
        query_len=query_len,
        context_len=context_len,
        query_index=query_index.reshape(-1).to(device),
        context_index=context_index.reshape(-1).to(device),
        bias=bias[:, None].to(device),
        out_src=cells[..., :span_len].reshape(-1).to(device),
        out_dst=query_index[..., :span_len].reshape(-1).to(device),
    )
