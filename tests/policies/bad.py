"""Deliberately bad policies, never registered for users: the suite must catch them.

Each is written on both sides (a spec ``Policy`` and an engine ``Policy``), like a
real one, so the differential suite sees the two agree and only its liveness checks
can object.

* ``evict-oldest``: the victim is always the *first* candidate, i.e. the request that
  needs the block preempts itself and phase A ends. Under restart mode two requests
  that cannot both fit keep knocking each other back to their prompt, and the drain
  cycles (the suite reports ``[no_livelock]``, or ``[drain_bound]`` once the bound is
  spent).
* ``refuse-all``: an admission gate that refuses every request, so a request
  waits forever even in an empty engine (the suite reports ``[step_progress]``: a
  step that does nothing while requests are live).
"""

from __future__ import annotations

import impl.policies
import impl.queues
from impl.sequence import Sequence
from spec.policies import Policy, stored_order
from spec.types import RequestState, SchedulerState


def _first_candidate(candidates: tuple[RequestState, ...]) -> int:
    return 0


def _refuse(state: SchedulerState, candidate: RequestState, num_tokens: int) -> bool:
    return False


SPEC_EVICT_OLDEST = Policy(
    name="evict-oldest", select_victim=_first_candidate, order_waiting=stored_order
)
SPEC_REFUSE_ALL = Policy(
    name="refuse-all",
    select_victim=_first_candidate,
    order_waiting=stored_order,
    can_admit=_refuse,
)


class EvictOldestPolicy(impl.policies.Policy):
    name = "evict-oldest"

    def select_victim(self, running: list[Sequence], start: int) -> int:
        return start

    def new_waiting_queue(self) -> impl.queues.WaitingQueue:
        return impl.queues.FifoWaitingQueue()


class RefuseAllPolicy(EvictOldestPolicy):
    name = "refuse-all"
    has_admission_gate = True

    def can_admit(
        self, seq: Sequence, num_tokens: int, *, running: list[Sequence], num_free_blocks: int
    ) -> bool:
        return False


#: name -> (spec policy, engine factory)
BAD_POLICIES = {
    "evict-oldest": (SPEC_EVICT_OLDEST, EvictOldestPolicy),
    "refuse-all": (SPEC_REFUSE_ALL, RefuseAllPolicy),
}
