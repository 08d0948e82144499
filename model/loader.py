"""Constructing models: deterministic tiny random models and local HF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from model.config import LlamaConfig
from model.devices import resolve_device, resolve_dtype
from model.errors import CheckpointError, CheckpointNotFoundError
from model.hf_config import config_from_hf
from model.hf_weights import hf_targets, is_ignorable
from model.llama import LlamaForCausalLM
from model.random_init import init_random_weights

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "build_tiny_model",
    "load_hf_checkpoint",
    "resolve_device",
    "resolve_dtype",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def build_tiny_model(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: LlamaConfig | None = None,
    batch_invariant: bool = True,
) -> LlamaForCausalLM:
    """A model (default: the tiny LlamaConfig()) with weights determined by `seed` alone."""
    model = LlamaForCausalLM(
        config or LlamaConfig(), dtype=dtype, device=device, batch_invariant=batch_invariant
    )
    init_random_weights(model, seed)
    return model


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch_invariant: bool = True,
) -> LlamaForCausalLM:
    """Load a local Hugging Face Llama directory (config.json + *.safetensors).

    Single-file and sharded (with model.safetensors.index.json) layouts are supported.
    Tensors are read one at a time with `safetensors` and converted straight into the
    model's dtype/device. Raises CheckpointNotFoundError for missing files and
    CheckpointError for non-Llama configs and missing, unexpected or misshapen tensors.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {directory} does not exist")
    config = config_from_hf(_read_json(directory / "config.json"))
    model = LlamaForCausalLM(config, dtype=dtype, device=device, batch_invariant=batch_invariant)
    _load_weights(model, _weight_files(directory))
    return model


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path.name} not found in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files to read, from the shard index when there is one."""
    index = directory / _INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = [directory / name for name in sorted(set(map(str, weight_map.values())))]
    elif (directory / _SINGLE).is_file():
        files = [directory / _SINGLE]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(
            f"no *.safetensors weights in {directory} (PyTorch .bin checkpoints are not supported)"
        )
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"shard {file.name} listed in {_INDEX} is missing")
    return files


def _load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    targets = hf_targets(model)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = targets.get(name)
                    if target is None:
                        if is_ignorable(name, tied=tied):
                            continue
                        raise CheckpointError(f"unexpected tensor {name!r} in {file.name}")
                    tensor = reader.get_tensor(name)
                    rows = target.param[target.start : target.stop]
                    if tuple(tensor.shape) != tuple(rows.shape):
                        raise CheckpointError(
                            f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(rows.shape)} for this config"
                        )
                    rows.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint lacks {len(missing)} required tensors: {shown}")
