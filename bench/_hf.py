"""Tiny random Hugging Face Llama checkpoints for the benchmarks and the model tests
(needs ``transformers``)."""

from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

# The tiny shape of the benchmarks and the model tests (tests/model/helpers.py):
# vocabulary 256, hidden 64, 2 layers, 4 query heads over 2 KV heads.
TINY_SHAPE: dict[str, int] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def transformers_module() -> Any:
    """``transformers``, imported lazily and with its logging quietened."""
    transformers: Any = importlib.import_module("transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # Continuous batching logs psutil warnings and memory breakdowns on CPU.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    return transformers


def transformers_version() -> str:
    return str(transformers_module().__version__)


def build_tiny_hf_llama(
    *,
    seed: int,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    **overrides: Any,
) -> Any:
    """A random ``transformers.LlamaForCausalLM`` (eval, float32) fixed by ``seed``.

    The global torch RNG is forked, so callers' random state is untouched. BOS/EOS/pad
    are unset so ``generate`` never stops early on a random "end" token. ``overrides``
    replace entries of ``TINY_SHAPE`` or add other ``LlamaConfig`` keys.
    """
    transformers = transformers_module()
    config = transformers.LlamaConfig(
        **(TINY_SHAPE | overrides),
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = transformers.LlamaForCausalLM(config)
    return hf_model.eval()


def save_tiny_hf_llama(
    path: str | Path, *, seed: int, max_shard_size: str | None = None, **build: Any
) -> Any:
    """``build_tiny_hf_llama(seed=seed, **build)`` saved as safetensors in ``path``; returns
    the in-memory model. ``max_shard_size`` (e.g. "20KB") forces a sharded checkpoint with
    an index file."""
    hf_model = build_tiny_hf_llama(seed=seed, **build)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model.save_pretrained(str(path), **kwargs)
    return hf_model
