"""The unit of work of one forward pass: token spans of several requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """One request's new tokens in this forward.

    `token_ids` sit at positions start_pos .. start_pos + len(token_ids) - 1 of the request;
    positions below start_pos are already in the KV cache at the slots given by
    `block_table` (slot of position p = block_table[p // block_size] * block_size
    + p % block_size). A decode step is a span of one token; a prefill chunk is longer.
    """

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    #: How many of its last positions the forward returns logits for: one (the next
    #: token), or a speculative verify's ``1 + drafts`` (each draft is checked against
    #: the logits of the position before it).
    num_logits: int = 1

    @property
    def end_pos(self) -> int:
        """One past the last position this span writes, i.e. the request's length after it."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Spans of distinct requests, decode and prefill mixed in any order."""

    spans: tuple[Span, ...]

    @property
    def num_tokens(self) -> int:
        """Total number of new tokens across all spans."""
        return sum(len(span.token_ids) for span in self.spans)
