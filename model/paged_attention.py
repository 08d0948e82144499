"""Causal attention of span queries over their requests' paged K/V."""

from __future__ import annotations

import torch

from model.plan import AttentionGroup


def attend_group(
    query: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    group: AttentionGroup,
    out: torch.Tensor,
) -> None:
    """Write attention outputs of `group`'s real queries into `out` [rows, heads, head_dim].

    query: contiguous [rows, heads, head_dim], already rotated and scaled by 1/sqrt(head_dim).
    key_slots / value_slots: flat [num_slots, kv_heads, head_dim] views of one layer.
    The query heads that share a KV head are folded into the GEMM row dimension, so K/V
    are read once per KV head instead of being repeated per query head; the batch
    dimension is (kv head, span), the order the plan's indices gather them in.
    """
    head_dim, kv_heads = query.shape[-1], key_slots.shape[1]
    spans, query_len, context_len = group.num_spans, group.query_len, group.context_len
    batch = kv_heads * spans

    q = query.view(-1, head_dim).index_select(0, group.query_index).view(batch, -1, head_dim)
    k = key_slots.view(-1, head_dim).index_select(0, group.context_index)
    v = value_slots.view(-1, head_dim).index_select(0, group.context_index)

    scores = torch.matmul(q, k.view(batch, context_len, head_dim).transpose(1, 2))
    scores = scores.view(kv_heads, spans, -1, query_len, context_len)
    # Half-precision models normalise in float32, as Hugging Face does; float32/64 stay put.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if group.span_len == query_len:
        probs = torch.softmax(scores.add_(group.bias), dim=-1, dtype=softmax_dtype)
    else:
        # Normalise the real query rows alone, in place. The padding rows keep their raw
        # scores: finite, and a GEMM output row depends on its own input row only, so they
        # reach no real output. (A decode group has 1 real row in query_len.)
        rows = scores[..., : group.span_len, :]
        rows.copy_(torch.softmax(rows.add_(group.bias), dim=-1, dtype=softmax_dtype))
        probs = scores
    context = torch.matmul(
        probs.to(v.dtype).view(batch, -1, context_len), v.view(batch, context_len, head_dim)
    )
    out.view(-1, head_dim).index_copy_(
        0, group.out_dst, context.view(-1, head_dim).index_select(0, group.out_src)
    )
