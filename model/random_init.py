"""Deterministic random weights for tests and benchmarks without a checkpoint."""

from __future__ import annotations

import torch

from model.llama import LlamaForCausalLM


def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Fill every parameter from a private generator seeded with `seed`.

    Values are drawn in float64 on the CPU in a fixed parameter order and then rounded to
    the model's dtype/device, so the same seed gives the same model (up to that rounding)
    on any device and regardless of global RNG state. Scales keep activations O(1):
    matrices use std 1/sqrt(fan_in), so logits are roughly unit-variance and greedy
    decoding has clear winners; norm gains are jittered around 1 so they are exercised.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
            elif name == "embed_tokens":
                values = torch.randn(shape, generator=generator, dtype=torch.float64)
            else:
                std = shape[-1] ** -0.5
                values = std * torch.randn(shape, generator=generator, dtype=torch.float64)
            param.copy_(values)
