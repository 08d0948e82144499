"""The KV block pools in torch tensors: the GPU cache and the CPU swap pool.

``gpu_cache`` holds ``num_gpu_blocks`` blocks on the model's device (CUDA when the
engine runs there); ``cpu_cache`` holds ``num_cpu_blocks`` blocks in host memory,
pinned when CUDA is present so swaps are async-capable DMA copies. Swapping is a
whole-block copy between the two (every layer, K and V), one batched call per step
for all the step's victims (``swap_out``) or swapped-in requests (``swap_in``).
``snapshot``/``restore`` save GPU block contents for a step's rollback.

The block *accounting* lives in ``impl.block_manager``; this module only moves data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model import LlamaForCausalLM, PagedKVCache

Snapshot = tuple[torch.Tensor, torch.Tensor]


class CacheEngine:
    """Owns the device KV cache and the host swap pool of one engine."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
    ) -> None:
        self.block_size = block_size
        self.gpu_cache: PagedKVCache = model.new_kv_cache(
            num_blocks=num_gpu_blocks, block_size=block_size
        )
        # A zero-block pool is not a tensor shape PagedKVCache accepts: no pool at all.
        self.cpu_cache: PagedKVCache | None = None
        if num_cpu_blocks > 0:
            self.cpu_cache = model.new_kv_cache(
                num_blocks=num_cpu_blocks,
                block_size=block_size,
                device=torch.device("cpu"),
                pin_memory=self.gpu_cache.device.type == "cuda",
            )

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy GPU blocks to CPU blocks: ``mapping`` holds (gpu_block, cpu_block) pairs."""
        if not mapping:
            return
        cpu_cache = self._require_cpu()
        src, dst = zip(*mapping, strict=True)
        self.gpu_cache.copy_blocks_to(cpu_cache, src, dst)

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy CPU blocks to GPU blocks: ``mapping`` holds (cpu_block, gpu_block) pairs."""
        if not mapping:
            return
        cpu_cache = self._require_cpu()
        src, dst = zip(*mapping, strict=True)
        cpu_cache.copy_blocks_to(self.gpu_cache, src, dst)

    def snapshot(self, gpu_block_ids: Sequence[int]) -> Snapshot:
        """Copies of the contents of ``gpu_block_ids`` (for ``restore`` on rollback)."""
        return self.gpu_cache.snapshot(gpu_block_ids)

    def restore(self, gpu_block_ids: Sequence[int], saved: Snapshot) -> None:
        self.gpu_cache.restore(gpu_block_ids, saved)

    def _require_cpu(self) -> PagedKVCache:
        if self.cpu_cache is None:
            raise RuntimeError("swap requested but the engine has no CPU swap pool")
        return self.cpu_cache
