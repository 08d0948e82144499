"""Where each Hugging Face Llama tensor lives in LlamaForCausalLM.

Our model stacks q/k/v and gate/up into single matrices, so one HF tensor can be a
row range of one of our parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.llama import LlamaForCausalLM

# Tensors some exporters write that carry no weights (recomputed RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class Target:
    """Rows [start, stop) of `param` receive the checkpoint tensor."""

    param: torch.nn.Parameter
    start: int
    stop: int


def hf_targets(model: LlamaForCausalLM) -> dict[str, Target]:
    """HF tensor name -> destination, for every tensor the checkpoint must provide."""
    config = model.config
    targets = {
        "model.embed_tokens.weight": _whole(model.embed_tokens),
        "model.norm.weight": _whole(model.norm.weight),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _whole(model.lm_head)
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj
        gate_up = layer.mlp.gate_up_proj
        targets |= {
            prefix + "self_attn.q_proj.weight": Target(qkv, 0, q_rows),
            prefix + "self_attn.k_proj.weight": Target(qkv, q_rows, q_rows + kv_rows),
            prefix + "self_attn.v_proj.weight": Target(qkv, q_rows + kv_rows, q_rows + 2 * kv_rows),
            prefix + "self_attn.o_proj.weight": _whole(layer.self_attn.o_proj),
            prefix + "mlp.gate_proj.weight": Target(gate_up, 0, ffn),
            prefix + "mlp.up_proj.weight": Target(gate_up, ffn, 2 * ffn),
            prefix + "mlp.down_proj.weight": _whole(layer.mlp.down_proj),
            prefix + "input_layernorm.weight": _whole(layer.input_layernorm.weight),
            prefix + "post_attention_layernorm.weight": _whole(
                layer.post_attention_layernorm.weight
            ),
        }
    return targets


def is_ignorable(name: str, *, tied: bool) -> bool:
    """Extra tensors that are safe to skip: RoPE buffers, and a tied model's copy of the head."""
    return name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")


def _whole(param: torch.nn.Parameter) -> Target:
    return Target(param, 0, param.shape[0])
