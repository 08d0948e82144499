"""Lockstep: the spec and a scheduler under test, the same workload, compared every step.

This is the one lockstep comparison of the project: ``kvsched conform`` (our engine or
a peer) and the peer tests drive it. Per step:

1. the scheduler under test steps (deciding, and sampling with the driver's oracle or
   its own model);
2. the spec's ``schedule`` decides on its own; its decisions (chunks, victims,
   swap-ins) are compared with the scheduler's;
3. the scheduler's sampled tokens feed the spec's ``complete_step``, so both apply the
   same outputs, and the whole plans are compared;
4. the states are compared (queues in order, computed tokens, outputs, free blocks),
   and every live request's block count with the spec's R2 count.

``add_request`` is compared too: both accept, or both refuse with the same typed
error; a token outside the vocabulary is the engine's check alone (R4.3), so a
request refused for it is not given to the spec, unless the driver knows the engine's
vocabulary (``vocab_size``): then the spec side makes R4.3's check too, and every
refusal is compared. An abort is given to both: both refuse an id the spec does not
know, and an engine that returns the aborted request has it compared with the spec's.

Hooks for a driver with checks of its own (the stateful suite, tests/stateful/):
``spec_samples`` has the spec sample with the oracle on its own view of each request
instead of taking the engine's tokens (for an engine that samples with the same oracle
through its own KV, so a token it got wrong diverges), and ``advance`` returns the
step's intermediate values (the spec's state before it and after its decisions). An
exception the engine raises in ``step`` that is not a ``PeerFailure`` (a fault a
driver injected) propagates with the spec not advanced: an engine that rolls its step
back is still in lockstep, and ``compare_states`` says whether it did.

The first difference stops the run: a ``Divergence`` with the step, the field's path
(``plan.preempted[0].request_id``), both values and both states. Fields the scheduler
declares hidden are masked on both sides. The spec runs under the config's
``semantics`` profile (docs/semantics.md, "Semantics profiles"); under ``vllm-v1`` the
waiting queues are compared in service order (the policy's ``order_waiting``): vLLM
keeps its priority queue as a heap and lists it in that order, the spec keeps the order
requests entered, and no decision reads the difference (V4 in docs/peers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import spec
from kvsched.diff import first_difference, short_repr
from kvsched.drive import Arrivals, StepCallback, Window, step_bound
from kvsched.errors import DrainError
from kvsched.peers.protocol import (
    Hidden,
    Observation,
    PeerFailure,
    SchedulerUnderTest,
    decisions,
    sampled_tokens,
)
from kvsched.workload import WorkloadRequest
from spec.oracle import Drafter, TokenOracle
from spec.profiles import speculative
from spec.scheduler import oracle_tokens
from spec.speculative import PAD, drafts_scheduled, num_accepted
from spec.types import (
    FinishedRequest,
    InvalidRequestError,
    InvalidSamplingParamsError,
    RequestState,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    field: str
    spec_value: object
    engine_value: object
    spec_state: SchedulerState | None = None
    engine_state: Observation | None = None
    #: The spec's state the diverging step started from (None outside a step).
    spec_before: SchedulerState | None = None

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.field}: spec {short_repr(self.spec_value)}, "
            f"engine {short_repr(self.engine_value)}"
        )


class Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


def _mask_request(r: RequestState, hidden: frozenset[Hidden]) -> RequestState:
    if Hidden.NUM_PREEMPTIONS in hidden:
        r = replace(r, num_preemptions=0)
    if Hidden.PREFIX_POOL in hidden:
        r = replace(r, block_ids=())
    return r


def _mask_finished(f: FinishedRequest, hidden: frozenset[Hidden]) -> FinishedRequest:
    return replace(f, num_preemptions=0) if Hidden.NUM_PREEMPTIONS in hidden else f


def mask_state(state: SchedulerState, hidden: frozenset[Hidden]) -> SchedulerState:
    if not hidden:
        return state
    return replace(
        state,
        waiting=tuple(_mask_request(r, hidden) for r in state.waiting),
        running=tuple(_mask_request(r, hidden) for r in state.running),
        swapped=tuple(_mask_request(r, hidden) for r in state.swapped),
        prefix_cache=None if Hidden.PREFIX_POOL in hidden else state.prefix_cache,
    )


def mask_plan(plan: StepPlan, hidden: frozenset[Hidden]) -> StepPlan:
    if not hidden:
        return plan
    return replace(plan, finished=tuple(_mask_finished(f, hidden) for f in plan.finished))


def in_service_order(state: SchedulerState) -> SchedulerState:
    """Under ``vllm-v1``, ``waiting`` in the order the policy serves it; else as stored."""
    if state.config.semantics is not Semantics.VLLM_V1:
        return state
    return replace(state, waiting=spec.get_policy(state.config.policy).order_waiting(state.waiting))


def _refusal(e: Exception | None) -> str:
    return "accepted" if e is None else f"{type(e).__name__}: {e}"


def check_vocab(
    request_id: str, prompt: Sequence[int], params: SamplingParams, vocab_size: int
) -> None:
    """R4.3 on the spec side: ``TokenOutOfVocabError`` in R4's order (after the empty
    prompt and ``max_tokens`` checks, before the spec's own)."""
    if prompt and params.max_tokens >= 1 and any(not 0 <= t < vocab_size for t in prompt):
        raise TokenOutOfVocabError(f"request {request_id!r}: a token is outside the vocab")


