"""Architecture hyperparameters of a Llama-family decoder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Shapes and constants of a Llama model; defaults describe the tiny test model.

    `attention_head_dim` mirrors Hugging Face's optional `head_dim` key: most checkpoints
    leave it out and use hidden_size // num_attention_heads, a few set it explicitly. It
    is a separate field (not `head_dim`) because `head_dim` is the always-defined property.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_head_dim: int | None = None

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads "
                f"(got {self.num_attention_heads} and {self.num_key_value_heads})"
            )
        if self.attention_head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; set attention_head_dim"
            )
        # RoPE rotates pairs (i, i + head_dim/2), so an odd head_dim has no valid layout.
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def num_query_groups(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads
