"""How long a drain may take, and what a livelock looks like (the machine's teardown)."""

from __future__ import annotations

from typing import Final

import spec
from spec.policies import lifo_victim
from spec.types import SchedulerState

#: Policies the LIFO liveness proof covers (docs/semantics.md, "Why every accepted
#: request finishes"): ``lifo``, and ``reserve``, whose gate never refuses an empty engine.
LIFO_PROOF_POLICIES: Final = frozenset({"lifo", "reserve"})


def lifo_proof_applies(policy: str) -> bool:
    """The proof needs LIFO victims; checked on the spec's policy, not just the name."""
    return policy in LIFO_PROOF_POLICIES and spec.POLICIES[policy].select_victim is lifo_victim


def drain_bound(state: SchedulerState) -> int:
    """Steps a drain from ``state`` may take.

    Where the LIFO liveness proof applies (``lifo``, and ``reserve``: LIFO victims and a
    gate that never refuses an empty engine; docs/semantics.md): ``spec.drain_step_bound``,
    proven in spec.liveness (it covers every semantics profile). Otherwise (a policy that
    may preempt the head of ``running``) that proof does not carry over, and the bound is
    a documented generous one, ``(n + 1) * lifo_bound + n`` for ``n`` live requests (as
    if every request could lose all its progress once per other request); the runs
    record the largest ratio actually seen (docs/stateful-testing.md).
    """
    bound = spec.drain_step_bound(state)
    if lifo_proof_applies(state.config.policy):
        return bound
    n = spec.num_unfinished_requests(state)
    return (n + 1) * bound + n


ProgressKey = tuple[int, int, tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...]]


def progress_key(state: SchedulerState) -> ProgressKey:
    """The state without its counters (``num_steps``, each ``num_preemptions``), which no
    scheduling decision reads: a preemption livelock repeats it, though the counters
    grow. Requests are named by arrival (unique); prompt and params come with it."""
    queues = tuple(
        tuple((r.request.arrival, r.num_computed_tokens, r.output_token_ids) for r in queue)
        for queue in (state.waiting, state.running, state.swapped)
    )
    return state.num_free_gpu_blocks, state.num_free_cpu_blocks, queues
