"""The transitions' PEP 316 contracts, evaluated on concrete runs under every profile and
with prefix caching on.

CrossHair's builders make states of the kvsched profile with prefix caching off only
(docs/crosshair.md, "State sizes verified"). The contracts are stated for every
profile and for caching on too (shared blocks counted once: ``blocks_in_use``,
``blocks_freed``, ``release_victim``'s pool), so here the same contract text is
evaluated, as written in the docstrings, on every call the spec makes during runs
Hypothesis draws: each precondition that holds is followed by every postcondition.
This is sampling, not proof; it checks that no contract is false on reachable states
of the configurations the symbolic check does not build.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import replace
from types import ModuleType
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import spec.lifecycle
import spec.scheduler
from spec import (
    ConfigError,
    HashOracle,
    InvalidRequestError,
    SamplingParams,
    SchedulerConfig,
    init_state,
)
from spec.types import Semantics
from tests.drain import drain_within
from tests.stateful.strategies import engine_configs, profile_configs

TRANSITIONS: dict[ModuleType, tuple[str, ...]] = {
    spec.scheduler: (
        "release_victim",
        "schedule_running",
        "prefill_fit",
        "swap_in_requests",
        "admit_waiting",
        "schedule",
        "complete_step",
        "step",
        "grow",  # spec.prefix_cache's, as phases A and C call it
    ),
    spec.lifecycle: ("blocks_freed", "abort_request", "add_request"),
}
ORACLE = HashOracle(vocab_size=4)  # few token ids: outputs repeat, so prefixes are shared


def _conditions(function: Callable[..., Any], kind: str) -> list[str]:
    doc = inspect.getdoc(function) or ""
    return [
        line.strip()[len(kind) + 1 :]
        for line in doc.splitlines()
        if line.strip().startswith(kind + ":")
    ]


def _checked(module: ModuleType, name: str, calls: dict[str, int]) -> Callable[..., Any]:
    function = getattr(module, name)
    signature = inspect.signature(function)
    pres, posts = _conditions(function, "pre"), _conditions(function, "post")
    assert posts, f"{name} has no postcondition"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        # The caller's module's names, and the defining module's (``grow``'s ``touch``).
        scope = {**function.__globals__, **vars(module), **bound.arguments}
        if not all(eval(pre, scope) for pre in pres):
            return function(*args, **kwargs)  # outside the contract's domain
        result = function(*args, **kwargs)
        scope["__return__"] = result
        for post in posts:
            assert eval(post, scope), f"{name}: post: {post}\nargs: {bound.arguments}"
        calls[name] = calls.get(name, 0) + 1
        return result

    return wrapper


@contextmanager
def contracts_checked(calls: dict[str, int]) -> Iterator[None]:
    """Every transition replaced, in its module, by one that checks its contract (the
    spec calls its phases through module globals, so nested calls are checked too)."""
    with ExitStack() as stack:
        for module, names in TRANSITIONS.items():
            for name in names:
                stack.enter_context(mock.patch.object(module, name, _checked(module, name, calls)))
        yield


ADD = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, 3), min_size=4, max_size=12),
    st.integers(4, 16),  # max_tokens: decodes that grow past the pool
    st.integers(0, 2),  # priority
)
OPS = st.lists(
    st.one_of(
        ADD,
        ADD,  # adds twice as often: pressure on the pool, so preemptions happen
        st.tuples(st.just("step"), st.just(()), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.just(()), st.integers(0, 7), st.just(0)),
    ),
    min_size=3,
    max_size=40,
)


def _run(
    config: SchedulerConfig, ops: list[tuple[str, Any, int, int]], calls: dict[str, int]
) -> None:
    state = init_state(config)
    with contracts_checked(calls):
        for index, (op, prompt, number, priority) in enumerate(ops):
            live = spec.lifecycle.live_request_ids(state)
            if op == "add":
                with suppress(InvalidRequestError):  # too large for this config: unchanged
                    state = spec.lifecycle.add_request(
                        state,
                        f"r{index}",
                        tuple(prompt),
                        SamplingParams(max_tokens=number, priority=priority),
                    )
            elif op == "abort" and live:
                state, _ = spec.lifecycle.abort_request(state, live[number % len(live)])
            elif op == "step" and live:
                state, _ = spec.scheduler.step(state, ORACLE)
        bound = drain_within(state)
        while spec.lifecycle.has_unfinished_requests(state):
            bound.tick(state)
            state, _ = spec.scheduler.step(state, ORACLE)


@st.composite
def small_pools(draw: st.DrawFn, configs: st.SearchStrategy[SchedulerConfig]) -> SchedulerConfig:
    """A config with a GPU pool of 8-24 tokens: a few requests fill it, so victims are
    released (with the stateful suite's 8-64 tokens and these short runs, almost none was)."""
    config = draw(configs)
    tokens = draw(st.integers(8, 24))
    try:
        return replace(config, num_gpu_blocks=max(2, tokens // config.block_size))
    except ConfigError:  # a vllm-v1 max_model_len beyond the smaller pool
        reject()


RUNTIME = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RUNTIME
@given(config=small_pools(engine_configs(prefix_caching=True)), ops=OPS)
def test_contracts_hold_with_prefix_caching(config: SchedulerConfig, ops: list[Any]) -> None:
    calls: dict[str, int] = {}
    _run(config, ops, calls)
    for name in sorted(calls):
        event(f"checked {name}")


@RUNTIME
@given(
    config=small_pools(
        st.sampled_from((Semantics.VLLM_V1, Semantics.NANO_VLLM)).flatmap(profile_configs)
    ),
    ops=OPS,
)
def test_contracts_hold_under_the_peer_profiles(config: SchedulerConfig, ops: list[Any]) -> None:
    calls: dict[str, int] = {}
    _run(config, ops, calls)
    for name in sorted(calls):
        event(f"{config.semantics.value}: checked {name}")


def test_the_checker_reaches_every_transition_and_catches_a_false_contract() -> None:
    """The wrapper does check: every transition is called with its precondition met on
    a caching run, and a contract made false is reported."""
    config = SchedulerConfig(
        num_gpu_blocks=4, block_size=2, max_num_batched_tokens=8, enable_prefix_caching=True
    )
    ops: list[Any] = [
        ("add", [1, 2, 3, 1, 2], 3, 0),
        ("add", [1, 2, 3, 1, 0], 3, 0),  # hits r0's blocks [1, 2] and [3, 1] in the same step
        ("step", (), 0, 0),
        ("step", (), 0, 0),  # r0's decode needs a block: r1 is preempted, shared blocks kept
        ("add", [1, 2, 3], 4, 0),
        ("step", (), 0, 0),
        ("abort", (), 1, 0),
        ("step", (), 0, 0),
    ]
    calls: dict[str, int] = {}
    _run(config, ops, calls)
    reached = {name for names in TRANSITIONS.values() for name in names} - {"swap_in_requests"}
    assert reached <= calls.keys(), reached - calls.keys()
    original = spec.scheduler.complete_step

    def broken(state_mid: Any, plan: Any, tokens: Any) -> Any:
        after, plan = original(state_mid, plan, tokens)
        return replace(after, num_steps=state_mid.num_steps), plan  # the step not counted

    broken.__doc__ = original.__doc__
    with mock.patch.object(spec.scheduler, "complete_step", broken):
        try:
            _run(config, ops, {})
        except AssertionError as error:
            assert str(error).startswith("complete_step: post:"), error
        else:
            raise AssertionError("a false contract was not reported")
