"""Cross-check against Hugging Face transformers' own Llama implementation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench._hf import save_tiny_hf_llama
from model import load_hf_checkpoint
from tests.model.helpers import greedy_generate, hf_greedy

PROMPTS = ([5, 17, 99, 3], list(range(30, 60)), [7])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, save_tiny_hf_llama(path, seed=1234)


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_greedy_tokens_match_hf_generate(checkpoint: tuple[Path, Any], prompt: list[int]) -> None:
    path, hf_model = checkpoint
    ours = load_hf_checkpoint(path)
    expected = hf_greedy(hf_model, prompt, 12)
    tokens, _ = greedy_generate(ours, prompt, 12, block_size=4)
    assert tokens == expected


def test_logits_match_hf_forward(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    prompt = PROMPTS[1]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    _, logits = greedy_generate(load_hf_checkpoint(path), prompt, 1)
    assert logits[0].dtype == torch.float32
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def test_float64_load_matches_hf(checkpoint: tuple[Path, Any]) -> None:
    # HF keeps norms and RoPE in float32 even for float64 models, hence the looser bound.
    path, hf_model = checkpoint
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1].double()
    _, logits = greedy_generate(load_hf_checkpoint(path, dtype=torch.float64), prompt, 1)
    assert logits[0].dtype == torch.float64
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def test_tied_embeddings(tmp_path: Path) -> None:
    hf_model = save_tiny_hf_llama(tmp_path, seed=7, tie_word_embeddings=True)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.lm_head is ours.embed_tokens
    prompt = [9, 8, 7, 6, 5]
    tokens, _ = greedy_generate(ours, prompt, 12)
    assert tokens == hf_greedy(hf_model, prompt, 12)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = save_tiny_hf_llama(tmp_path, seed=8, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tokens, _ = greedy_generate(load_hf_checkpoint(tmp_path), prompt, 12)
    assert tokens == hf_greedy(hf_model, prompt, 12)


def test_explicit_head_dim_and_mha(tmp_path: Path) -> None:
    # head_dim 32 != hidden/heads = 16, and as many KV heads as query heads.
    hf_model = save_tiny_hf_llama(tmp_path, seed=9, head_dim=32, num_key_value_heads=4)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.config.head_dim == 32
    prompt = [40, 41, 42, 43, 44, 45]
    tokens, _ = greedy_generate(ours, prompt, 12)
    assert tokens == hf_greedy(hf_model, prompt, 12)
