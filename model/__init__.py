"""Llama decoder over a paged KV cache, checkpoint loading and sampling."""

import model._clash  # noqa: F401  (first: names a shadowed spec/impl/model)
from model.batch import ForwardBatch, Span
from model.config import LlamaConfig
from model.devices import resolve_device, resolve_dtype
from model.errors import CheckpointError, CheckpointNotFoundError
from model.kv_cache import PagedKVCache
from model.llama import LlamaForCausalLM
from model.loader import build_tiny_model, load_hf_checkpoint
from model.sampling import sample_token

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ForwardBatch",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PagedKVCache",
    "Span",
    "build_tiny_model",
    "load_hf_checkpoint",
    "resolve_device",
    "resolve_dtype",
    "sample_token",
]
