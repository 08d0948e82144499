"""Checkpoint loading errors, config translation, tiny models, device/dtype names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench._hf import save_tiny_hf_llama
from model import (
    CheckpointError,
    ForwardBatch,
    LlamaConfig,
    Span,
    build_tiny_model,
    load_hf_checkpoint,
    resolve_device,
    resolve_dtype,
)
from model.errors import CheckpointNotFoundError
from model.hf_config import config_from_hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    save_tiny_hf_llama(path, seed=3)
    return path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json not found") as info:
        load_hf_checkpoint(tmp_path)
    assert isinstance(info.value, FileNotFoundError)


def test_non_llama_model_type(saved: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(saved, tmp_path)
    edit_config(path, model_type="mistral")
    with pytest.raises(CheckpointError, match=r"'mistral'.*only 'llama'"):
        load_hf_checkpoint(path)


def test_missing_tensor(saved: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(saved, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"lacks 1 required tensors: model\.layers\.1\.mlp\.up_proj"
    ):
        load_hf_checkpoint(path)


def test_misshapen_and_unexpected_tensors(saved: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(saved, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape \(3,\)"):
        load_hf_checkpoint(path)
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_hf_checkpoint(path)


def test_no_weight_files(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((saved / "config.json").read_bytes())
    with pytest.raises(CheckpointNotFoundError, match="no \\*\\.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_rope_scaling_rejected(saved: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(saved, tmp_path)
    edit_config(path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_hf_checkpoint(path)


HF4_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
}


def test_config_translation_transformers4_layout() -> None:
    config = config_from_hf(HF4_CONFIG)
    assert config.num_key_value_heads == 2  # defaults to num_attention_heads
    assert config.rope_theta == 500000.0
    assert config.rms_norm_eps == 1e-5
    assert config.head_dim == 16
    assert not config.tie_word_embeddings


def test_config_translation_transformers5_layout() -> None:
    raw = HF4_CONFIG | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0},
        "head_dim": 8,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }
    del raw["rope_theta"]
    config = config_from_hf(raw)
    assert (config.rope_theta, config.head_dim, config.num_key_value_heads) == (1234.0, 8, 1)
    assert config.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_parameters"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_attention_heads": 3}, "invalid Llama config"),
        ({"vocab_size": "many"}, "vocab_size"),
    ],
)
def test_config_translation_rejects(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(HF4_CONFIG | change)
    with pytest.raises(CheckpointError, match="lacks required keys: hidden_size"):
        config_from_hf({k: v for k, v in HF4_CONFIG.items() if k != "hidden_size"})


def test_tiny_model_is_determined_by_seed() -> None:
    torch.manual_seed(0)
    first = build_tiny_model(seed=5)
    torch.manual_seed(1)  # global RNG must not leak in
    second = build_tiny_model(seed=5)
    other = build_tiny_model(seed=6)
    for (name, a), b, c in zip(
        first.state_dict().items(),
        second.state_dict().values(),
        other.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name


def test_tiny_model_runs_in_float32_and_float64() -> None:
    batch = ForwardBatch((Span((1, 2, 3, 4, 5), 0, (0, 1)), Span((7,), 0, (2,))))
    outputs = {}
    for dtype in (torch.float32, torch.float64):
        model = build_tiny_model(seed=2, dtype=dtype)
        logits = model(batch, model.new_kv_cache(num_blocks=3, block_size=4))
        assert logits.shape == (2, 256) and logits.dtype == dtype
        assert torch.isfinite(logits).all()
        outputs[dtype] = logits
    torch.testing.assert_close(
        outputs[torch.float32].double(), outputs[torch.float64], rtol=1e-4, atol=1e-4
    )


def test_tiny_model_custom_config_and_tying() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = build_tiny_model(seed=0, config=config)
    assert model.lm_head is model.embed_tokens
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    logits = model(
        ForwardBatch((Span((3,), 0, (0,)),)), model.new_kv_cache(num_blocks=1, block_size=4)
    )
    assert logits.shape == (1, 64)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")


def test_resolve_dtype() -> None:
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("float64") is torch.float64
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8")


def test_load_into_other_dtypes(saved: Path) -> None:
    model = load_hf_checkpoint(saved, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    logits = model(
        ForwardBatch((Span((1, 2, 3), 0, (0,)),)), model.new_kv_cache(num_blocks=1, block_size=4)
    )
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
