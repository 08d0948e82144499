"""What a run produces: one outcome per workload request, metrics, a KV timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the light commands load this module, not the engine's
    from impl.speculative import SpeculativeCounts

REJECTED = "rejected"  # the finish reason of a request the engine refused at add_request

# A request's state at the end of a run (``RequestOutcome.state``): every request of a
# complete run is finished or rejected; a run stopped by a signal also has requests
# under way (partial: their outputs so far) and requests not started.
FINISHED = "finished"
PARTIAL = "partial"
NOT_STARTED = "not_started"
STATES = (FINISHED, REJECTED, PARTIAL, NOT_STARTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutcome:
    """How one workload request ended; ``error`` is set for rejected requests only.

    ``finish_reason`` is ``None`` for a request a stopped run left unfinished; it was
    under way (``started``: admitted, or waiting with outputs kept) or not.
    """

    request_id: str
    output: tuple[int, ...] = ()
    finish_reason: str | None = REJECTED  # "stop" | "length" | "aborted" | "rejected" | None
    num_preemptions: int = 0
    error: str | None = None  # "ErrorType: message"
    line: int | None = None  # the workload file's line (tells apart two uses of one id)
    started: bool = True

    @property
    def state(self) -> str:
        if self.finish_reason == REJECTED:
            return REJECTED
        if self.finish_reason is not None:
            return FINISHED
        return PARTIAL if self.started else NOT_STARTED


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSample:
    """The engine's state after one step (what ``--plot`` draws)."""

    step: int
    gpu_blocks_used: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preempted: int  # victims in this step
    preempted_modes: tuple[str, ...] = ()  # each victim's mode as applied (swap, recompute ...)
    # When requests wait while GPU blocks are free: the blocks the waiting head's next
    # prefill chunk needs (R8: it is admitted only if they are free); None otherwise.
    head_blocks_needed: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheMetrics:
    """Prefix caching's counters (``--enable-prefix-caching`` only): tokens of admitted
    requests looked up, those found cached, and cached blocks reclaimed."""

    queries: int = 0
    hits: int = 0
    reclaimed_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMetrics:
    """The ``metrics`` object of the ``--json`` document (plus a few extras)."""

    steps: int
    preemptions: int
    swap_out_blocks: int
    swap_in_blocks: int
    recomputed_tokens: int
    peak_gpu_blocks_used: int
    num_gpu_blocks: int
    kv_utilization: float
    tokens_per_s: float
    preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    tokens_sampled: int = 0  # every sampled token, including ones a restart discarded
    prefix_cache: PrefixCacheMetrics | None = None  # None: prefix caching off
    speculative: SpeculativeCounts | None = None  # None: no speculative decoding


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    outcomes: tuple[RequestOutcome, ...]
    metrics: RunMetrics
    timeline: tuple[StepSample, ...] = ()
    interrupted: str | None = None  # the signal that stopped the run ("SIGINT"), if one did
