"""TokenSpeed's scheduler (``tokenspeed-scheduler`` 0.1.42, MIT) through the protocol.

TokenSpeed's C++ scheduler is built to be driven: ``submit_requests``,
``next_execution_plan`` and ``advance`` with the events of what ran. The adapter is
the engine loop TokenSpeed's own closed-loop tests run (``_run_closed_loop`` in
lightseekorg/tokenspeed ``tokenspeed-scheduler/tests/python``), with no overlap: every
plan's forward rows are answered in the ``advance`` that follows it, each row with an
``ExtendResult`` (the oracle's token where the row completes a prefill or decodes, no
token for an intermediate prefill chunk), a ``Finish`` where the request stops (EOS
unless ignored, or ``max_tokens`` outputs: stopping is the engine loop's, TokenSpeed
only reserves for ``max_new_tokens``), an ``UpdateReserveNumTokens`` of one token for a
decode row that goes on, and the done event of every cache operation of the plan.

Mapping (docs/peers.md, "TokenSpeed"):

- one full-attention cache group of ``num_gpu_blocks + 1`` pages of ``block_size``
  tokens (TokenSpeed keeps page 0 as its null page); ``prefix_granularity`` is the block
  size; prefix caching off (``disable_prefix_cache``); ``max_scheduled_tokens`` is
  ``max_num_batched_tokens``, ``max_batch_size`` ``max_num_seqs``; no snapshot pool
  (``num_snapshot_pages`` 1: TokenSpeed never retracts); the Fused role, prefill and
  decode in separate plans (``enable_mixed_prefill_decode`` off: its default);
- ``host_pages`` (an adapter option, default 0) gives TokenSpeed an L2 host cache, to
  which it writes completed pages back: only write-back operations to acknowledge,
  nothing the spec sees;
- block ids are not compared: each request's block count is what the plan's block table
  gives it (its non-null pages, fixed from admission), the free count
  ``available_lcm_blocks``; the queues are the adapter's record of the plans, checked
  against TokenSpeed's own counts (``waiting_size``, ``prefilling_size``,
  ``decoding_size``) after every step;
- TokenSpeed counts no preemptions (``Hidden.NUM_PREEMPTIONS``; it has none here).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsched.peers.protocol import (
    Hidden,
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    make_plan,
)
from spec.oracle import TokenOracle
from spec.profiles import held_after_finish, tracks_decoding
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    PreemptionMode,
    Request,
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
)

NAME = "tokenspeed"
VERSION = "0.1.42"
_GROUP = "full"

_ts: dict[str, Any] = {}


def _import() -> Any:
    if not _ts:
        try:
            _ts["module"] = importlib.import_module("tokenspeed_scheduler")
        except ImportError as e:
            raise PeerNotInstalledError(NAME, str(e)) from None
    return _ts["module"]


def check_config(config: SchedulerConfig) -> None:
    """Refuse, with a typed error, what the adapter does not drive TokenSpeed with."""
    if config.preemption_mode is not PreemptionMode.RECOMPUTE or config.num_cpu_blocks:
        raise PeerUnsupportedError(
            "tokenspeed: retraction (its preemption) is not driven; recompute, no CPU pool"
        )
    if config.policy != "lifo":
        raise PeerUnsupportedError(f"tokenspeed: no policy {config.policy!r} (submission order)")
    if not config.enable_chunked_prefill:
        raise PeerUnsupportedError("tokenspeed: prefills are chunked by max_scheduled_tokens")
    if config.enable_prefix_caching:
        raise PeerUnsupportedError("tokenspeed: its prefix cache is not driven here")


@dataclass
class _Live:
    """What the adapter knows of a live request from the plans."""

    request: Request
    tokens: list[int]
    admitted: bool = False
    computed: int = 0
    sampled: bool = False  # its prefill completed: PrefillDone or Decoding
    decoded: bool = False  # it had a decode row: Decoding
    pages: int = 0
    outputs: list[int] = field(default_factory=list)


class TokenSpeedAdapter:
    name = NAME
    semantics = "tokenspeed"

    def __init__(self, config: SchedulerConfig, *, host_pages: int = 0) -> None:
        check_config(config)
        self.config = config
        self.ts = _import()
        ts = self.ts
        c = ts.SchedulerConfig()
        pages = config.num_gpu_blocks + 1  # + TokenSpeed's null page
        c.num_device_pages = pages
        c.prefix_granularity = config.block_size
        c.max_scheduled_tokens = config.max_num_batched_tokens
        c.max_batch_size = config.max_num_seqs
        c.disable_prefix_cache = True
        c.num_snapshot_pages = 1
        c.max_retracted_requests = 0
        c.num_host_pages = host_pages
        c.cache_groups = [ts.CacheGroupConfig(_GROUP, config.block_size, pages, ts.AttnKind.Full)]
        try:
            self.scheduler = ts.Scheduler(c)
        except ValueError as e:
            raise PeerUnsupportedError(f"tokenspeed: {e}") from None
        self.live: dict[str, _Live] = {}  # submission order
        self.finished_last: tuple[str, ...] = ()  # the last step's finished ids
        self.aborted_since: list[str] = []  # the ids aborted since the last plan
        self.next_arrival = 0
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if params.max_tokens < 1:  # TokenSpeed accepts 0 new tokens; the spec's R4 not
            raise InvalidMaxTokensError("tokenspeed: max_tokens below 1")
        if params.priority != 0:
            raise PeerUnsupportedError("tokenspeed has no request priorities")
        spec = self.ts.RequestSpec()
        spec.request_id = request_id
        spec.tokens = list(prompt_token_ids)
        spec.max_new_tokens = params.max_tokens
        try:
            self.scheduler.submit_requests([spec])
        except ValueError as e:  # SubmitRequests' checks, scheduler.cpp, in its order
            text = str(e)
            if "non-empty" in text:
                raise EmptyPromptError(f"tokenspeed: {text}") from None
            if "duplicate" in text:
                raise DuplicateRequestError(f"tokenspeed: {text}") from None
            if "exceeds cache capacity" in text:
                raise RequestTooLargeError(f"tokenspeed: {text}") from None
            raise PeerFailure(f"tokenspeed: submit_requests: {text}") from e
        self.live[request_id] = _Live(
            Request(
                request_id=request_id,
                prompt_token_ids=tuple(prompt_token_ids),
                params=params,
                arrival=self.next_arrival,
            ),
            list(prompt_token_ids),
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        if request_id not in self.live:
            raise UnknownRequestError(f"tokenspeed: no live request {request_id!r}")
        event = self.ts.ForwardEvent.Abort()
        event.request_id = request_id
        self.scheduler.advance(self.ts.ExecutionEvent().add_event(event))
        del self.live[request_id]
        self.aborted_since.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    # --- a step ---------------------------------------------------------------------

    def step(self, next_token: TokenOracle) -> StepPlan:
        try:
            return self._step(next_token)
        except Exception as e:  # the peer failed: lockstep reports it as a divergence
            raise PeerFailure(f"tokenspeed: {type(e).__name__}: {e}") from e

    def _step(self, next_token: TokenOracle) -> StepPlan:
        ts = self.ts
        plan = self.scheduler.next_execution_plan()
        if plan.aborts:
            detail = "; ".join(f"{a.request_id}: {a.reason} {a.detail}" for a in plan.aborts)
            raise PeerFailure(f"tokenspeed aborted requests: {detail}")
        events = ts.ExecutionEvent()
        scheduled: list[tuple[str, int, int]] = []
        sampled: list[tuple[str, int]] = []
        finished: list[FinishedRequest] = []
        for batch in plan.forward:
            num_extends = batch.num_extends()
            tables = dict(batch.block_tables).get(_GROUP, [])
            for row, rid in enumerate(batch.request_ids):
                live = self.live[rid]
                live.admitted = True
                live.pages = sum(1 for page in tables[row] if page > 0)
                result = ts.ForwardEvent.ExtendResult()
                result.request_id = rid
                result.tokens = []
                if row < num_extends:
                    start, n = batch.extend_prefix_lens[row], batch.input_lengths[row]
                    completes = start + n == batch.prefill_lengths[row]
                else:
                    start, n, completes = len(live.tokens) - 1, 1, True
                    live.decoded = True
                scheduled.append((rid, start, n))
                live.computed = start + n
                if completes:
                    token = next_token(tuple(live.tokens))
                    result.tokens = [token]
                    live.tokens.append(token)
                    live.outputs.append(token)
                    live.sampled = True
                    sampled.append((rid, token))
                events.add_event(result)
                if completes:
                    reason = self._finish_reason(live)
                    if reason is not None:
                        done = ts.ForwardEvent.Finish()
                        done.request_id = rid
                        events.add_event(done)
                        finished.append(
                            FinishedRequest(
                                request_id=rid,
                                output_token_ids=tuple(live.outputs),
                                finish_reason=reason,
                                num_preemptions=0,
                            )
                        )
                    elif row >= num_extends:  # the row that completes a prompt carries it
                        reserve = ts.ForwardEvent.UpdateReserveNumTokens()
                        reserve.request_id = rid
                        reserve.reserve_num_tokens_in_next_schedule_event = 1
                        events.add_event(reserve)
        for operation in plan.cache:  # every cache operation is acknowledged
            done_type = getattr(ts.Cache, type(operation).__name__.replace("Op", "DoneEvent"))
            for op_id in operation.op_ids:
                done_event = done_type()
                done_event.op_id = op_id
                events.add_event(done_event)
        self.scheduler.advance(events)
        for f in finished:
            del self.live[f.request_id]
        self.finished_last = tuple(f.request_id for f in finished)
        self.aborted_since = []
        self._check_counts()
        step = self.num_steps
        self.num_steps += 1
        return make_plan(step, scheduled=scheduled, sampled=sampled, finished=finished)

    @staticmethod
    def _finish_reason(live: _Live) -> FinishReason | None:
        params = live.request.params
        if not params.ignore_eos and live.outputs[-1] == params.eos_token_id:
            return FinishReason.STOP
        if len(live.outputs) >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _check_counts(self) -> None:
        """The queues the plans imply, against TokenSpeed's own counts."""
        s = self.scheduler
        mine = (
            sum(not r.admitted for r in self.live.values()),
            sum(r.admitted and not r.decoded for r in self.live.values()),
            sum(r.decoded for r in self.live.values()),
        )
        theirs = (s.waiting_size(), s.prefilling_size(), s.decoding_size())
        if mine != theirs:
            raise PeerFailure(
                f"tokenspeed: (waiting, prefilling, decoding) counts {theirs}, the plans "
                f"imply {mine}"
            )

    # --- the spec's view ------------------------------------------------------------

    def _state_of(self, live: _Live) -> RequestState:
        return RequestState(
            request=live.request,
            output_token_ids=tuple(live.outputs),
            num_computed_tokens=live.computed,
            decoding=live.sampled and tracks_decoding(self.config),
        )

    def observe(self) -> Observation:
        state = SchedulerState(
            config=self.config,
            num_free_gpu_blocks=int(self.scheduler.available_lcm_blocks()),
            num_free_cpu_blocks=0,
            waiting=tuple(self._state_of(r) for r in self.live.values() if not r.admitted),
            running=tuple(self._state_of(r) for r in self.live.values() if r.admitted),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
            # The finished and aborted ids TokenSpeed still knows (it erases them at the
            # next plan).
            ids_held=held_after_finish(
                self.config,
                tuple(
                    r
                    for r in (*self.finished_last, *self.aborted_since)
                    if self.scheduler.request_token_size(r) >= 0
                ),
            ),
        )
        return Observation(
            state=state,
            blocks={rid: r.pages for rid, r in self.live.items()},
            hidden=frozenset({Hidden.NUM_PREEMPTIONS}),
        )
