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

    query: [rows, heads, head_dim], already rotated and scaled by 1/sqrt(head_dim).
    key_slots / value_slots: flat [num_slots, kv_heads, head_dim] views of one layer.
    The query heads that share a KV head are folded into the GEMM row dimension, so K/V
    are read once per KV head instead of being repeated per query head.
    """
    spans, q_len, ctx_len = group.num_spans, group.query_len, group.context_len
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_slots.shape[1]
    groups = heads // kv_heads

    q = query.index_select(0, group.query_rows).view(spans, q_len, kv_heads, groups, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(spans, kv_heads, groups * q_len, head_dim)
    k = key_slots.index_select(0, group.context_slots).view(spans, ctx_len, kv_heads, head_dim)
    v = value_slots.index_select(0, group.context_slots).view(spans, ctx_len, kv_heads, head_dim)

    scores = torch.matmul(q, k.permute(0, 2, 3, 1))
    scores = scores.view(spans, kv_heads, groups, q_len, ctx_len).masked_fill(
        group.blocked, float("-inf")
    )
    # Half-precision models normalise in float32, as Hugging Face does; float32/64 stay put.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(v.dtype)
    context = torch.matmul(
        probs.view(spans, kv_heads, groups * q_len, ctx_len), v.permute(0, 2, 1, 3)
    )
    context = context.view(spans, kv_heads, groups, q_len, head_dim).permute(0, 3, 1, 2, 4)
    context = context.reshape(spans * q_len, heads, head_dim)
    out.index_copy_(0, group.out_dst, context.index_select(0, group.out_src))
