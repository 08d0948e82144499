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
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsched.engine_protocol import Engine
from kvsched.errors import DrainError
from kvsched.results import RequestOutcome, StepSample
from kvsched.workload import WorkloadRequest
from spec.kv import cdiv
from spec.policies import POLICIES, stored_order
from spec.types import (
    DuplicateRequestError,
    FinishedRequest,
    InvalidRequestError,
    SchedulerState,
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


def outcome_of(finished: FinishedRequest, line: int | None = None) -> RequestOutcome:
    return RequestOutcome(
        request_id=finished.request_id,
        output=tuple(finished.output_token_ids),
        finish_reason=str(finished.finish_reason),
        num_preemptions=finished.num_preemptions,
        line=line,
    )


def head_blocks_needed(state: SchedulerState) -> int | None:
    """Blocks the waiting head's prefill chunk needs, when requests wait and blocks are free.

    The head in the policy's order (R9); its chunk is its whole prompt plus kept
    outputs, cut to the token budget under chunked prefill (R8 step 2; the running
    requests' decodes may shrink the budget further, so this is an upper bound then).
    """
    if not state.waiting or state.num_free_gpu_blocks == 0:
        return None
    config = state.config
    policy = POLICIES.get(config.policy)
    order = policy.order_waiting if policy is not None else stored_order
    n = order(state.waiting)[0].num_tokens
    if config.enable_chunked_prefill:
        n = min(n, config.max_num_batched_tokens)
    return cdiv(n, config.block_size)


def drive(
    engine: Engine,
    workload: Sequence[WorkloadRequest],
    *,
    on_step: StepCallback | None = None,
    record_timeline: bool = True,
    max_steps: int | None = None,
) -> Drive:
    n = len(workload)
    order = sorted(range(n), key=lambda i: workload[i].arrival_step)
    outcomes: list[RequestOutcome | None] = [None] * n
    live: dict[str, int] = {}  # request id -> workload index of the live request
    result = Drive(outcomes=[])
    bound = step_bound(workload) if max_steps is None else max_steps
    done = 0
    nxt = 0
    start = time.perf_counter()
    while True:
        while nxt < n and workload[order[nxt]].arrival_step <= result.steps:
            i = order[nxt]
            nxt += 1
            r = workload[i]
            try:
                engine.add_request(r.request_id, list(r.prompt), r.params)
            except InvalidRequestError as e:
                error = f"{type(e).__name__}: {e}"
                first = live.get(r.request_id)
                if isinstance(e, DuplicateRequestError) and first is not None:
                    where = workload[first].line
                    error += f" (line {where})" if where else ""
                outcomes[i] = RequestOutcome(request_id=r.request_id, error=error, line=r.line)
                done += 1
            else:
                live[r.request_id] = i
        if nxt >= n and not engine.has_unfinished_requests():
            break
        if result.steps >= bound:
            raise DrainError(f"the engine did not drain the workload within {bound} steps")
        plan: StepPlan = engine.step()
        result.steps += 1
        result.tokens_sampled += len(plan.sampled)
        for p in plan.preempted:
            result.preemptions_by_mode[str(p.mode)] += 1
        for f in plan.finished:
            i = live.pop(f.request_id)
            outcomes[i] = outcome_of(f, workload[i].line)
            done += 1
        if record_timeline:
            state = engine.observe()
            result.timeline.append(
                StepSample(
                    step=plan.step,
                    gpu_blocks_used=state.config.num_gpu_blocks - state.num_free_gpu_blocks,
                    num_running=len(state.running),
                    num_waiting=len(state.waiting),
                    num_swapped=len(state.swapped),
                    num_preempted=len(plan.preempted),
                    preempted_modes=tuple(str(p.mode) for p in plan.preempted),
                    head_blocks_needed=head_blocks_needed(state),
                )
            )
        if on_step is not None:
            on_step(result.steps, done)
    result.elapsed_s = time.perf_counter() - start
    missing = [workload[i].request_id for i, o in enumerate(outcomes) if o is None]
    if missing:  # every accepted request is reported once, in some plan (R3)
        raise DrainError(f"the engine never reported requests {missing}")
    result.outcomes = [o for o in outcomes if o is not None]
    return result
