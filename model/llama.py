"""Llama decoder for causal LM over a paged KV cache.

Batch invariance: in float64 the logits of a token are bit-identical whichever other
requests share its forward, however its prompt was chunked, and wherever its KV lives
in the cache. How (details and measurements in `model.plan`):

* attention is computed per group of spans over gathered slots of their own requests,
  never over a packed sequence, so no reduction mixes requests;
* all GEMM operands are padded to fixed row/context tiles, so every real row lands in
  a full BLAS row block (BLAS rounds ragged edge rows differently) and the reduction
  over context only grows by exact zeros;
* per-token quantities are per-row ops (RMSNorm, SwiGLU) or table lookups (RoPE).

`batch_invariant=False` drops the padding for speed; outputs then agree with the
invariant mode only to rounding. Cost of the default on CPU: a lone decode span runs its
linear layers as an 8-row GEMM instead of a GEMV (measured 1.4x slower per step in
float64, 2x in float32 for a 40M-parameter model); with 8 or more tokens in the
forward the difference is within noise. The guarantee is measured and tested on the
CPU (MKL) build; cuBLAS picks kernels by shape too, so on CUDA it is likely but untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.batch import ForwardBatch
from model.config import LlamaConfig
from model.decoder_layer import DecoderLayer
from model.kv_cache import PagedKVCache
from model.norm import RMSNorm
from model.plan import build_plan
from model.rope import RotaryTable


class LlamaForCausalLM(torch.nn.Module):
    """Embedding, decoder layers, final norm and LM head; inference only.

    Weights are allocated uninitialised: use `model.loader` to fill them. Parameters do
    not require grad. Move the model by constructing it on the target device/dtype
    rather than with `.to()`, which would not move caches created earlier.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        batch_invariant: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        dev = torch.device(device)
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=dev))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=dev)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=dev)
        # Tied models register the very same Parameter twice, so loading the embedding
        # also loads the head.
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=dev))
        )
        self._rope = RotaryTable(head_dim=config.head_dim, theta=config.rope_theta)
        self.requires_grad_(False)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The transformer blocks, typed (ModuleList items are plain Modules to mypy)."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of weights, activations and KV cache."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Device of weights, activations and KV cache."""
        return self.embed_tokens.device

    @property
    def logits_dtype(self) -> torch.dtype:
        """Dtype of `forward`'s logits: float32, or float64 for a float64 model."""
        return torch.promote_types(self.dtype, torch.float32)

    def new_kv_cache(
        self,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | None = None,
        pin_memory: bool = False,
    ) -> PagedKVCache:
        """An empty cache shaped for this model (same dtype; device defaults to the model's)."""
        return PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device if device is None else device,
            pin_memory=pin_memory,
        )

    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """Run all spans, store their K/V in the cache, return next-token logits.

        Returns the logits of each span's last ``num_logits`` tokens (one row per span
        by default: [len(batch.spans), vocab_size]), span after span, in
        `logits_dtype` (float32, or float64 for a float64 model).
        """
        self._check_cache(kv_cache)
        with torch.no_grad():
            plan = build_plan(
                batch,
                block_size=kv_cache.block_size,
                num_blocks=kv_cache.num_blocks,
                vocab_size=self.config.vocab_size,
                num_heads=self.config.num_attention_heads,
                num_kv_heads=self.config.num_key_value_heads,
                invariant=self.batch_invariant,
                dtype=self.dtype,
                device=self.device,
            )
            rope = self._rope.lookup(
                plan.positions, max_position=plan.max_position, dtype=self.dtype
            )
            x = F.embedding(plan.token_ids, self.embed_tokens)
            for layer in self.layers:
                x = layer(x, rope, plan, kv_cache)
            last = self.norm(x.index_select(0, plan.last_rows))
            logits = F.linear(last, self.lm_head)[: plan.num_logits]
            return logits.to(self.logits_dtype)

    def _check_cache(self, kv_cache: PagedKVCache) -> None:
        expected = (
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
        )
        actual = (
            kv_cache.num_layers,
            kv_cache.num_kv_heads,
            kv_cache.head_dim,
            kv_cache.dtype,
            kv_cache.device,
        )
        if actual != expected:
            raise ValueError(
                "KV cache (layers, kv_heads, head_dim, dtype, device) = "
                f"{actual} does not match the model's {expected}"
            )
