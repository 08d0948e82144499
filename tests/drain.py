"""How long a drain may take, and what a livelock looks like: the bound every stepping
loop of the tests holds (the state machine's teardown, and ``StepBound`` for the rest),
so that a wrong scheduler fails the test with its state instead of hanging it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final

import spec
from spec.policies import lifo_victim
from spec.profiles import liveness_proved
from spec.types import SamplingParams, SchedulerConfig, SchedulerState

#: Policies the LIFO liveness proof covers (docs/semantics.md, "Why every accepted
#: request finishes"): ``lifo``, and ``reserve``, whose gate never refuses an empty engine.
LIFO_PROOF_POLICIES: Final = frozenset({"lifo", "reserve"})


def lifo_proof_applies(config: SchedulerConfig) -> bool:
    """The proof needs LIFO victims (checked on the spec's policy, not just the name) and
    a profile it covers (``spec.profiles.liveness_proved``: not transformers)."""
    policy = config.policy
    return (
        policy in LIFO_PROOF_POLICIES
        and spec.POLICIES[policy].select_victim is lifo_victim
        and liveness_proved(config)
    )


def drain_bound(state: SchedulerState) -> int:
    """Steps a drain from ``state`` may take.

    Where the LIFO liveness proof applies (``lifo``, and ``reserve``: LIFO victims and a
    gate that never refuses an empty engine; docs/semantics.md): ``spec.drain_step_bound``,
    proven in spec.liveness (it covers every semantics profile but transformers). Otherwise
    (a policy that may preempt the head of ``running``, or transformers' offloads and soft
    resets) that proof does not carry over, and the bound is
    a documented generous one, ``(n + 1) * lifo_bound + n`` for ``n`` live requests (as
    if every request could lose all its progress once per other request); the runs
    record the largest ratio actually seen (docs/stateful-testing.md). Async scheduling
    (vllm-v1/async-*) is in ``spec.drain_step_bound`` (its lag steps and the batch
    queue's tail), so it needs nothing here.
    """
    bound = spec.drain_step_bound(state)
    if lifo_proof_applies(state.config):
        return bound
    n = spec.num_unfinished_requests(state)
    return (n + 1) * bound + n


ProgressKey = tuple[object, ...]


def progress_key(state: SchedulerState) -> ProgressKey:
    """The state without its counters (``num_steps``, each ``num_preemptions``), which no
    scheduling decision reads: a preemption livelock repeats it, though the counters
    grow. Requests are named by arrival (unique); prompt and params come with it. Under
    async scheduling the steps in flight (without their step numbers) and the tokens
    in flight are part of it: the batch queue draining is progress."""
    queues = tuple(
        tuple(
            (
                r.request.arrival,
                r.num_computed_tokens,
                r.output_token_ids,
                r.num_output_placeholders,
                r.num_in_flight_tokens,
                r.num_stale_output_tokens,
            )
            for r in queue
        )
        for queue in (state.waiting, state.running, state.swapped)
    )
    in_flight = tuple((b.scheduled, b.sampling_ids, b.arrivals) for b in state.in_flight)
    return (
        state.num_free_gpu_blocks,
        state.num_free_cpu_blocks,
        queues,
        in_flight,
        state.has_finished_requests,
    )


class StepBound:
    """A stepping loop's budget: ``tick`` it once per step; a step past ``bound`` fails
    with the state (``state`` itself, or a function returning it, called only then)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.steps = 0

    def tick(self, state: object | Callable[[], object]) -> None:
        self.steps += 1
        if self.steps > self.bound:
            shown = state() if callable(state) else state
            raise AssertionError(f"not drained within {self.bound} steps (drain bound): {shown}")


def drain_within(state: SchedulerState) -> StepBound:
    """The budget of a drain from ``state`` (no arrivals, no aborts): ``drain_bound``."""
    return StepBound(drain_bound(state))


def workload_bound(
    config: SchedulerConfig,
    requests: Iterable[tuple[Sequence[int], SamplingParams]],
    *,
    last_arrival: int = 0,
) -> StepBound:
    """The budget of a run whose requests arrive by step ``last_arrival``: those steps,
    then the drain of all of them as if they had all arrived at once (a request that has
    progressed since is no further from finishing), plus the step it starts in."""
    state = spec.init_state(config)
    for i, (prompt, params) in enumerate(requests):
        state = spec.add_request(state, f"bound-{i}", tuple(prompt), params)
    return StepBound(last_arrival + 1 + drain_bound(state))
