"""Next-token choice from logits, reproducible per (seed, output index)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def sample_token(
    logits: torch.Tensor, *, temperature: float, seed: int | None, output_index: int
) -> int:
    """Pick a token id from 1-D `logits` [vocab_size].

    temperature == 0: greedy argmax; ties go to the lowest token id.
    temperature > 0: a draw from softmax(logits / temperature) made with a fresh CPU
    generator seeded from (seed, output_index) via the Gumbel-max trick. The choice is a
    function of (seed, output_index, logits) only: global RNG state, batch composition,
    preemption and recomputation cannot change it. `seed=None` means seed 0.
    """
    if logits.dim() != 1 or logits.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty 1-D tensor, got shape {tuple(logits.shape)}")
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if output_index < 0:
        raise ValueError(f"output_index must be >= 0, got {output_index}")
    # float64 on the CPU: the draw must not depend on the device or the model's dtype.
    scores = logits.detach().to("cpu", torch.float64)
    if bool(torch.isnan(scores).any()):
        raise ValueError("logits contain NaN")
    if temperature == 0.0:
        return _first_argmax(scores)
    generator = torch.Generator(device="cpu").manual_seed(mix_seed(seed or 0, output_index))
    uniform = torch.rand(scores.shape, generator=generator, dtype=torch.float64)
    # -log(-log(u)) is standard Gumbel noise; argmax(x/T + G) ~ softmax(x/T). Clamping
    # keeps u away from 0, where log(0) would turn a legal token into -inf.
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
    return _first_argmax(scores / temperature + gumbel)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperatures: Sequence[float],
    seeds: Sequence[int | None],
    output_indices: Sequence[int],
) -> list[int]:
    """`sample_token` of each row of 2-D `logits` [n, vocab_size], with row i's parameters.

    Same choices and errors as calling `sample_token` row by row, but the greedy rows
    share one argmax: a per-row call costs several small tensor ops, which add up to a
    noticeable share of a decode step at hundreds of requests.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be a non-empty 2-D tensor, got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if not rows == len(temperatures) == len(seeds) == len(output_indices):
        raise ValueError(
            f"{rows} logits rows but {len(temperatures)} temperatures, {len(seeds)} seeds "
            f"and {len(output_indices)} output indices"
        )
    if any(index < 0 for index in output_indices):
        raise ValueError(f"output_index must be >= 0, got {min(output_indices)}")
    scores = logits.detach().to("cpu")
    if bool(torch.isnan(scores).any()):
        raise ValueError("logits contain NaN")
    greedy = [i for i, temperature in enumerate(temperatures) if temperature == 0.0]
    tokens = [0] * rows
    if greedy:
        # torch.argmax returns the first maximal index, i.e. ties go to the lowest id as in
        # `_first_argmax`; and widening to float64 preserves order and ties, so the row's
        # own dtype picks the same token without a conversion.
        best = (scores if len(greedy) == rows else scores[greedy]).argmax(dim=1)
        for i, token in zip(greedy, best.tolist(), strict=True):
            tokens[i] = token
    for i, temperature in enumerate(temperatures):
        if temperature != 0.0:
            tokens[i] = sample_token(
                scores[i], temperature=temperature, seed=seeds[i], output_index=output_indices[i]
            )
    return tokens


def _first_argmax(values: torch.Tensor) -> int:
    best = values.max()
    return int((values == best).nonzero()[0, 0])


def mix_seed(seed: int, output_index: int) -> int:
    """SplitMix64 of the pair, so nearby (seed, index) pairs give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
