"""Turns a step's schedule into one forward pass and the tokens it samples."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from impl.cache_engine import CacheEngine
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence
from impl.speculative import PAD_TOKEN_ID, drafts_run
from model import ForwardBatch, LlamaForCausalLM, Span
from model.rejection_sampler import verify_drafts
from model.sampling import sample_tokens


@dataclass(frozen=True, slots=True)
class ForwardInput:
    """A step's forward, read off the requests as scheduled (``ModelRunner.prepare``).

    ``spans`` hold each chunk's known tokens; ``on_placeholder`` the chunks scheduled on
    a placeholder (async scheduling): their last token is the one the step in flight
    brings (``SchedulerOutput.pending``), put in when the forward runs. ``rows`` are the
    chunks that sample, with their requests' sampler inputs, and the drafts each runs
    (speculative decoding; its span then asks for ``1 + len(drafts)`` logits rows).
    """

    spans: tuple[Span, ...]
    on_placeholder: tuple[tuple[int, Sequence], ...]
    rows: tuple[int, ...]
    temperatures: tuple[float, ...]
    seeds: tuple[int | None, ...]
    output_indices: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...] = ()


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
        drafts: list[tuple[int, ...]] = []
        for row, (seq, n) in enumerate(zip(out.scheduled, out.num_scheduled, strict=True)):
            start = seq.num_computed
            known = seq.token_ids[start : start + n]
            run = drafts_run(seq, start, n) if seq.spec_token_ids else []
            if run:  # a pad's input is token 0: its K/V is never read, it is never accepted
                known.extend(0 if d == PAD_TOKEN_ID else d for d in run)
            elif len(known) < n:
                on_placeholder.append((row, seq))
            spans.append(
                Span(
                    token_ids=tuple(known),
                    start_pos=start,
                    block_table=tuple(seq.block_table),
                    num_logits=1 + len(run) if run else 1,
                )
            )
            if seq.samples_at(start + n):  # else a prefill chunk, mid-prompt
                rows.append(row)
                samplers.append(seq)
                drafts.append(tuple(run))
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
            drafts=tuple(drafts) if any(drafts) else (),
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
                num_logits=span.num_logits,
            )
        return ForwardBatch(spans=tuple(spans))

    def execute(self, out: SchedulerOutput) -> list[int]:
        """Forward the scheduled chunks; the sampled tokens, in plan order (a step
        without drafts: under speculative decoding the engine calls ``verify``)."""
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

    def verify(self, out: SchedulerOutput) -> list[list[int]]:
        """Forward the scheduled chunks with their drafts; each sampling request's run
        (``model.rejection_sampler.verify_drafts``: its accepted drafts, then one token
        of the model's), in plan order. One forward for the whole batch."""
        if not out.scheduled:
            return []
        forward = out.forward_input or self.prepare(out)
        with torch.inference_mode():
            logits = self.model.forward(
                self.build_batch(forward, out.pending), self.cache_engine.gpu_cache
            )
            if not forward.rows:
                return []
            # The logits rows of each span, span after span; one transfer for all.
            first = [0]
            for span in forward.spans:
                first.append(first[-1] + span.num_logits)
            picked = [
                torch.arange(first[row], first[row + 1], device=logits.device)
                for row in forward.rows
            ]
            rows = logits.index_select(0, torch.cat(picked)).to("cpu")
        drafts = forward.drafts or ((),) * len(forward.rows)
        runs = []
        at = 0
        for j, row_drafts in enumerate(drafts):
            width = len(row_drafts) + 1
            runs.append(
                verify_drafts(
                    rows[at : at + width],
                    row_drafts,
                    temperature=forward.temperatures[j],
                    seed=forward.seeds[j],
                    output_index=forward.output_indices[j],
                )
            )
            at += width
        return runs
