"""Feeding a workload to an engine step by step, as ``kvsched run`` and ``demo`` do.

Requests are added at their ``arrival_step``: before the engine's step number ``k``
(counting from 0) every request whose ``arrival_step == k`` is added, in workload
order; then the engine steps. Stepping goes on while requests remain to arrive or
are unfinished (empty steps count, as in the engine). A request the engine refuses
at ``add_request`` is recorded as rejected with the error's message and the run goes
on. A rejected request's error reads ``ErrorType: message``; a duplicate id also names
the workload line of the live request it collides with (R4: an id may be reused once
its request has finished, so two served requests can share an id; the ``line`` of each
outcome tells them apart).

Per-step cost does not grow with the waiting queue. The state is not observed (that
walks every live request): ``--plot``'s timeline reads the scheduler's counters, and
a stopped run observes once, at the end. Arrivals can be admitted lazily
(``Arrivals``, ``admission_window``): under a policy that serves the stored order, a
step reads only the first few waiting requests (one more than it can admit: no more
than the seats, the free blocks, the token budget), so the rest may wait outside the
engine (and the spec) without changing one decision.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvsched.engine_protocol import Engine
from kvsched.errors import DrainError
from kvsched.results import RequestOutcome, StepSample
from kvsched.workload import WorkloadRequest
from spec.kv import cdiv
from spec.policies import POLICIES, stored_order
from spec.profiles import running_capped
from spec.types import (
    DuplicateRequestError,
    FinishedRequest,
    InvalidRequestError,
    RequestState,
    SchedulerConfig,
    StepPlan,
)

StepCallback = Callable[[int, int], None]  # (steps done, requests done)


@dataclass(slots=True)
class Drive:
    """What a drive saw: outcomes in workload order, the timeline and plan counters."""

    outcomes: list[RequestOutcome]
    timeline: list[StepSample] = field(default_factory=list)
    steps: int = 0
    preemptions_by_mode: Counter[str] = field(default_factory=Counter)
    tokens_sampled: int = 0
    elapsed_s: float = 0.0
    stopped: str | None = None  # why ``stop`` ended it before the workload drained

    @property
    def preemptions(self) -> int:
        return sum(self.preemptions_by_mode.values())


def step_bound(workload: Sequence[WorkloadRequest]) -> int:
    """A generous bound on the steps needed to drain ``workload``.

    Under ``lifo`` some request finishes at least every ``max L`` steps while one is
    live (docs/semantics.md, liveness), ``L = P + M - 1``; the bound allows four
    times that after the last arrival.
    """
    if not workload:
        return 0
    longest = max(len(r.prompt) + max(r.params.max_tokens, 1) for r in workload)
    last = max(r.arrival_step for r in workload)
    return last + 1 + 4 * len(workload) * (longest + 2) + 100


Window = Callable[[int, int], int]  # (running, free GPU blocks) -> waiting requests read


def admission_window(config: SchedulerConfig) -> Window | None:
    """How many waiting requests the next step can read, or ``None`` if it may read all.

    Phase C (R8) walks the waiting queue in the policy's order and stops at the first
    request that does not fit; phases A and B never read it. Each request it admits
    takes a seat (``max_num_seqs`` less the running ones, or ``max_num_seqs`` per step
    under nano-vllm), at least one token of the budget and at least one free GPU
    block (a cache hit covers whole blocks only, and the chunk has a token more), and
    phase A only takes blocks before it. So with ``r`` running and ``f`` free blocks
    before the step, it admits at most ``min(seats, f, max_num_batched_tokens)``; one
    more is handed in, so that the waiting head after the step (what ``--plot`` shows)
    is the one an eager run would have. Under a policy that serves the stored order
    (``lifo``, ``fewest-outputs``, ``reserve``) the requests behind those never change
    a step. A policy that reorders (``priority``) may serve any of them next: ``None``.
    tests/cli/test_arrivals.py holds lazy runs to eager ones.
    """
    policy = POLICIES.get(config.policy)
    if policy is None or policy.order_waiting is not stored_order:
        return None
    capped = running_capped(config)

    def window(num_running: int, num_free_blocks: int) -> int:
        seats = config.max_num_seqs - (num_running if capped else 0)
        return max(0, min(seats, num_free_blocks, config.max_num_batched_tokens)) + 1

    return window


class Arrivals:
    """The workload in arrival order, handed to the scheduler when due (``due``).

    Eager (``room=None``): each request at its ``arrival_step``. Lazy: an arrived
    request waits here, in order, while ``room()`` (the waiting requests the next
    step can read, less those the scheduler holds: ``admission_window``) is not
    positive; no decision changes, and a step's cost does not grow with the queue.

    R4 judges a duplicate id against the requests live when it arrives, so a lazy
    arrival whose id is live in the scheduler is handed out at once (to be refused as
    it would be), and one whose id is still held here first releases everything held
    (in order) ahead of it. ``live`` maps each id handed out and accepted
    (``accepted``) to its workload index until it finishes (``finished``).
    """

    def __init__(
        self, workload: Sequence[WorkloadRequest], *, room: Callable[[], int] | None = None
    ) -> None:
        self._workload = workload
        self._order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_step)
        self._next = 0
        self._held: deque[int] = deque()
        self._held_ids: Counter[str] = Counter()
        self._room = room
        self.live: dict[str, int] = {}

    @property
    def exhausted(self) -> bool:
        """Every request has been handed out."""
        return self._next >= len(self._order) and not self._held

    def _release(self) -> int:
        i = self._held.popleft()
        rid = self._workload[i].request_id
        self._held_ids[rid] -= 1
        if not self._held_ids[rid]:
            del self._held_ids[rid]
        return i

    def due(self, step: int) -> Iterator[int]:
        """The workload indices to add before step ``step``, in order.

        A generator: the caller adds each (and calls ``accepted`` if the scheduler took
        it) before the next is chosen, so the window sees the queue as it is.
        """
        workload = self._workload
        while (
            self._next < len(self._order) and workload[self._order[self._next]].arrival_step <= step
        ):
            i = self._order[self._next]
            self._next += 1
            rid = workload[i].request_id
            if rid in self._held_ids:
                while self._held:
                    yield self._release()
                yield i
            elif self._room is None or rid in self.live:
                yield i
            else:
                self._held.append(i)
                self._held_ids[rid] += 1
        if self._room is not None:
            while self._held and self._room() > 0:
                yield self._release()

    def accepted(self, i: int) -> None:
        self.live[self._workload[i].request_id] = i

    def finished(self, request_id: str) -> int:
        """The workload index of the live request ``request_id``, which has finished."""
        return self.live.pop(request_id)


def outcome_of(finished: FinishedRequest, line: int | None = None) -> RequestOutcome:
    return RequestOutcome(
        request_id=finished.request_id,
        output=tuple(finished.output_token_ids),
        finish_reason=str(finished.finish_reason),
        num_preemptions=finished.num_preemptions,
        line=line,
    )


def unfinished_outcome(
    request: WorkloadRequest, state: RequestState | None, *, waiting: bool
) -> RequestOutcome:
    """A request a stopped run left unfinished: partial if it was admitted (running or
    swapped) or waits with outputs kept, not started otherwise (``state`` None: never
    handed to the engine)."""
    output = () if state is None else tuple(state.output_token_ids)
    return RequestOutcome(
        request_id=request.request_id,
        output=output,
        finish_reason=None,
        num_preemptions=0 if state is None else state.num_preemptions,
        line=request.line,
        started=state is not None and (not waiting or bool(output)),
    )


def head_blocks_needed(config: SchedulerConfig, num_tokens: int) -> int:
    """Blocks the waiting head's prefill chunk needs, its tokens being ``num_tokens``.

    Its whole prompt plus kept outputs, cut to the token budget under chunked prefill
    (R8 step 2; the running requests' decodes may shrink the budget further, so this
    is an upper bound then).
    """
    n = num_tokens
    if config.enable_chunked_prefill:
        n = min(n, config.max_num_batched_tokens)
    return cdiv(n, config.block_size)


def sample(engine: Engine, plan: StepPlan) -> StepSample:
    """The engine's state after ``plan``, from the scheduler's counters (O(1)).

    The head is the next in the policy's order (R9), counted only when requests wait
    while GPU blocks are free.
    """
    scheduler = engine.scheduler
    config = scheduler.config
    free = scheduler.gpu.num_free_blocks
    waiting = scheduler.waiting
    head = None
    if len(waiting) and free:
        head = head_blocks_needed(config, waiting.peek().num_tokens)
    return StepSample(
        step=plan.step,
        gpu_blocks_used=config.num_gpu_blocks - free,
        num_running=len(scheduler.running),
        num_waiting=len(waiting),
        num_swapped=len(scheduler.swapped),
        num_preempted=len(plan.preempted),
        preempted_modes=tuple(str(p.mode) for p in plan.preempted),
        head_blocks_needed=head,
    )


def _engine_room(engine: Engine, window: Window) -> Callable[[], int]:
    """The waiting requests ``engine``'s next step can read beyond those it holds."""
    scheduler = engine.scheduler

    def room() -> int:
        reads = window(len(scheduler.running), scheduler.gpu.num_free_blocks)
        return reads - len(scheduler.waiting)

    return room


