"""Verifying drafts against the model's logits (speculative decoding).

A request that ran ``d`` drafts has ``d + 1`` logits rows: row ``i`` scores the token
after draft ``i - 1`` (row 0: after its last known token). The verify returns a *run*:
the drafts accepted, in order, then one token of the model's own.

- **temperature 0** (greedy): a draft is accepted while it equals the argmax of its row;
  the run ends with the argmax of the first row whose draft was rejected, or of the
  last row (the bonus token). The run is exactly what greedy decoding one token at a
  time would produce: the outputs equal those without drafts, token for token.
- **temperature > 0**: rejection sampling with a one-hot draft distribution, as vLLM's
  ``RejectionSampler`` does for the n-gram drafter (``draft_probs=None``): draft ``x``
  at row ``i`` is accepted with probability ``p_i(x)`` (``min(1, p/q)`` with ``q(x) =
  1``); on a rejection the row's token is drawn from ``p_i`` with ``x`` removed and
  renormalised (``max(0, p - q)``); if every draft is accepted the bonus token is drawn
  from the last row. Each output token is then distributed exactly as ``p`` given the
  tokens before it, as without drafts, but the draws differ: the equality is in
  distribution, not token for token (tests/model/test_rejection_sampler.py).

Every draw comes from a CPU generator seeded by ``(seed, output index)`` (salted apart
from ``model.sampling``'s), so a verify is a function of its inputs only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.sampling import mix_seed, sample_token

#: Keeps the acceptance draws apart from the sampler's Gumbel noise of the same index.
_ACCEPT_SALT = 0x5EC_DEC0DE


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[int],
    *,
    temperature: float,
    seed: int | None,
    output_index: int,
) -> list[int]:
    """The run of one request: ``logits`` [len(drafts) + 1, vocab] (see the module doc).
    ``output_index`` is the output index of the token row 0 samples. A draft outside
    the vocabulary (a pad, -1) is never accepted. Logits with a NaN raise ``ValueError``,
    as ``model.sampling`` does."""
    if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"{len(drafts)} drafts need {len(drafts) + 1} logits rows, got {tuple(logits.shape)}"
        )
    scores = logits.detach().to("cpu", torch.float64)
    if bool(torch.isnan(scores).any()):
        # As model.sampling: greedy argmax would take a NaN for the largest score.
        raise ValueError("logits contain NaN")
    vocab = scores.shape[1]
    run: list[int] = []
    if temperature == 0.0:
        targets = scores.argmax(dim=1).tolist()  # ties: the lowest id, as sample_token
        for draft, target in zip(drafts, targets, strict=False):
            if draft != target:
                break
            run.append(draft)
        run.append(targets[len(run)])
        return run
    for i, draft in enumerate(drafts):
        index = output_index + i
        probs = torch.softmax(scores[i] / temperature, dim=0)
        if 0 <= draft < vocab:
            generator = torch.Generator(device="cpu").manual_seed(
                mix_seed((seed or 0) ^ _ACCEPT_SALT, index)
            )
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < probs[draft]:
                run.append(draft)
                continue
            probs = probs.clone()
            probs[draft] = 0.0
            if not bool(probs.any()):  # p(x) rounds to 1: nothing else to draw
                run.append(draft)
                continue
        run.append(_draw(probs, seed, index))
        return run
    last = len(drafts)
    run.append(
        sample_token(
            scores[last], temperature=temperature, seed=seed, output_index=output_index + last
        )
    )
    return run


def _draw(probs: torch.Tensor, seed: int | None, index: int) -> int:
    """A draw from ``probs`` (not necessarily normalised) by the Gumbel-max trick on its
    logs, with the sampler's generator of ``(seed, index)``."""
    return sample_token(torch.log(probs), temperature=1.0, seed=seed, output_index=index)
