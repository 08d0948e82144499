"""The stateful suite catches a policy that starves or livelocks, with a small example.

Each bad policy of ``tests/policies/bad.py`` is registered on both sides for the
test only (the registries are monkeypatched back afterwards) and the suite's own
machine, on the toy scheduler's subject, is run on it with ``run_state_machine_as_test``.
The subject below changes only what the suite cannot know: the configs it draws (the
bad policy and, for ``evict-oldest``, restart mode, the mode in which that policy
livelocks). Everything else (rules, invariants, the bounded drain in ``teardown``) is the
suite's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import impl.policies
import spec
import spec.policies
from spec.types import PreemptionMode, SchedulerConfig, Semantics
from tests.policies.bad import BAD_POLICIES
from tests.stateful.failures import InvariantViolation
from tests.stateful.machine import INVARIANT_NAMES, LockstepMachine, machine_for
from tests.stateful.strategies import engine_configs
from tests.stateful.subjects.scheduler import SCHEDULER

#: The suite's drain and progress checks (tests/stateful/machine.py).
LIVENESS_FAILURES = ("[drain_bound]", "[no_livelock]", "[step_progress]", "[all_finished]")


def register(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Register the bad policy ``name`` on both sides until the test ends."""
    spec_policy, engine_factory = BAD_POLICIES[name]
    registry = MappingProxyType({**spec.policies.POLICIES, name: spec_policy})
    monkeypatch.setattr(spec.policies, "POLICIES", registry)
    monkeypatch.setattr(spec, "POLICIES", registry)
    monkeypatch.setitem(impl.policies.POLICIES, name, engine_factory)


def bad_policy_machine(name: str, mode: PreemptionMode | None) -> type[LockstepMachine]:
    """The machine on the toy scheduler's subject, whose configs (kvsched's) use ``name``."""

    def with_bad_policy(config: SchedulerConfig) -> SchedulerConfig:
        if mode is None:
            return replace(config, policy=name)
        return replace(config, policy=name, preemption_mode=mode)

    configs = engine_configs(semantics_choices=(Semantics.KVSCHED,)).map(with_bad_policy)
    return machine_for(replace(SCHEDULER, machine=f"BadPolicy[{name}]", configs=configs))


SETTINGS = settings(
    max_examples=400,
    stateful_step_count=3,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.generate, Phase.shrink),
    suppress_health_check=list(HealthCheck),
)


def rule_calls(program: list[str]) -> list[str]:
    """The rules of a printed failing program (invariant checks and teardown left out)."""
    calls = []
    for line in program:
        if "state." not in line or line.startswith("state = "):
            continue
        rule = line.split("state.", 1)[1].split("(", 1)[0]
        if rule not in INVARIANT_NAMES and rule != "teardown":
            calls.append(line)
    return calls


def run_bad(
    monkeypatch: pytest.MonkeyPatch, name: str, mode: PreemptionMode | None
) -> tuple[str, list[str], list[str]]:
    register(monkeypatch, name)
    machine = bad_policy_machine(name, mode)
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine, settings=SETTINGS)
    message = str(caught.value)
    program = list(getattr(caught.value, "__notes__", []))
    print(f"{name}: {message}")
    print("\n".join(program))
    return message, program, rule_calls(program)


CASES: list[tuple[str, PreemptionMode | None, Callable[[str], bool]]] = [
    # A livelock: two requests knock each other back to their prompts forever.
    ("evict-oldest", PreemptionMode.RESTART, lambda m: m.startswith(LIVENESS_FAILURES[:2])),
    # Starvation: nothing is ever admitted, not even into an empty engine.
    ("refuse-all", None, lambda m: m.startswith("[step_progress]")),
]


@pytest.mark.parametrize(("name", "mode", "expected"), CASES, ids=[c[0] for c in CASES])
def test_suite_reports_a_bad_policy_with_a_small_example(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    mode: PreemptionMode | None,
    expected: Callable[[str], bool],
) -> None:
    message, program, calls = run_bad(monkeypatch, name, mode)
    assert expected(message), message
    assert message.startswith(LIVENESS_FAILURES)
    assert any("init_engine" in line for line in calls), program
    # Shrunk: the engine with its initial requests, at most two more rules, the drain.
    assert len(calls) <= 3, "\n".join(program)
    added = sum(line.count("NewRequest(") for line in program)
    assert 1 <= added <= 8, "\n".join(program)
    live = re.match(r"\[drain_bound\] (\d+) requests still live", message)
    if live is not None:  # the livelock is between two requests (one may finish late)
        assert 1 <= int(live.group(1)) <= 2, message
        assert f"policy {name}" in message


def test_registries_are_restored() -> None:
    """The bad policies never leak into the shipped registries."""
    for name in BAD_POLICIES:
        assert name not in spec.POLICIES
        assert name not in impl.policies.POLICIES
