"""Grouped-query self-attention block that reads and writes the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.config import LlamaConfig
from model.kv_cache import PagedKVCache
from model.paged_attention import attend_group
from model.plan import ForwardPlan
from model.rope import apply_rope


class PagedSelfAttention(torch.nn.Module):
    """q/k/v projection, RoPE, cache write, paged causal attention, output projection.

    q, k and v are stored stacked as one [(heads + 2 * kv_heads) * head_dim, hidden]
    matrix (one GEMM instead of three); the loader stacks Hugging Face's q/k/v_proj.
    """

    def __init__(
        self, config: LlamaConfig, layer: int, *, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.qkv_proj = torch.nn.Parameter(
            torch.empty(q_width + 2 * kv_width, config.hidden_size, dtype=dtype, device=device)
        )
        self.o_proj = torch.nn.Parameter(
            torch.empty(config.hidden_size, q_width, dtype=dtype, device=device)
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: ForwardPlan,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        rows = x.shape[0]
        heads = F.linear(x, self.qkv_proj).view(rows, -1, self.head_dim)
        # q and k heads are adjacent in the stacked projection: rotate them in one pass.
        qk = apply_rope(heads[:, : self.num_heads + self.num_kv_heads], *rope)
        q = qk[:, : self.num_heads] * self.scale
        k = qk[:, self.num_heads :]
        v = heads[:, self.num_heads + self.num_kv_heads :]

        # Every span's new K/V goes into the cache first, so that attention can read each
        # request's whole context (old and new tokens) through one uniform slot gather.
        key_slots, value_slots = kv_cache.layer_slots(self.layer)
        real = plan.num_tokens
        key_slots.index_copy_(0, plan.write_slots, k[:real])
        value_slots.index_copy_(0, plan.write_slots, v[:real])

        out = torch.zeros_like(q)
        for group in plan.groups:
            attend_group(q, key_slots, value_slots, group, out)
        return F.linear(out.view(rows, -1), self.o_proj)
