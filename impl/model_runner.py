"""Turns a step's schedule into one forward pass and the tokens it samples."""

from __future__ import annotations

import torch

from impl.cache_engine import CacheEngine
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence
from model import ForwardBatch, LlamaForCausalLM, Span
from model.sampling import sample_tokens


class ModelRunner:
    """Runs the model on the scheduled chunks and samples where a request reached its end.

    ``execute`` is the single entry point of the forward (tests inject faults by
    replacing it). It reads the scheduler's output *before* ``commit``: a chunk of
    ``n`` tokens of ``seq`` covers positions ``seq.num_computed ..`` and samples iff it
    reaches ``seq.num_tokens`` (R10).
    """

    def __init__(self, model: LlamaForCausalLM, cache_engine: CacheEngine) -> None:
        self.model = model
        self.cache_engine = cache_engine

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        """One span per scheduled chunk: its tokens, start position and block table."""
        spans = []
        for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
            start = seq.num_computed
            spans.append(
                Span(
                    token_ids=tuple(seq.token_ids[start : start + n]),
                    start_pos=start,
                    block_table=tuple(seq.block_table),
                )
            )
        return ForwardBatch(spans=tuple(spans))

    def execute(self, out: SchedulerOutput) -> list[int]:
        """Forward the scheduled chunks; the sampled tokens, in plan order."""
        if not out.scheduled:
            return []
        batch = self.build_batch(out)
        rows: list[int] = []
        samplers: list[Sequence] = []
        for row, (seq, n) in enumerate(zip(out.scheduled, out.num_scheduled, strict=True)):
            if seq.num_computed + n == seq.num_tokens:  # else a prefill chunk, mid-prompt
                rows.append(row)
                samplers.append(seq)
        with torch.inference_mode():
            logits = self.model.forward(batch, self.cache_engine.gpu_cache)
            if not rows:
                return []
            # One device->host transfer for every sampled row (exact: no rounding).
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            picked = logits.index_select(0, index).to("cpu")
            return sample_tokens(
                picked,
                temperatures=[seq.temperature for seq in samplers],
                seeds=[seq.seed for seq in samplers],
                output_indices=[seq.num_tokens - seq.num_prompt_tokens for seq in samplers],
            )
