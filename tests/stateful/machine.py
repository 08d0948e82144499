"""The differential machine: rules and invariants, and a teardown that drains.

The teardown drains the engine with a derived bound, checks that the state never
repeats (a livelock), that every accepted request finished and the pools are empty,
and compares every output with a solo run of its request.
"""

from __future__ import annotations

from typing import Final

import spec
from spec.policies import lifo_victim
from spec.profiles import model_len
from spec.types import FinishReason, SchedulerState
from tests.stateful.failures import fail, require
from tests.stateful.invariants import Invariants
from tests.stateful.rules import Rules

#: Policies the LIFO liveness proof covers (docs/semantics.md, "Why every accepted
#: request finishes"): ``lifo``, and ``reserve``, whose gate never refuses an empty engine.
LIFO_PROOF_POLICIES: Final = frozenset({"lifo", "reserve"})


def lifo_proof_applies(policy: str) -> bool:
    """The proof needs LIFO victims; checked on the spec's policy, not just the name."""
    return policy in LIFO_PROOF_POLICIES and spec.POLICIES[policy].select_victim is lifo_victim


def drain_bound(state: SchedulerState, *, lifo_proof: bool | None = None) -> int:
    """Steps a drain from ``state`` may take.

    Where the LIFO liveness proof applies (``lifo_proof``; by default: ``lifo``, and
    ``reserve``, LIFO victims and a gate that never refuses an empty engine:
    docs/semantics.md): ``spec.drain_step_bound``, proven in spec.liveness. Otherwise
    (a policy or a peer that may preempt the head of ``running``) that proof does not
    carry over, and the bound is a documented generous one, ``(n + 1) * lifo_bound + n``
    for ``n`` live requests (as if every request could lose all its progress once per
    other request); the runs record the largest ratio actually seen
    (docs/stateful-testing.md).
    """
    bound = spec.drain_step_bound(state)
    if lifo_proof is None:
        lifo_proof = lifo_proof_applies(state.config.policy)
    if lifo_proof:
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


class DifferentialMachine(Rules, Invariants):
    """Rules, invariants and teardown shared by both machines (tests/stateful/base.py).

    A subclass provides the real side in lockstep with the spec (``new_lockstep``,
    ``real_scheduler``), solo reference outputs (``solo``) and its faults.
    """

    # --- teardown: bounded drain, completion, solo outputs -------------------------------------

    def teardown(self) -> None:
        if not self.ready or not self.settled:
            return  # a rule failed: report that, not a drain of a diverged state
        start = self.lock.state
        bound = drain_bound(start)
        lifo_bound = spec.drain_step_bound(start)
        seen: set[ProgressKey] = set()
        steps = 0
        while spec.has_unfinished_requests(self.lock.state):
            if steps >= bound:
                fail(
                    "drain_bound",
                    f"{spec.num_unfinished_requests(self.lock.state)} requests still live "
                    f"after {steps} drain steps (bound {bound}, policy {self.config.policy})",
                )
            if self.do_step() is None:
                continue  # an armed fault fired: rolled back, retried (each fires once)
            steps += 1
            self.record.stats.drain_steps += 1
            # The state modulo its counters, and the token function, determine every
            # later step: a repeat is a livelock, whatever the bound says.
            key = progress_key(self.lock.state)
            if key in seen:
                fail("no_livelock", f"state repeats after {steps} drain steps")
            seen.add(key)
        if self.config.policy != "lifo" and lifo_bound > 0:  # the ratio for the others
            policy = self.config.policy
            ratio = steps / lifo_bound
            self.record.stats.max_drain_ratio[policy] = max(
                self.record.stats.max_drain_ratio.get(policy, 0.0), ratio
            )
            if ratio > 1:
                self.note(f"drain: {policy} exceeded the LIFO bound")
        self.check_drained()
        self.target(float(self.preemptions), "preemptions")
        self.target(float(self.peak_gpu_used) / self.config.num_gpu_blocks, "peak GPU use")
        self.target(float(self.peak_swapped), "peak swapped requests")
        self.target(float(steps), "drain steps")

    def check_drained(self) -> None:
        missing = sorted(
            (a.request_id, arrival)
            for arrival, a in self.accepted.items()
            if arrival not in self.outcomes
        )
        require(not missing, "all_finished", lambda: f"accepted but never finished: {missing}")
        scheduler = self.real_scheduler()
        require(
            not scheduler.has_unfinished_requests()
            and scheduler.gpu.num_free_blocks == scheduler.gpu.num_blocks
            and scheduler.cpu.num_free_blocks == scheduler.cpu.num_blocks,
            "pools_empty_after_drain",
            f"GPU free {scheduler.gpu.num_free_blocks}/{scheduler.gpu.num_blocks}, CPU free "
            f"{scheduler.cpu.num_free_blocks}/{scheduler.cpu.num_blocks}, "
            f"{scheduler.num_unfinished_requests} live",
        )
        length = model_len(self.config)
        for arrival, finished in sorted(self.outcomes.items()):
            accepted = self.accepted[arrival]
            solo = self.solo(accepted.prompt, accepted.params)
            if length is not None:  # vllm-v1/max-model-len: a solo run stops there too
                # (vllm-v0's prompt of max_model_len tokens at its first output)
                solo = solo[: max(length - len(accepted.prompt), 1)]
            outputs = finished.output_token_ids
            if finished.finish_reason is FinishReason.ABORTED:
                ok = outputs == solo[: len(outputs)]
            else:
                ok = outputs == solo
            if not ok:
                fail(
                    "outputs_match_solo",
                    f"{accepted.request_id!r} ({finished.finish_reason}, "
                    f"{finished.num_preemptions} preemptions) produced {outputs}, alone {solo}",
                )
