"""Root-mean-square layer normalisation."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """x / rms(x) * weight, with no mean subtraction and no bias (Llama's norm).

    Statistics are taken in at least float32 (Hugging Face upcasts half precision the
    same way) but never below the model dtype, so float64 models stay exact float64.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        wide = x.to(compute)
        inv_rms = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (wide * inv_rms).to(x.dtype)
