"""``kvsched conform``: the reference scheduler and the engine in lockstep.

Both get the same requests at the same steps (the arrival rule of ``kvsched.drive``).
Each step, the engine steps (deciding, running the model and sampling); the spec's
``schedule`` decides on its own and its decisions (scheduled chunks, victims,
swap-ins) are compared with the engine's; then the engine's sampled tokens feed the
spec's ``complete_step``, so both apply exactly the same outputs, and the whole
``StepPlan``s are compared, then ``engine.observe()`` with the spec's state. At the
end, the finished outputs are compared too. The first difference stops the run and is
reported with the step, the field's path (``plan.preempted[0].request_id``), the
spec's value and the engine's.

``add_request`` is compared too: both must accept, or both refuse with the same
typed error. A token outside the vocabulary is the engine's check alone (R4.3), so a
request the engine refuses for it is not given to the spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import spec
from kvsched.diff import first_difference, short_repr
from kvsched.drive import step_bound
from kvsched.engine_protocol import Engine
from kvsched.errors import DrainError
from kvsched.workload import WorkloadRequest
from spec.types import (
    FinishedRequest,
    InvalidRequestError,
    SampledTokensError,
    SchedulerConfig,
    SchedulerState,
    TokenOutOfVocabError,
)


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    field: str
    spec_value: object
    engine_value: object

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.field}: spec {short_repr(self.spec_value)}, "
            f"engine {short_repr(self.engine_value)}"
        )


@dataclass(frozen=True, slots=True)
class ConformReport:
    steps: int
    num_requests: int
    num_rejected: int
    preemptions: int
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


class _Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


def _refusal(e: InvalidRequestError | None) -> str:
    return "accepted" if e is None else f"{type(e).__name__}: {e}"


def _compare(step: int, spec_value: object, engine_value: object, path: str) -> None:
    d = first_difference(spec_value, engine_value, path)
    if d is not None:
        raise _Diverged(Divergence(step, d.path, d.left, d.right))


class _Lockstep:
    def __init__(self, engine: Engine, config: SchedulerConfig) -> None:
        self.engine = engine
        self.state: SchedulerState = spec.init_state(config)
        self.steps = 0
        self.rejected = 0
        self.preemptions = 0
        self.spec_finished: list[FinishedRequest] = []
        self.engine_finished: list[FinishedRequest] = []

    def add(self, r: WorkloadRequest) -> None:
        engine_error: InvalidRequestError | None = None
        try:
            self.engine.add_request(r.request_id, list(r.prompt), r.params)
        except InvalidRequestError as e:
            engine_error = e
        if isinstance(engine_error, TokenOutOfVocabError):
            self.rejected += 1
            return
        spec_error: InvalidRequestError | None = None
        try:
            self.state = spec.add_request(self.state, r.request_id, r.prompt, r.params)
        except InvalidRequestError as e:
            spec_error = e
        if type(spec_error) is not type(engine_error):
            raise _Diverged(
                Divergence(
                    self.steps,
                    f"add_request({r.request_id!r})",
                    _refusal(spec_error),
                    _refusal(engine_error),
                )
            )
        if engine_error is not None:
            self.rejected += 1

    def unfinished(self) -> bool:
        return self.engine.has_unfinished_requests() or spec.has_unfinished_requests(self.state)

    def step(self) -> None:
        step = self.steps
        engine_plan = self.engine.step()
        # Phases A-C first: the decisions, before any token is involved.
        state_mid, decided = spec.schedule(self.state)
        _compare(
            step,
            decided,
            replace(engine_plan, sampled_ids=(), sampled_token_ids=(), finished=()),
            "plan",
        )
        tokens = {s.request_id: s.token_id for s in engine_plan.sampled}
        try:
            self.state, spec_plan = spec.complete_step(state_mid, decided, tokens)
        except SampledTokensError as e:
            raise _Diverged(
                Divergence(step, "plan.sampled", f"refused: {e}", engine_plan.sampled)
            ) from None
        self.steps += 1
        _compare(step, spec_plan, engine_plan, "plan")
        _compare(step, self.state, self.engine.observe(), "state")
        self.preemptions += len(spec_plan.preempted)
        self.spec_finished.extend(spec_plan.finished)
        self.engine_finished.extend(engine_plan.finished)


def conform(
    engine: Engine,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    *,
    max_steps: int | None = None,
) -> ConformReport:
    """Run ``workload`` through ``engine`` and the spec in lockstep; stop at a divergence."""
    lock = _Lockstep(engine, config)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_step)
    bound = step_bound(workload) if max_steps is None else max_steps
    divergence: Divergence | None = None
    nxt = 0
    try:
        _compare(0, lock.state, engine.observe(), "state")
        while True:
            added = False
            while nxt < len(order) and workload[order[nxt]].arrival_step <= lock.steps:
                lock.add(workload[order[nxt]])
                nxt += 1
                added = True
            if added:
                _compare(lock.steps, lock.state, engine.observe(), "state")
            if nxt >= len(order) and not lock.unfinished():
                break
            if lock.steps >= bound:
                raise DrainError(f"the workload did not drain within {bound} steps")
            lock.step()
        _compare(lock.steps, lock.spec_finished, lock.engine_finished, "finished")
    except _Diverged as e:
        divergence = e.divergence
    return ConformReport(
        steps=lock.steps,
        num_requests=len(workload),
        num_rejected=lock.rejected,
        preemptions=lock.preemptions,
        divergence=divergence,
    )


def render(report: ConformReport, config: SchedulerConfig) -> str:
    setup = f"policy {config.policy}, {config.preemption_mode} mode"
    if report.divergence is None:
        return (
            f"conform: ok: spec and engine agree at all {report.steps} steps "
            f"({report.num_requests} requests, {report.num_rejected} rejected, "
            f"{report.preemptions} preemption{'' if report.preemptions == 1 else 's'}; {setup})"
        )
    return f"conform: DIVERGED at {report.divergence} ({setup})"
