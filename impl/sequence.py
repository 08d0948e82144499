"""The mutable per-request record the engine schedules (vLLM's ``Sequence``).

One ``Sequence`` lives from ``add_request`` until the request finishes or is aborted.
The scheduler mutates it in place; ``to_state`` projects it onto the spec's immutable
``RequestState`` for ``observe()``. Fields are plain slots so the scheduler's per-step
loop touches each request with a handful of attribute loads and stores.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from spec.types import FinishedRequest, FinishReason, Request, RequestState

if TYPE_CHECKING:
    from impl.prefix_cache import Node


class SequenceStatus(enum.Enum):
    """Which queue the request is in (R1), or that it has left the engine (R3)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """A live request and its progress.

    ``token_ids`` holds the prompt followed by the outputs so far, so a chunk's input
    is a slice of it and ``num_tokens == len(token_ids)`` (kept as a field: it is read
    on every step). ``block_table`` lists the GPU blocks it owns while running
    (``cdiv(num_computed, block_size)`` of them between steps, R2), ``cpu_block_table``
    the CPU blocks while swapped.
    """

    __slots__ = (
        "arrival",
        "block_hashes",
        "block_nodes",
        "block_table",
        "cpu_block_table",
        "decoding",
        "eos_token_id",
        "num_computed",
        "num_in_flight_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_stale_output_tokens",
        "num_tokens",
        "priority",
        "queue_key",
        "recomputed_until",
        "request",
        "request_id",
        "seed",
        "spec_token_ids",
        "status",
        "stop_len",
        "temperature",
        "token_ids",
    )

    def __init__(self, request: Request) -> None:
        params = request.params
        self.request = request
        self.request_id = request.request_id
        self.arrival = request.arrival
        self.priority = params.priority
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_tokens = self.num_prompt_tokens
        # R10: the request finishes once it holds this many tokens (prompt + max_tokens).
        self.stop_len = self.num_prompt_tokens + params.max_tokens
        # -1 never matches a token id, so "ignore EOS" and "no EOS" cost one comparison.
        eos = params.eos_token_id
        self.eos_token_id = -1 if (eos is None or params.ignore_eos) else eos
        self.temperature = params.temperature
        self.seed = params.seed
        self.num_computed = 0
        self.num_preemptions = 0
        # Async scheduling (vllm-v1/async-*, impl/pipeline.py): tokens the steps in
        # flight will sample (counted in ``num_computed`` already, not in ``token_ids``),
        # the tokens of its chunks in flight, and of those the ones a preemption made
        # stale. All 0 between synchronous steps.
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        # Positions below this were computed once and then dropped by a preemption:
        # prefilling them again is recomputation (EngineMetrics.recomputed_tokens).
        self.recomputed_until = 0
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []
        # Prefix caching: the chained hashes (and key chains) of its full blocks, memoized.
        self.block_hashes: list[int] = []
        self.block_nodes: list[Node] = []
        self.status = SequenceStatus.WAITING
        # transformers, tokenspeed: its (re)prefill is scheduled to the end (DECODING);
        # speculative decoding: it sampled since it was last admitted (vllm-v1/spec-
        # padded-new-decode reads it).
        self.decoding = False
        # Speculative decoding (impl/speculative.py): the drafts its next chunk verifies,
        # proposed after its last step (a padded admission's are PAD_TOKEN_ID).
        self.spec_token_ids: list[int] = []
        # Stored position in the waiting queue for policies that keep a heap.
        self.queue_key = 0

    def samples_at(self, end: int) -> bool:
        """Whether a chunk ending at position ``end`` samples (R10): it reaches the
        request's tokens, plus its placeholders under async scheduling (the tokens the
        steps in flight will bring); with drafts it runs past them."""
        return end >= self.num_tokens + self.num_output_placeholders

    def stops(self, token: int) -> bool:
        """R10, with ``token`` just appended: it is the request's EOS, or the request
        holds ``stop_len`` tokens (``max_tokens`` outputs, or ``max_model_len``)."""
        return token == self.eos_token_id or self.num_tokens == self.stop_len

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens :])

    def to_state(self) -> RequestState:
        """The spec's view of this request (used by ``observe()``)."""
        return RequestState(
            request=self.request,
            output_token_ids=self.output_token_ids,
            num_computed_tokens=self.num_computed,
            num_preemptions=self.num_preemptions,
            decoding=self.decoding,
            num_output_placeholders=self.num_output_placeholders,
            num_in_flight_tokens=self.num_in_flight_tokens,
            num_stale_output_tokens=self.num_stale_output_tokens,
            spec_token_ids=tuple(self.spec_token_ids),
        )

    def to_finished(self, reason: FinishReason) -> FinishedRequest:
        return FinishedRequest(
            request_id=self.request_id,
            output_token_ids=self.output_token_ids,
            finish_reason=reason,
            num_preemptions=self.num_preemptions,
        )

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={len(self.block_table)}, "
            f"cpu_blocks={len(self.cpu_block_table)}, preemptions={self.num_preemptions})"
        )