def _stopped_outcomes(
    engine: Engine,
    workload: Sequence[WorkloadRequest],
    outcomes: list[RequestOutcome | None],
    arrivals: Arrivals,
) -> list[RequestOutcome]:
    """Every request's outcome when the run stopped early (one ``observe``)."""
    state = engine.observe()
    waiting = {r.request_id: r for r in state.waiting}
    admitted = {r.request_id: r for r in (*state.running, *state.swapped)}
    done: list[RequestOutcome] = []
    for i, outcome in enumerate(outcomes):
        if outcome is not None:
            done.append(outcome)
            continue
        rid = workload[i].request_id
        given = arrivals.live.get(rid) == i  # handed to the engine (and not finished)
        found = (admitted.get(rid) or waiting.get(rid)) if given else None
        done.append(unfinished_outcome(workload[i], found, waiting=rid not in admitted))
    return done


def drive(
    engine: Engine,
    workload: Sequence[WorkloadRequest],
    *,
    on_step: StepCallback | None = None,
    record_timeline: bool = False,
    max_steps: int | None = None,
    window: Window | None = None,
    stop: Callable[[], str | None] | None = None,
) -> Drive:
    """Run ``workload`` through ``engine``; ``window``: lazy arrivals (``Arrivals``,
    ``admission_window``).

    ``stop`` is read before each step: once it gives a reason (``"SIGINT"``) the drive
    ends there, with every request unfinished at that point reported partial or not
    started.
    """
    n = len(workload)
    arrivals = Arrivals(workload, room=None if window is None else _engine_room(engine, window))
    outcomes: list[RequestOutcome | None] = [None] * n
    result = Drive(outcomes=[])
    bound = step_bound(workload) if max_steps is None else max_steps
    done = 0
    start = time.perf_counter()
    while True:
        result.stopped = None if stop is None else stop()
        if result.stopped is not None:
            break
        for i in arrivals.due(result.steps):
            r = workload[i]
            try:
                engine.add_request(r.request_id, r.prompt, r.params)
            except InvalidRequestError as e:
                error = f"{type(e).__name__}: {e}"
                first = arrivals.live.get(r.request_id)
                if isinstance(e, DuplicateRequestError) and first is not None:
                    where = workload[first].line
                    error += f" (line {where})" if where else ""
                outcomes[i] = RequestOutcome(request_id=r.request_id, error=error, line=r.line)
                done += 1
            else:
                arrivals.accepted(i)
        if arrivals.exhausted and not engine.has_unfinished_requests():
            break
        if result.steps >= bound:
            raise DrainError(f"the engine did not drain the workload within {bound} steps")
        plan: StepPlan = engine.step()
        result.steps += 1
        result.tokens_sampled += len(plan.sampled)
        for p in plan.preempted:
            result.preemptions_by_mode[str(p.mode)] += 1
        for f in plan.finished:
            i = arrivals.finished(f.request_id)
            outcomes[i] = outcome_of(f, workload[i].line)
            done += 1
        if record_timeline:
            result.timeline.append(sample(engine, plan))
        if on_step is not None:
            on_step(result.steps, done)
    result.elapsed_s = time.perf_counter() - start
    if result.stopped is not None:
        result.outcomes = _stopped_outcomes(engine, workload, outcomes, arrivals)
        return result
    missing = [workload[i].request_id for i, o in enumerate(outcomes) if o is None]
    if missing:  # every accepted request is reported once, in some plan (R3)
        raise DrainError(f"the engine never reported requests {missing}")
    result.outcomes = [o for o in outcomes if o is not None]
    return result
