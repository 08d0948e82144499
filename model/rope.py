"""Rotary position embedding (Hugging Face's non-interleaved "rotate_half" layout)."""

from __future__ import annotations

import torch

# Positions are tabulated in pages of this many rows, each computed by the same
# fixed-shape call, so the value for a position never depends on how far the table
# has grown (vectorised cos/sin can round differently in a tensor's tail elements).
_PAGE = 1024


class RotaryTable:
    """Lazily grown cos/sin table indexed by absolute position.

    A table lookup instead of recomputing cos/sin per forward makes a position's
    embedding a constant: identical whichever batch or chunk computes the token. The
    master table is float64 on the CPU; each (dtype, device) the model runs in gets a
    rounded copy, so CPU and CUDA models see the same numbers.
    """

    def __init__(self, *, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        self._inv_freq = 1.0 / (theta**exponents)
        self._cos = torch.empty(0, head_dim, dtype=torch.float64)
        self._sin = torch.empty(0, head_dim, dtype=torch.float64)
        self._converted: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]]
        self._converted = {}

    def lookup(
        self, positions: torch.Tensor, *, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [len(positions), head_dim] in `dtype` on positions' device."""
        self._grow(max_position + 1)
        key = (dtype, positions.device)
        table = self._converted.get(key)
        if table is None or table[0].shape[0] != self._cos.shape[0]:
            table = (self._cos.to(positions.device, dtype), self._sin.to(positions.device, dtype))
            self._converted[key] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _grow(self, length: int) -> None:
        if length <= self._cos.shape[0]:
            return
        pages = [(self._cos, self._sin)]
        pages += [self._page(start) for start in range(self._cos.shape[0], length, _PAGE)]
        self._cos = torch.cat([cos for cos, _ in pages])
        self._sin = torch.cat([sin for _, sin in pages])

    def _page(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + _PAGE, dtype=torch.float64)
        angles = torch.outer(positions, self._inv_freq)
        # Both halves of the head share frequencies: element i pairs with i + head_dim/2.
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
