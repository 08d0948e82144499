"""What ``schedule()`` decided, kept as the journal that ``rollback()`` undoes.

A ``SchedulerOutput`` is built by phases A-C (``impl/phases.py``), read by the engine
(the chunks to run, the blocks to copy), completed by ``commit`` (the plan's columns
only it knows) and turned into the step's ``StepPlan`` by ``impl/plan.py``; if the
forward fails, ``impl/rollback.py`` walks it backwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from impl.sequence import Sequence
from spec.types import PreemptionMode

if TYPE_CHECKING:
    from impl.model_runner import ForwardInput
    from impl.snapshot import Snapshot


#: A synchronous step's ``pending``: no step in flight brings a token (shared, read-only,
#: so a step allocates nothing for it).
_NOTHING_PENDING: Final[Mapping[Sequence, int]] = MappingProxyType({})


class PreemptionRecord:
    """One victim of phase A, with what ``rollback`` needs to put it back."""

    __slots__ = (
        "decoding",
        "dropped_outputs",
        "gpu_blocks",
        "mode",
        "num_computed",
        "num_output_placeholders",
        "num_scheduled_before",
        "num_stale_output_tokens",
        "recomputed_until",
        "running_index",
        "seq",
        "spec_token_ids",
        "undone_chunk",
        "undone_chunk_index",
        "undone_table_before",
    )

    def __init__(
        self,
        seq: Sequence,
        mode: PreemptionMode,
        running_index: int,
        num_scheduled_before: int,
        gpu_blocks: list[int],
    ) -> None:
        self.seq = seq
        self.mode = mode  # the mode used: a swap that did not fit reads RECOMPUTE (R6)
        self.running_index = running_index
        self.num_scheduled_before = num_scheduled_before
        self.gpu_blocks = gpu_blocks  # the GPU blocks it held (freed by the preemption)
        self.num_computed = seq.num_computed
        self.recomputed_until = seq.recomputed_until
        self.num_output_placeholders = seq.num_output_placeholders
        self.num_stale_output_tokens = seq.num_stale_output_tokens
        self.spec_token_ids = seq.spec_token_ids
        self.decoding = seq.decoding
        self.dropped_outputs: list[int] = []
        #: vllm-v1/priority-victim-any-running: the victim's chunk of this step, undone
        #: by the preemption (0: it had none), and where it was among the step's chunks
        self.undone_chunk = 0
        self.undone_chunk_index = 0
        #: speculative decoding: that chunk's ``SchedulerOutput.tables_before`` entry
        self.undone_table_before = 0


class SchedulerOutput:
    """What ``schedule()`` decided, and the journal to undo it.

    ``scheduled[k]`` runs ``num_scheduled[k]`` tokens at positions
    ``scheduled[k].num_computed ..`` (read before ``commit``). Running requests come
    first, then swapped-in, then admitted, which is also their order in ``running``:
    ``scheduled == running[:len(scheduled)]`` after ``schedule()`` (under
    nano-vllm/prefill-first a prefill step's admitted requests, the tail of ``running``:
    see ``first_scheduled``). A chunk samples
    iff it reaches the request's last token; ``num_samples`` of them do.
    ``swap_out``/``swap_in`` are the (src, dst) block pairs to copy GPU->CPU and
    CPU->GPU before the forward (never both in one step: phase B needs a step
    without preemption).
    """

    __slots__ = (
        "first_scheduled",
        "forward_input",
        "num_accepted_tokens",
        "num_admitted",
        "num_batched_tokens",
        "num_cached_tokens_before",
        "num_draft_tokens",
        "num_hit_tokens",
        "num_queried_tokens",
        "num_recomputed_tokens",
        "num_samples",
        "num_scheduled",
        "num_verify_runs",
        "pending",
        "preempted",
        "queued",
        "sampled_ids",
        "sampled_token_ids",
        "scheduled",
        "snapshot",
        "starts",
        "step",
        "swap_in",
        "swap_out",
        "swapped_in",
        "tables_before",
    )

    def __init__(self, step: int, num_cached_tokens: int) -> None:
        self.step = step
        self.scheduled: list[Sequence] = []
        #: ``scheduled`` is ``running[first_scheduled : first_scheduled + len(scheduled)]``
        self.first_scheduled = 0
        self.num_scheduled: list[int] = []
        self.num_samples = 0
        self.num_batched_tokens = 0
        self.preempted: list[PreemptionRecord] = []
        self.swapped_in: list[tuple[Sequence, list[int]]] = []  # (seq, its CPU blocks)
        self.num_admitted = 0
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.num_cached_tokens_before = num_cached_tokens
        self.num_recomputed_tokens = 0  # set by commit
        #: speculative decoding (set by commit_verified): drafts verified (a padded
        #: admission's aside), those delivered as outputs, and the runs that had drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_runs = 0
        # Prefix caching: the admitted requests' tokens looked up, and those hit (PC3).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # The plan's columns that commit() alone knows, filled by it: each chunk's start
        # (its request's computed count before the step) and the sampling requests' ids
        # (left empty when every chunk samples: they are then the scheduled ids).
        self.starts: list[int] = []
        self.sampled_ids: list[str] = []
        self.sampled_token_ids: tuple[int, ...] = ()
        #: the transformers and tokenspeed steps: the state before, which rollback restores
        self.snapshot: Snapshot | None = None
        #: async scheduling: whether the step was scheduled at all (vllm-v1/async-batch-
        #: queue: not while nothing is live and nothing finished since the last step)
        self.queued = True
        #: async scheduling: the token the step in flight brings to each of its
        #: sampling requests, for the chunks scheduled on its placeholder (set by
        #: whoever runs the forward, once that step's forward has run)
        self.pending: Mapping[Sequence, int] = _NOTHING_PENDING
        #: the forward's inputs, prepared while the requests read as scheduled (the
        #: engine's async step runs the forward after they moved on)
        self.forward_input: ForwardInput | None = None
        #: speculative decoding: each phase-A chunk's block-table length before it grew
        #: (the table may hold blocks past ``cdiv(num_computed, block_size)``, which
        #: rollback keeps)
        self.tables_before: list[int] = []

    def clear(self) -> None:
        """Forget the step's decisions (after its state was rolled back)."""
        self.scheduled = []
        self.num_scheduled.clear()
        self.num_samples = 0
        self.num_admitted = 0
        self.preempted.clear()
        self.swapped_in.clear()
        self.swap_out.clear()
        self.swap_in.clear()

    def every_chunk_samples(self) -> bool:
        """Every chunk reaches its request's last token: the scheduled requests all sample."""
        return self.num_samples == len(self.num_scheduled)

    def samples(self) -> list[Sequence]:
        """The requests that sample in this step, in plan order (before ``commit``, or
        under async scheduling before ``advance``): a chunk samples iff it reaches the
        request's tokens plus placeholders."""
        return [
            seq
            for seq, n in zip(self.scheduled, self.num_scheduled, strict=True)
            if seq.samples_at(seq.num_computed + n)
        ]

    def chunk_token_ids(self, seq: Sequence, start: int, n: int) -> list[int]:
        """The input tokens of ``seq``'s chunk at ``start .. start + n - 1``: its known
        tokens, then its drafts (speculative decoding) or (a chunk on a placeholder)
        the token the step in flight brings."""
        tokens = seq.token_ids[start : start + n]
        if len(tokens) < n:
            if seq.spec_token_ids:
                tokens.extend(seq.spec_token_ids[: n - len(tokens)])
            else:
                tokens.append(self.pending[seq])
        return tokens
