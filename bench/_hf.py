"""Tiny random Hugging Face Llama checkpoints for the benchmarks (needs ``transformers``)."""

from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

# The tiny shape the model tests use (tests/model/helpers.py): vocabulary 256, hidden 64,
# 2 layers, 4 query heads over 2 KV heads.
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


def save_tiny_hf_llama(path: Path, *, seed: int, **overrides: int) -> Any:
    """A random ``transformers.LlamaForCausalLM`` (float32, eval) saved as safetensors in
    ``path``; returns the in-memory model. No BOS/EOS/pad ids: nothing stops early."""
    transformers = transformers_module()
    config = transformers.LlamaConfig(
        **(TINY_SHAPE | overrides),
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model.save_pretrained(str(path), safe_serialization=True)
    return hf_model.eval()