@dataclass(frozen=True, slots=True)
class Advance:
    """One step both sides took and agreed on: the spec's state ``before`` it and after
    its decisions (``mid``, from ``spec.schedule``), those decisions (``decided``), the
    spec's whole ``plan`` and the engine's (``engine_plan``: equal but for hidden
    fields). The spec's state after it is ``Lockstep.state``."""

    before: SchedulerState
    mid: SchedulerState
    decided: StepPlan
    plan: StepPlan
    engine_plan: StepPlan


class Lockstep:
    """The spec and ``peer`` side by side; every operation compares and may raise ``Diverged``."""

    def __init__(
        self,
        peer: SchedulerUnderTest,
        config: SchedulerConfig,
        next_token: TokenOracle,
        *,
        spec_samples: bool = False,
        vocab_size: int | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.peer = peer
        self.next_token = next_token
        self.drafter = drafter
        self.spec_samples = spec_samples
        self.vocab_size = vocab_size
        self.state: SchedulerState = spec.init_state(config)
        self.steps = 0
        self.rejected = 0
        self.preemptions = 0
        #: vllm-v1/spec-*: the drafts the steps ran (pads aside) and those accepted.
        self.drafts = 0
        self.accepted = 0
        self.spec_finished: list[FinishedRequest] = []
        self.engine_finished: list[FinishedRequest] = []
        self.hidden: frozenset[Hidden] = frozenset()
        #: The engine's state as ``compare_states`` last found it equal to the spec's, while
        #: no operation has changed it since (``None`` otherwise): a driver that needs the
        #: engine's state reads it here rather than observing again.
        self.last_observed: Observation | None = None
        #: The spec's state before the step ``advance`` is taking (None between steps).
        self.step_started_from: SchedulerState | None = None
        self.compare_states()

    # --- comparison ---------------------------------------------------------------------

    def _diverge(self, field: str, spec_value: object, engine_value: object) -> Diverged:
        observed: Observation | None
        try:
            observed = self.peer.observe()
        except PeerFailure:
            observed = None
        return Diverged(
            Divergence(
                self.steps,
                field,
                spec_value,
                engine_value,
                self.state,
                observed,
                self.step_started_from,
            )
        )

    def _compare(self, spec_value: object, engine_value: object, path: str) -> None:
        if spec_value == engine_value:  # the common case, without walking every field
            return
        d = first_difference(spec_value, engine_value, path)
        if d is not None:
            raise self._diverge(d.path, d.left, d.right)

    def compare_states(self) -> None:
        self.last_observed = None
        observed = self.peer.observe()
        self.hidden = observed.hidden
        self._compare(
            in_service_order(mask_state(self.state, self.hidden)),
            in_service_order(mask_state(observed.state, self.hidden)),
            "state",
        )
        spec_blocks = {
            rid: spec.blocks_owned(self.state, rid)[0] for rid in spec.live_request_ids(self.state)
        }
        self._compare(spec_blocks, dict(observed.blocks), "blocks")
        self.last_observed = observed

    def _guard(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except PeerFailure as e:
            raise self._diverge(what, "(returns)", f"raised {e}") from None

    # --- operations -------------------------------------------------------------------

    def add(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams
    ) -> InvalidRequestError | None:
        """Add on both sides; the refusal both made (``None``: both accepted)."""
        self.last_observed = None
        engine_error: InvalidRequestError | None = None
        try:
            self._guard(
                f"add_request({request_id!r})",
                lambda: self.peer.add_request(request_id, list(prompt), params),
            )
        except InvalidRequestError as e:
            engine_error = e
        # R4's engine-only checks: the spec neither knows the vocabulary nor samples.
        engine_only = TokenOutOfVocabError | InvalidSamplingParamsError
        if self.vocab_size is None and isinstance(engine_error, engine_only):
            self.rejected += 1
            return engine_error
        spec_error: InvalidRequestError | None = None
        try:
            if self.vocab_size is not None:
                check_vocab(request_id, prompt, params, self.vocab_size)
            self.state = spec.add_request(self.state, request_id, tuple(prompt), params)
        except InvalidRequestError as e:
            spec_error = e
        if type(spec_error) is not type(engine_error):
            raise self._diverge(
                f"add_request({request_id!r})", _refusal(spec_error), _refusal(engine_error)
            )
        if engine_error is not None:
            self.rejected += 1
        return engine_error

    def abort(self, request_id: str) -> FinishedRequest:
        """Abort on both sides: the spec's account of the aborted request.

        An id the spec does not know (never added, finished, aborted) must be refused by
        both (``UnknownRequestError`` is re-raised then).
        """
        self.last_observed = None
        what = f"abort_request({request_id!r})"
        spec_finished: FinishedRequest | None = None
        spec_error: UnknownRequestError | None = None
        try:
            self.state, spec_finished = spec.abort_request(self.state, request_id)
        except UnknownRequestError as e:
            spec_error = e
        engine_error: UnknownRequestError | None = None
        engine_finished: FinishedRequest | None = None
        try:
            engine_finished = self._guard(what, lambda: self.peer.abort_request(request_id))
        except UnknownRequestError as e:
            engine_error = e
        if (spec_error is None) is not (engine_error is None):
            raise self._diverge(what, _refusal(spec_error), _refusal(engine_error))
        if spec_error is not None:
            raise spec_error
        assert spec_finished is not None
        if engine_finished is not None:
            self._compare(
                _mask_finished(spec_finished, self.hidden),
                _mask_finished(engine_finished, self.hidden),
                what,
            )
        return spec_finished

    def unfinished(self) -> bool:
        return self.peer.has_unfinished_requests() or spec.has_unfinished_requests(self.state)

    def step(self) -> StepPlan:
        """One step on both sides, compared; the spec's plan."""
        return self.advance().plan

    def advance(self) -> Advance:
        """``step``, with what a driver's own checks read (``Advance``)."""
        self.last_observed = None
        before = self.step_started_from = self.state
        engine_plan = self._guard("step()", lambda: self.peer.step(self.next_token))
        # The decisions first, before any token is involved.
        state_mid, decided = spec.schedule(before)
        self._compare(decided, decisions(engine_plan), "plan")
        try:
            new_state, spec_plan = self._complete(state_mid, decided, engine_plan)
        except SampledTokensError as e:
            raise self._diverge("plan.sampled", f"refused: {e}", engine_plan.sampled) from None
        if self.drafter is not None:  # vllm-v1/spec-propose, as the engine's drafter did
            new_state = spec.update_draft_token_ids(new_state, spec_plan, self.drafter)
        self.state = new_state
        self._compare(
            mask_plan(spec_plan, self.hidden), mask_plan(engine_plan, self.hidden), "plan"
        )
        self.compare_states()
        self.step_started_from = None
        self.steps += 1
        self.preemptions += len(spec_plan.preempted)
        if speculative(state_mid.config):
            self._count_drafts(state_mid, spec_plan)
        self.spec_finished.extend(spec_plan.finished)
        self.engine_finished.extend(engine_plan.finished)
        return Advance(before, state_mid, decided, spec_plan, engine_plan)

    def _complete(
        self, state_mid: SchedulerState, decided: StepPlan, engine_plan: StepPlan
    ) -> tuple[SchedulerState, StepPlan]:
        """The spec's phase D with the engine's tokens, or the oracle's (``spec_samples``);
        under speculative decoding each request's run of verified tokens."""
        if speculative(state_mid.config):
            if self.spec_samples:
                runs = spec.oracle_runs(state_mid, decided, self.next_token)
            else:
                runs = spec.plan_runs(engine_plan)
            return spec.complete_verified_step(state_mid, decided, runs)
        if self.spec_samples:
            tokens = oracle_tokens(state_mid, decided, self.next_token)
        else:
            tokens = sampled_tokens(engine_plan)
        return spec.complete_step(state_mid, decided, tokens)

    def _count_drafts(self, state_mid: SchedulerState, plan: StepPlan) -> None:
        runs = spec.plan_runs(plan)
        by_id = {r.request_id: r for r in state_mid.running}
        for chunk in plan.scheduled:
            drafts = drafts_scheduled(by_id[chunk.request_id], chunk.start, chunk.num_tokens)
            if drafts and PAD not in drafts and chunk.request_id in runs:
                self.drafts += len(drafts)
                self.accepted += num_accepted(drafts, runs[chunk.request_id])

    def finish(self) -> None:
        """Compare every finished request's outputs, in finishing order."""
        self._compare(
            [_mask_finished(f, self.hidden) for f in self.spec_finished],
            [_mask_finished(f, self.hidden) for f in self.engine_finished],
            "finished",
        )


@dataclass(frozen=True, slots=True)
class LockstepReport:
    steps: int
    num_requests: int
    num_rejected: int
    preemptions: int
    divergence: Divergence | None
    #: vllm-v1/spec-*: drafts run and accepted (``Lockstep.drafts``, ``.accepted``).
    drafts: int = 0
    accepted: int = 0

    @property
    def ok(self) -> bool:
        return self.divergence is None


def _spec_room(lock: Lockstep, window: Window) -> Callable[[], int]:
    """The waiting requests the next step can read beyond those both sides hold."""

    def room() -> int:
        state = lock.state
        return window(len(state.running), state.num_free_gpu_blocks) - len(state.waiting)

    return room


def run_workload(
    peer: SchedulerUnderTest,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    next_token: TokenOracle,
    *,
    max_steps: int | None = None,
    on_step: StepCallback | None = None,
    window: Window | None = None,
    drafter: Drafter | None = None,
) -> LockstepReport:
    """Add each request at its ``arrival_step``; step until both drain; stop at a divergence.

    ``window``: arrivals admitted lazily (``kvsched.drive.Arrivals``, the window of
    ``admission_window`` read from the spec's state), so that a step's cost does not
    grow with the waiting queue. ``drafter``: the drafts the spec proposes under
    speculative decoding (the engine's own drafter, a pure function).
    Raises ``DrainError`` if they agree but do not drain within the bound.
    """
    bound = step_bound(workload) if max_steps is None else max_steps
    divergence: Divergence | None = None
    lock: Lockstep | None = None
    try:
        lock = Lockstep(peer, config, next_token, drafter=drafter)
        arrivals = Arrivals(workload, room=None if window is None else _spec_room(lock, window))
        while True:
            added = False
            for i in arrivals.due(lock.steps):
                r = workload[i]
                if lock.add(r.request_id, r.prompt, r.params) is None:
                    arrivals.accepted(i)
                added = True
            if added:
                lock.compare_states()
            if arrivals.exhausted and not lock.unfinished():
                break
            if lock.steps >= bound:
                raise DrainError(f"the workload did not drain within {bound} steps")
            for f in lock.step().finished:
                arrivals.finished(f.request_id)
            if on_step is not None:
                on_step(lock.steps, len(lock.engine_finished) + lock.rejected)
        lock.finish()
    except Diverged as e:
        divergence = e.divergence
    return LockstepReport(
        steps=0 if lock is None else lock.steps,
        num_requests=len(workload),
        num_rejected=0 if lock is None else lock.rejected,
        preemptions=0 if lock is None else lock.preemptions,
        divergence=divergence,
        drafts=0 if lock is None else lock.drafts,
        accepted=0 if lock is None else lock.accepted,
    )


def describe_states(divergence: Divergence) -> str:
    """Both states at a divergence, one per line (what the one-line verdict leaves out)."""
    lines = []
    if divergence.spec_state is not None:
        lines.append(f"  spec state:    {divergence.spec_state}")
    if divergence.engine_state is not None:
        lines.append(f"  engine state:  {divergence.engine_state.state}")
        lines.append(f"  engine blocks: {dict(divergence.engine_state.blocks)}")
    return "\n".join(lines)


def describe(divergence: Divergence) -> str:
    """The divergence with both states, for a report or a test failure."""
    return f"{divergence}\n{describe_states(divergence)}"


__all__ = [
    "Advance",
    "Diverged",
    "Divergence",
    "Lockstep",
    "LockstepReport",
    "check_vocab",
    "describe",
    "describe_states",
    "mask_plan",
    "mask_state",
    "run_workload",
]
