"""Policies (R9): registry, victim choice, waiting order vs stored order."""

from __future__ import annotations

import pytest

from impl.policies import (
    POLICIES,
    FewestOutputsPolicy,
    Policy,
    PriorityPolicy,
    make_policy,
)
from impl.queues import FifoWaitingQueue, PriorityWaitingQueue, WaitingQueue
from impl.scheduler import Scheduler
from impl.sequence import Sequence
from spec.types import ConfigError, Request, SamplingParams, SchedulerConfig


def seq(
    name: str, arrival: int, *, prompt: int = 2, outputs: int = 0, priority: int = 0
) -> Sequence:
    request = Request(
        request_id=name,
        prompt_token_ids=tuple(range(1, prompt + 1)),
        params=SamplingParams(max_tokens=10, priority=priority),
        arrival=arrival,
    )
    s = Sequence(request)
    for _ in range(outputs):
        s.token_ids.append(7)
        s.num_tokens += 1
    return s


def test_registry_names_and_unknown_name() -> None:
    assert set(POLICIES) == {"lifo", "priority", "fewest-outputs", "reserve"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ConfigError, match="unknown scheduling policy"):
        make_policy("fifo")
    with pytest.raises(ConfigError):
        Scheduler(SchedulerConfig(num_gpu_blocks=4, policy="nope"))


def test_lifo_victim_is_the_last_candidate() -> None:
    running = [seq("a", 0), seq("b", 1), seq("c", 2)]
    assert make_policy("lifo").select_victim(running, 0) == 2
    assert make_policy("lifo").select_victim(running, 2) == 2


def test_priority_victim_is_the_largest_priority_then_latest_arrival() -> None:
    running = [
        seq("a", 0, priority=0),
        seq("b", 1, priority=5),
        seq("c", 4, priority=1),
        seq("d", 3, priority=5),
    ]
    policy = PriorityPolicy()
    assert policy.select_victim(running, 0) == 3  # (5, 3) > (5, 1)
    assert policy.select_victim(running, 2) == 3
    assert policy.select_victim(running[:3], 0) == 1
    assert policy.select_victim(running[:3], 2) == 2  # only candidate


def test_fewest_outputs_victim_ties_longest_prompt_then_latest() -> None:
    policy = FewestOutputsPolicy()
    running = [
        seq("a", 0, outputs=1, prompt=2),
        seq("b", 1, outputs=3, prompt=2),
        seq("c", 2, outputs=1, prompt=4),
        seq("d", 3, outputs=1, prompt=4),
        seq("e", 4, outputs=2, prompt=9),
    ]
    assert policy.select_victim(running, 0) == 3  # fewest 1, longest 4, latest d
    assert policy.select_victim(running, 1) == 3
    assert policy.select_victim(running, 4) == 4
    running[3].token_ids.append(1)
    running[3].num_tokens += 1
    assert policy.select_victim(running, 0) == 2  # d now has 2 outputs


def test_priority_queue_walks_by_priority_but_stores_queue_order() -> None:
    queue = PriorityWaitingQueue()
    a, b, c, d = seq("a", 0, priority=1), seq("b", 1, priority=0), seq("c", 2), seq("d", 3)
    c.priority = 2
    queue.push_back(a)
    queue.push_back(b)
    queue.push_front(c)  # a preempted request goes to the front of the stored order
    queue.push_front(d)
    assert [s.request_id for s in queue.stored()] == ["d", "c", "a", "b"]
    assert queue.peek() is b
    order = [queue.pop().request_id for _ in range(len(queue))]
    assert order == ["b", "d", "a", "c"]  # (0,1) (0,3) (1,0) (2,2)


def test_priority_queue_remove_and_undo() -> None:
    queue = PriorityWaitingQueue()
    items = [
        seq(name, i, priority=p)
        for i, (name, p) in enumerate(zip("abcde", [3, 1, 2, 0, 1], strict=True))
    ]
    for item in items:
        queue.push_back(item)
    queue.remove(items[2])
    assert [s.request_id for s in queue.stored()] == ["a", "b", "d", "e"]
    head = queue.pop()
    assert head.request_id == "d"
    queue.unpop(head)
    assert [s.request_id for s in queue.stored()] == ["a", "b", "d", "e"]
    queue.push_front(items[2])
    queue.unpush_front(items[2])
    assert [s.request_id for s in queue.stored()] == ["a", "b", "d", "e"]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(items[2])


def test_policy_is_an_interface_without_a_default_victim() -> None:
    class QueueOnly(Policy):
        name = "queue-only"

        def new_waiting_queue(self) -> WaitingQueue:
            return FifoWaitingQueue()

    with pytest.raises(TypeError, match="select_victim"):
        QueueOnly()  # type: ignore[abstract]
