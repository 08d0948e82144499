"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)).

    gate and up are stored stacked as one [2 * intermediate, hidden] matrix so both come
    out of a single GEMM; the loader stacks Hugging Face's separate gate_proj/up_proj.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = torch.nn.Parameter(
            torch.empty(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        )
        self.down_proj = torch.nn.Parameter(
            torch.empty(hidden_size, intermediate_size, dtype=dtype, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)
