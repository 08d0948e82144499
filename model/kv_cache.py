"""A preallocated, block-paged key/value store shared by all requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedKVCache:
    """K and V for every layer, split into fixed-size blocks of token slots.

    Layout is [num_layers, num_blocks, block_size, num_kv_heads, head_dim] so that one
    index along dim 1 moves a whole block across all layers at once (swap in/out), and
    `key[layer].view(-1, num_kv_heads, head_dim)` is a flat slot-addressed view for the
    attention kernels. Memory is zero-filled, not empty: attention multiplies masked
    slots by an exact 0 probability, and 0 * NaN from uninitialised memory would be NaN.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"PagedKVCache {name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # Pinned host memory only exists with a CUDA runtime; without one the request is moot
        # (there is no device to transfer to), so it is ignored rather than an error.
        pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        self.value = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        # The allocated tensor's device is canonical ("cuda" becomes "cuda:0").
        self.device = self.key.device

    @property
    def num_slots(self) -> int:
        """Total token capacity."""
        return self.num_blocks * self.block_size

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat [num_slots, num_kv_heads, head_dim] views of one layer's K and V."""
        flat = (self.num_slots, self.num_kv_heads, self.head_dim)
        return self.key[layer].view(flat), self.value[layer].view(flat)

    def copy_blocks_to(
        self,
        dst: PagedKVCache,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """Copy whole blocks (every layer, K and V) from this cache into `dst`.

        Used for swap-out (device pool -> host pool) and swap-in (host -> device). One
        gather, one transfer and one scatter per tensor, whatever the number of blocks.
        """
        if (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim) != (
            dst.num_layers,
            dst.block_size,
            dst.num_kv_heads,
            dst.head_dim,
        ):
            raise ValueError("copy_blocks_to: source and destination caches differ in layout")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(
                f"copy_blocks_to: {len(src_block_ids)} source blocks "
                f"but {len(dst_block_ids)} destination blocks"
            )
        if not src_block_ids:
            return
        src_index = self._block_index(src_block_ids, self.device)
        dst_index = dst._block_index(dst_block_ids, dst.device, unique=True)
        for src_tensor, dst_tensor in ((self.key, dst.key), (self.value, dst.value)):
            moved = src_tensor.index_select(1, src_index).to(dst.device, dst.dtype)
            dst_tensor.index_copy_(1, dst_index, moved)

    def snapshot(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V contents of `block_ids` ([num_layers, n, ...] each)."""
        index = self._block_index(block_ids, self.device)
        return self.key.index_select(1, index), self.value.index_select(1, index)

    def restore(self, block_ids: Sequence[int], saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write back contents previously taken by `snapshot` (possibly into other blocks)."""
        index = self._block_index(block_ids, self.device, unique=True)
        saved_key, saved_value = saved
        expected = (self.num_layers, len(block_ids), *self.key.shape[2:])
        if tuple(saved_key.shape) != expected or tuple(saved_value.shape) != expected:
            raise ValueError(
                f"restore: saved tensors have shape {tuple(saved_key.shape)}, expected {expected}"
            )
        self.key.index_copy_(1, index, saved_key.to(self.device, self.dtype))
        self.value.index_copy_(1, index, saved_value.to(self.device, self.dtype))

    def _block_index(
        self, block_ids: Sequence[int], device: torch.device, *, unique: bool = False
    ) -> torch.Tensor:
        """Validated index tensor; duplicate destinations would make index_copy_ racy."""
        ids = list(block_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks}): {ids}")
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination block ids: {ids}")
        return torch.tensor(ids, dtype=torch.long, device=device)
