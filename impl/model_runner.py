"""Turns a step's schedule into one forward pass and the tokens it samples."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from impl.cache_engine import CacheEngine
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence
from model import ForwardBatch, LlamaForCausalLM, Span
from model.sampling import sample_tokens


@dataclass(frozen=True, slots=True)
class ForwardInput:
    """A step's forward, read off the requests as scheduled (``ModelRunner.prepare``).

    ``spans`` hold each chunk's known tokens; ``on_placeholder`` the chunks scheduled on
    a placeholder (async scheduling): their last token is the one the step in flight
    brings (``SchedulerOutput.pending``), put in when the forward runs. ``rows`` are the
    chunks that sample, with their requests' sampler inputs.
    """

    spans: tuple[Span, ...]
    on_placeholder: tuple[tuple[int, Sequence], ...]
    rows: tuple[int, ...]
    temperatures: tuple[float, ...]
    seeds: tuple[int | None, ...]
    output_indices: tuple[int, ...]


class ModelRunner:
    """Runs the model on the scheduled chunks and samples where a request reached its end.

    ``execute`` is the single entry point of the forward (tests inject faults by
    replacing it). It reads the scheduler's output *before* ``commit`` (before
    ``advance`` under async scheduling), or the ``ForwardInput`` prepared then: a chunk
    of ``n`` tokens of ``seq`` covers positions ``seq.num_computed ..`` and samples iff
    it reaches ``seq.num_tokens`` plus its placeholders (R10).
    """

    def __init__(self, model: LlamaForCausalLM, cache_engine: CacheEngine) -> None:
        self.model = model
        self.cache_engine = cache_engine

    def prepare(self, out: SchedulerOutput) -> ForwardInput:
        """One span per scheduled chunk (its known tokens, start position and block
        table) and the sampler's inputs, copied so that the forward may run after the
        scheduler moved on (the engine's async step)."""
        spans = []
        on_placeholder = []
        rows = []
        samplers: list[Sequence] = []
        for row, (seq, n) in enumerate(zip(out.scheduled, out.num_scheduled, strict=True)):
            start = seq.num_computed
            known = seq.token_ids[start : start + n]
            if len(known) < n:
                on_placeholder.append((row, seq))
            spans.append(
                Span(token_ids=tuple(known), start_pos=start, block_table=tuple(seq.block_table))
            )
            if seq.samples_at(start + n):  # else a prefill chunk, mid-prompt
                rows.append(row)
                samplers.append(seq)
        return ForwardInput(
            spans=tuple(spans),
            on_placeholder=tuple(on_placeholder),
            rows=tuple(rows),
            temperatures=tuple(seq.temperature for seq in samplers),
            seeds=tuple(seq.seed for seq in samplers),
            # The output index of the token each samples: its outputs so far and those
            # the steps in flight bring.
            output_indices=tuple(
                seq.num_tokens + seq.num_output_placeholders - seq.num_prompt_tokens
                for seq in samplers
            ),
        )

    def build_batch(self, forward: ForwardInput, pending: Mapping[Sequence, int]) -> ForwardBatch:
        """The spans, each chunk on a placeholder completed with its pending token."""
        if not forward.on_placeholder:
            return ForwardBatch(spans=forward.spans)
        spans = list(forward.spans)
        for row, seq in forward.on_placeholder:
            span = spans[row]
            spans[row] = Span(
                token_ids=(*span.token_ids, pending[seq]),
                start_pos=span.start_pos,
                block_table=span.block_table,
            )
        return ForwardBatch(spans=tuple(spans))

    def execute(self, out: SchedulerOutput) -> list[int]:
        """Forward the scheduled chunks; the sampled tokens, in plan order."""
        if not out.scheduled:
            return []
        forward = out.forward_input or self.prepare(out)
        batch = self.build_batch(forward, out.pending)
        with torch.inference_mode():
            logits = self.model.forward(batch, self.cache_engine.gpu_cache)
            if not forward.rows:
                return []
            # One device->host transfer for every sampled row (exact: no rounding).
            index = torch.tensor(forward.rows, dtype=torch.long, device=logits.device)
            picked = logits.index_select(0, index).to("cpu")
            return sample_tokens(
                picked,
                temperatures=forward.temperatures,
                seeds=forward.seeds,
                output_indices=forward.output_indices,
            )
