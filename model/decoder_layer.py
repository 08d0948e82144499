"""One pre-norm Llama transformer block."""

from __future__ import annotations

import torch

from model.attention import PagedSelfAttention
from model.config import LlamaConfig
from model.kv_cache import PagedKVCache
from model.mlp import SwiGLU
from model.norm import RMSNorm
from model.plan import ForwardPlan


class DecoderLayer(torch.nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, config: LlamaConfig, layer: int, *, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.self_attn = PagedSelfAttention(config, layer, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(hidden, config.intermediate_size, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: ForwardPlan,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, plan, kv_cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out
