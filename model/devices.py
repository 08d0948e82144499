"""Parsing of user-facing device and dtype names."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """ "auto" -> CUDA when available else CPU; "cpu"; "cuda" or "cuda:N" (must exist)."""
    name = device.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        resolved = torch.device(name)
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"device {device!r} requested but only {count} CUDA devices exist")
        return resolved
    raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


def resolve_dtype(name: str) -> torch.dtype:
    """float32, float64, bfloat16 or float16 (short aliases like 'bf16' accepted)."""
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of float32, float64, bfloat16, float16"
        ) from None
