"""Index tensors that map a ForwardBatch onto flat token rows and cache slots.

Built once per forward and shared by every layer, so per-layer work is pure tensor ops
and the Python cost is per span, never per token.

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
* each span's query rows are padded to a multiple of ROW_TILE, and its context (the N
  of q @ k^T, the K of probs @ v) to a multiple of CONTEXT_TILE, masked to exact-zero
  probabilities. 96 is a multiple of 24 and also of 32, for BLAS kernels with other
  block widths. CONTEXT_TILE = 32 was measured to break invariance beyond 24 tokens.

Removing either padding breaks bitwise equality in every scenario of
tests/model/test_batch_invariance.py. Attention never mixes requests: each group
attends over its own gathered slots. With `invariant=False` the padding is dropped
(tile 1): a single decode span then runs its linear layers as GEMVs, 1.4-3.5x faster
than the padded 8-row GEMMs on CPU for 768x3072-sized weights (no difference once 8 or
more rows are in flight), but a request's low bits then depend on its batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from model.batch import ForwardBatch, Span

ROW_TILE = 8
CONTEXT_TILE = 96


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Spans attended in one batched call, each padded to the same query/context length.

    query_rows   [num_spans * query_len]   flat token row of each (span, query) cell
    context_slots[num_spans * context_len] cache slot of each (span, key) cell
    blocked      [num_spans, 1, 1, query_len, context_len]  True where attention is masked
    out_src/out_dst: which (span, query) cells are real, and their token rows.
    """

    num_spans: int
    query_len: int
    context_len: int
    query_rows: torch.Tensor
    context_slots: torch.Tensor
    blocked: torch.Tensor
    out_src: torch.Tensor
    out_dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything a forward needs besides weights and cache contents."""

    num_tokens: int
    token_ids: torch.Tensor  # [padded_tokens]; padding rows use token 0
    positions: torch.Tensor  # [padded_tokens]
    write_slots: torch.Tensor  # [num_tokens], slot of each real token
    last_rows: torch.Tensor  # [padded_spans], row of each span's last token
    num_spans: int
    max_position: int
    groups: tuple[AttentionGroup, ...]


def build_plan(
    batch: ForwardBatch,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    invariant: bool,
    device: torch.device,
) -> ForwardPlan:
    """Validate `batch` against the cache geometry and precompute its index tensors."""
    if not batch.spans:
        raise ValueError("ForwardBatch has no spans")
    for span in batch.spans:
        _validate_span(span, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
    row_tile = ROW_TILE if invariant else 1
    lengths = torch.tensor([len(s.token_ids) for s in batch.spans])
    starts = torch.tensor([s.start_pos for s in batch.spans])
    offsets = torch.cumsum(lengths, 0) - lengths
    num_tokens = int(lengths.sum())
    padded = round_up(num_tokens, row_tile)

    token_ids = torch.zeros(padded, dtype=torch.long)
    token_ids[:num_tokens] = torch.tensor(
        list(chain.from_iterable(s.token_ids for s in batch.spans))
    )
    span_of_token = torch.repeat_interleave(torch.arange(len(batch.spans)), lengths)
    positions = torch.zeros(padded, dtype=torch.long)
    positions[:num_tokens] = (
        starts[span_of_token] + torch.arange(num_tokens) - offsets[span_of_token]
    )
    tables = _block_tables(batch.spans)
    write_slots = _slots(tables[span_of_token], positions[:num_tokens, None], block_size)[:, 0]
    ordered = write_slots.sort().values
    if bool((ordered[1:] == ordered[:-1]).any()):
        # Two spans claiming one slot is a scheduler bug that would corrupt the cache silently.
        raise ValueError("spans of one ForwardBatch write the same KV cache slot")

    num_spans = len(batch.spans)
    last_rows = torch.zeros(round_up(num_spans, row_tile), dtype=torch.long)
    last_rows[:num_spans] = offsets + lengths - 1

    groups = tuple(
        _group(
            members,
            lengths=lengths,
            starts=starts,
            offsets=offsets,
            tables=tables,
            block_size=block_size,
            row_tile=row_tile,
            context_tile=CONTEXT_TILE if invariant else 1,
            device=device,
        )
        for members in _partition(batch.spans)
    )
    return ForwardPlan(
        num_tokens=num_tokens,
        token_ids=token_ids.to(device),
        positions=positions.to(device),
        write_slots=write_slots.to(device),
        last_rows=last_rows.to(device),
        num_spans=num_spans,
        max_position=max(s.end_pos for s in batch.spans) - 1,
        groups=groups,
    )


def _validate_span(span: Span, *, block_size: int, num_blocks: int, vocab_size: int) -> None:
    if not span.token_ids:
        raise ValueError("a Span must carry at least one token")
    if span.start_pos < 0:
        raise ValueError(f"Span.start_pos must be >= 0, got {span.start_pos}")
    if len(span.block_table) * block_size < span.end_pos:
        raise ValueError(
            f"block table of {len(span.block_table)} blocks x {block_size} slots cannot "
            f"hold positions up to {span.end_pos - 1}"
        )
    if span.block_table and (min(span.block_table) < 0 or max(span.block_table) >= num_blocks):
        raise IndexError(f"block id out of range [0, {num_blocks}): {span.block_table}")
    if min(span.token_ids) < 0 or max(span.token_ids) >= vocab_size:
        raise IndexError(f"token id out of range [0, {vocab_size})")


def _partition(spans: tuple[Span, ...]) -> list[list[int]]:
    """All single-token (decode) spans share one group; each longer span gets its own.

    Decode spans have equal query counts, so batching them wastes nothing on queries and
    saves a Python round trip per request; a prefill chunk padded to a batch-mate's length
    would waste quadratic work, so it stays alone.
    """
    decode = [i for i, s in enumerate(spans) if len(s.token_ids) == 1]
    prefill = [[i] for i, s in enumerate(spans) if len(s.token_ids) > 1]
    return ([decode] if decode else []) + prefill


def _block_tables(spans: tuple[Span, ...]) -> torch.Tensor:
    """[num_spans, max_blocks] block ids, ragged rows padded with block 0 (never read unmasked)."""
    width = max(len(s.block_table) for s in spans)
    return torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in spans])


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position, given each position's block table row."""
    block_index = (positions // block_size).clamp(max=tables.shape[-1] - 1)
    blocks = tables.gather(-1, block_index)
    return blocks * block_size + positions % block_size


def _group(
    members: list[int],
    *,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    offsets: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    row_tile: int,
    context_tile: int,
    device: torch.device,
) -> AttentionGroup:
    index = torch.tensor(members)
    lengths, starts, offsets, tables = lengths[index], starts[index], offsets[index], tables[index]
    query_len = round_up(int(lengths.max()), row_tile)
    context_len = round_up(int((starts + lengths).max()), context_tile)

    # Padding query cells repeat the span's last real query: finite values, never NaN
    # from an all-masked row, and their outputs are simply discarded.
    column = torch.arange(query_len)[None, :]
    clamped = torch.minimum(column, (lengths - 1)[:, None])
    query_rows = offsets[:, None] + clamped
    query_pos = starts[:, None] + clamped
    real = column < lengths[:, None]

    key_pos = torch.arange(context_len)
    context_slots = _slots(tables, key_pos.expand(len(members), context_len), block_size)
    # Causal: a query sees keys at positions <= its own; padding keys (beyond the span's
    # end) are above every real query position, so this also masks them.
    blocked = key_pos[None, None, :] > query_pos[:, :, None]

    return AttentionGroup(
        num_spans=len(members),
        query_len=query_len,
        context_len=context_len,
        query_rows=query_rows.reshape(-1).to(device),
        context_slots=context_slots.reshape(-1).to(device),
        blocked=blocked[:, None, None].to(device),
        out_src=real.reshape(-1).nonzero().squeeze(1).to(device),
        out_dst=query_rows[real].to(device),
    )
