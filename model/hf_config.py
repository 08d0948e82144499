"""Translation of a Hugging Face Llama `config.json` into LlamaConfig."""

from __future__ import annotations

from typing import Any

from model.config import LlamaConfig
from model.errors import CheckpointError

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def config_from_hf(raw: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig for a Hugging Face config dict; CheckpointError if it is not plain Llama.

    Anything that would change the computation and that this implementation lacks
    (RoPE scaling, biases, another activation) is rejected rather than ignored, since
    silently running a different function would be worse than refusing.
    """
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: only 'llama' checkpoints are supported"
        )
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise CheckpointError(f"config.json lacks required keys: {', '.join(missing)}")
    _reject_unsupported(raw)
    heads = _int(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads")
    head_dim = raw.get("head_dim")
    try:
        return LlamaConfig(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=_int(raw, "hidden_size"),
            intermediate_size=_int(raw, "intermediate_size"),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else _int(raw, "num_key_value_heads"),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_head_dim=None if head_dim is None else _int(raw, "head_dim"),
        )
    except ValueError as err:
        raise CheckpointError(f"invalid Llama config: {err}") from err


def _reject_unsupported(raw: dict[str, Any]) -> None:
    scaling = raw.get("rope_scaling")
    if scaling is not None and _rope_type(scaling) != "default":
        raise CheckpointError(f"rope_scaling {scaling!r} is not supported (plain RoPE only)")
    parameters = raw.get("rope_parameters")
    if parameters is not None and _rope_type(parameters) != "default":
        raise CheckpointError(f"rope_parameters {parameters!r} is not supported (plain RoPE only)")
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(f"hidden_act {activation!r} is not supported (silu only)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag, False):
            raise CheckpointError(f"{flag}=true is not supported (bias-free Llama only)")


def _rope_type(section: Any) -> str:
    if not isinstance(section, dict):
        raise CheckpointError(f"RoPE settings must be an object, got {section!r}")
    return str(section.get("rope_type", section.get("type", "default")))


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 nests theta in rope_parameters; 4.x keeps it top level.
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return _float(parameters, "rope_theta", 10000.0)
    return _float(raw, "rope_theta", 10000.0)


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"config key {key!r} must be an integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"config key {key!r} must be a number, got {value!r}")
    return float(value)
