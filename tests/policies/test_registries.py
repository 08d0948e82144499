"""One name per policy on both sides, and every consumer iterates the registries."""

from __future__ import annotations

import argparse

import pytest

import impl
import impl.policies
import spec
import spec.policies
from kvsched.cli import build_parser
from spec.types import SchedulerConfig


def test_spec_and_engine_register_the_same_names() -> None:
    assert sorted(spec.POLICIES) == sorted(impl.POLICIES)
    # The package-level names are the modules' registries, not copies.
    assert spec.POLICIES is spec.policies.POLICIES
    assert impl.POLICIES is impl.policies.POLICIES


def test_each_registered_policy_carries_its_own_name() -> None:
    for name in spec.POLICIES:
        assert spec.get_policy(name).name == name
        engine_policy = impl.make_policy(name)
        assert engine_policy.name == name
        engine_policy.bind(SchedulerConfig(num_gpu_blocks=4, policy=name))
        # A fresh policy per scheduler: policies may keep per-scheduler state.
        assert impl.make_policy(name) is not engine_policy


def _policy_choices(parser: argparse.ArgumentParser, command: str) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[command]
            for option in sub._actions:
                if "--policy" in option.option_strings:
                    assert option.choices is not None
                    return sorted(option.choices)
    raise AssertionError(f"kvsched {command} has no --policy")


def test_cli_offers_every_registered_policy() -> None:
    """``kvsched run/conform --policy`` choices are read from the registry."""
    parser = build_parser()
    for command in ("run", "conform"):
        assert _policy_choices(parser, command) == sorted(impl.POLICIES)


def test_stateful_suite_draws_every_registered_policy() -> None:
    """The differential machines draw the policy from the registry and must reach each."""
    from tests.stateful import coverage, strategies  # noqa: PLC0415  (the suite's import cost)

    assert tuple(strategies.POLICY_NAMES) == tuple(sorted(spec.POLICIES))
    for name in spec.POLICIES:
        assert f"config: policy={name}" in coverage.REQUIRED_EVENTS


def test_crosshair_covers_every_registered_policy() -> None:
    """CrossHair's symbolic configs draw from the registry, and ``diffbehavior`` gets a
    victim pair and a gate pair per registered policy (tests/crosshair/adapters.py)."""
    pytest.importorskip("crosshair")
    from tests.crosshair import adapters, symbolic  # noqa: PLC0415  (imports CrossHair)

    assert vars(symbolic)["POLICIES"] is spec.policies.POLICIES
    for name in spec.POLICIES:
        slug = name.replace("-", "_")
        assert f"victim_{slug}" in adapters.PAIRS
        assert f"admit_{slug}" in adapters.PAIRS
