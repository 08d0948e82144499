"""The transitions' PEP 316 contracts, evaluated on concrete runs under every profile and
with prefix caching on.

CrossHair's builders make states of the kvsched profile with prefix caching off only
(docs/crosshair.md, "State sizes verified"). The contracts are stated for every
profile and for caching on too (shared blocks counted once: ``blocks_in_use``,
``blocks_freed``, ``release_victim``'s pool), so here the same contract text is
evaluated, as written in the docstrings, on every call the spec makes during runs
Hypothesis draws: each precondition that holds is followed by every postcondition.
This is sampling, not proof; it checks that no contract is false on reachable states
of the configurations the symbolic check builds rarely or not at all.

Besides the transitions, the helpers that decide *which* request moves are checked at
every call: the profile's victim (``profile_victim``: each profile's rule), the
profiles' admission gates, preemption, and the pool's operations (keys, hits,
release by reference count). Runs draw requests that share a system prompt, in pools
of a few blocks, so that shared blocks are released in most runs; the tests at the
end plant a wrong gate, victim, reference count and whole-prompt hit and check that
the property finds each.
"""

from __future__ import annotations

import functools
import inspect
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import replace
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import spec.kv
import spec.lifecycle
import spec.offload
import spec.prefix_cache
import spec.profiles
import spec.reserve
import spec.scheduler
from spec import (
    ConfigError,
    HashOracle,
    InvalidRequestError,
    SamplingParams,
    SchedulerConfig,
    init_state,
)
from spec.profiles import profile_defaults
from spec.types import PreemptionMode, Semantics
from tests.drain import drain_within
from tests.oracles.pool import spec_pool_violations
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
        # the helpers that decide which request moves (issue 25)
        "profile_victim",
        "choose_victim",
        "preempt",
        "full_sequence_fits",
        "whole_sequence_admissible",
        "longest_hit",
        "schedule_reserving",  # spec.reserve's, as schedule calls it (tokenspeed)
    ),
    spec.offload: ("walk", "offload", "schedule_offloading"),  # transformers
    spec.lifecycle: ("blocks_freed", "abort_request", "add_request"),
    spec.prefix_cache: (
        "block_key",
        "max_hit_blocks",
        "touch",
        "take",
        "release",
        "release_dropping_keys",
    ),
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
        # The caller's module's names, and the defining module's (``grow``'s ``touch``;
        # a planted copy's contract is its original's, in the original's module).
        home = vars(sys.modules[function.__module__])
        scope = {**vars(module), **home, **bound.arguments}
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
SYSTEM = (1, 2, 3, 0)
"""A system prompt several requests share: whole blocks for block sizes 1, 2 and 4."""
ADD_SHARED = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, 3), max_size=4).map(lambda own: [*SYSTEM, *own]),
    st.integers(2, 8),
    st.integers(0, 2),
)
OPS = st.lists(
    st.one_of(
        ADD,
        ADD_SHARED,  # adds twice as often: pressure on the pool, so preemptions happen,
        ADD_SHARED,  # and on one prefix, so shared blocks are released
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
        assert spec_pool_violations(state) == []


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
        st.sampled_from((Semantics.VLLM_V1, Semantics.NANO_VLLM, Semantics.VLLM_V0)).flatmap(
            profile_configs
        )
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
    # No swap with caching on; nano-vllm's release is the peer profile test's, the steps
    # of transformers and tokenspeed are the seeded test's below.
    unreached = {
        "swap_in_requests",
        "release_dropping_keys",
        "schedule_reserving",
        *TRANSITIONS[spec.offload],
    }
    reached = {name for names in TRANSITIONS.values() for name in names} - unreached
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


# --- planted mistakes: the property must find each ---------------------------------------

SEEDED_RUNS = 24


def _seeded_ops(rng: random.Random) -> list[tuple[str, Any, int, int]]:
    """What ``OPS`` draws, from a seeded generator (the same runs every time)."""
    ops: list[tuple[str, Any, int, int]] = []
    for _ in range(rng.randint(8, 30)):
        kind = rng.choice(("add", "shared", "shared", "step", "step", "abort"))
        if kind == "add":
            prompt = [rng.randint(0, 3) for _ in range(rng.randint(4, 12))]
            ops.append(("add", prompt, rng.randint(4, 16), rng.randint(0, 2)))
        elif kind == "shared":
            own = [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
            ops.append(("add", [*SYSTEM, *own], rng.randint(2, 8), rng.randint(0, 2)))
        else:
            ops.append((kind, (), rng.randint(0, 7), 0))
    return ops


def _seeded_config(rng: random.Random, semantics: Semantics, caching: bool) -> SchedulerConfig:
    """A small pool (4-12 blocks of 2 or 4) under ``semantics``, with caching on or off;
    under vllm-v1 the ``priority`` policy on half of the runs; under vllm-v0 and
    transformers swap preemption (a CPU pool of 0-8 blocks) on half of the runs."""
    defaults = profile_defaults(semantics)
    chunked = defaults.get("enable_chunked_prefill", True)
    priority = semantics is Semantics.VLLM_V1 and rng.random() < 0.5
    swaps = semantics in (Semantics.VLLM_V0, Semantics.TRANSFORMERS) and rng.random() < 0.5
    while True:
        try:
            return SchedulerConfig(
                preemption_mode=PreemptionMode.SWAP if swaps else PreemptionMode.RECOMPUTE,
                num_cpu_blocks=rng.randint(0, 8) if swaps else 0,
                num_gpu_blocks=rng.randint(4, 12),
                block_size=rng.choice((2, 4)),
                max_num_batched_tokens=rng.choice((4, 8, 16)),
                max_num_seqs=rng.choice((2, 3, 4)),
                enable_chunked_prefill=chunked,
                enable_prefix_caching=caching,
                policy="priority" if priority else "lifo",
                semantics=semantics,
            )
        except ConfigError:  # e.g. vllm-v1's max_model_len beyond the budget
            continue


def _runs_caught(
    module: ModuleType,
    name: str,
    broken: Callable[..., Any],
    semantics: Semantics,
    caching: bool,
) -> int:
    """How many of ``SEEDED_RUNS`` seeded runs fail a contract with ``module.name``
    replaced by ``broken`` (which keeps the original's contract)."""
    original = getattr(module, name)
    planted = functools.wraps(original)(broken)
    caught = 0
    with mock.patch.object(module, name, planted):
        for seed in range(SEEDED_RUNS):
            rng = random.Random(seed)
            config = _seeded_config(rng, semantics, caching)
            try:
                _run(config, _seeded_ops(rng), {})
            except AssertionError:
                caught += 1
    return caught


@pytest.mark.parametrize("semantics", [Semantics.TRANSFORMERS, Semantics.TOKENSPEED])
def test_contracts_hold_under_transformers_and_tokenspeed(semantics: Semantics) -> None:
    """Their steps (``spec.offload``, ``spec.reserve``) on the seeded runs: every contract
    holds, and the step's own is checked in most runs (not in one whose every request was
    refused)."""
    step = "schedule_offloading" if semantics is Semantics.TRANSFORMERS else "schedule_reserving"
    checked = 0
    for seed in range(SEEDED_RUNS):
        rng = random.Random(seed)
        calls: dict[str, int] = {}
        _run(_seeded_config(rng, semantics, False), _seeded_ops(rng), calls)
        checked += bool(calls.get(step))
    assert checked >= SEEDED_RUNS * 3 // 4, f"{step} checked in {checked} of {SEEDED_RUNS} runs"


def test_a_wrong_full_sequence_gate_fails_under_vllm_v1() -> None:
    """vllm-v1/full-sequence-admission off by one: admits a sequence one block over."""
    original = spec.profiles.full_sequence_fits

    def broken(config: Any, request: Any, free: int, **hit: int) -> bool:
        return bool(original(config, request, free + 1, **hit))

    caught = _runs_caught(spec.scheduler, "full_sequence_fits", broken, Semantics.VLLM_V1, False)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_gate_that_ignores_the_budget_fails_under_nano_vllm() -> None:
    """nano-vllm/admission-tests-len-seq testing the blocks only."""
    original = spec.profiles.whole_sequence_admissible

    def broken(config: Any, request: Any, budget: int, free: int) -> bool:
        return bool(original(config, request, 10**9, free))

    caught = _runs_caught(
        spec.scheduler, "whole_sequence_admissible", broken, Semantics.NANO_VLLM, True
    )
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_wrong_chunk_gate_fails_under_kvsched() -> None:
    """kvsched's own gate (``prefill_fit``) admitting a chunk one block over the free ones."""
    original = spec.scheduler.prefill_fit

    def broken(request: Any, config: Any, *, free: int, **rest: int) -> int:
        return int(original(request, config, free=free + 1, **rest))

    caught = _runs_caught(spec.scheduler, "prefill_fit", broken, Semantics.KVSCHED, False)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_wrong_victim_fails_under_nano_vllm_and_vllm_v1() -> None:
    """The last running request as the victim (kvsched's ``lifo``), where nano-vllm takes
    the next one and vllm-v1 with ``priority`` the latest of all running."""

    def broken(config: Any, policy: Any, running: tuple[Any, ...], i: int) -> int:
        return len(running) - 1

    nano = _runs_caught(spec.scheduler, "profile_victim", broken, Semantics.NANO_VLLM, True)
    assert nano >= 1, f"nano-vllm: caught in {nano} of {SEEDED_RUNS} runs"
    vllm = _runs_caught(spec.scheduler, "profile_victim", broken, Semantics.VLLM_V1, True)
    assert vllm >= 1, f"vllm-v1: caught in {vllm} of {SEEDED_RUNS} runs"


def test_a_shared_block_freed_early_fails_in_most_runs() -> None:
    """PC6 with a reference count off by one: a block one other request holds is freed.
    Runs share a system prompt, so this is met in most of them, not one in hundreds."""
    original = spec.prefix_cache.release

    def broken(cache: Any, block_ids: Any, others: Any) -> Any:
        return original(cache, block_ids, {b: n - 1 for b, n in others.items() if n > 1})

    caught = _runs_caught(spec.prefix_cache, "release", broken, Semantics.KVSCHED, True)
    assert caught >= SEEDED_RUNS // 2, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_whole_prompt_hit_fails() -> None:
    """PC3: a block-aligned prompt hitting the cache whole (no token left to compute)."""

    def broken(num_tokens: int, block_size: int) -> int:
        return num_tokens // block_size

    caught = _runs_caught(spec.prefix_cache, "max_hit_blocks", broken, Semantics.KVSCHED, True)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_wrong_victim_and_gate_fail_under_vllm_v0() -> None:
    """vllm-v0 takes the last running request (lifo) and admits within the free blocks
    less its watermark: the current request as the victim (under kvsched's ``lifo`` too),
    and a chunk one block over the free ones, are each caught."""

    def first_candidate(config: Any, policy: Any, running: tuple[Any, ...], i: int) -> int:
        return i

    for semantics in (Semantics.VLLM_V0, Semantics.KVSCHED):
        victim = _runs_caught(spec.scheduler, "profile_victim", first_candidate, semantics, False)
        assert victim >= 1, f"{semantics} victim: caught in {victim} of {SEEDED_RUNS} runs"
    original = spec.scheduler.prefill_fit

    def one_over(request: Any, config: Any, *, free: int, **rest: int) -> int:
        return int(original(request, config, free=free + 1, **rest))

    gate = _runs_caught(spec.scheduler, "prefill_fit", one_over, Semantics.VLLM_V0, False)
    assert gate >= 1, f"gate: caught in {gate} of {SEEDED_RUNS} runs"


def test_a_short_reserve_fails_under_tokenspeed() -> None:
    """tokenspeed/reserve-generation's admission gate reserving one block less than the
    generation's (the request is then admitted one block over the free ones)."""
    original = spec.profiles.generation_blocks

    def short(config: Any, request: Any) -> int:
        return int(original(config, request)) - 1

    caught = _runs_caught(spec.reserve, "generation_blocks", short, Semantics.TOKENSPEED, False)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_a_gate_one_block_short_fails_under_transformers() -> None:
    """transformers' walk counting a chunk's blocks one short (a candidate is scheduled
    one block over the free ones)."""
    original = spec.kv.blocks_held  # what spec.offload imported

    def short(num_tokens: int, block_size: int) -> int:
        return max(int(original(num_tokens, block_size)) - 1, 0)

    caught = _runs_caught(spec.offload, "blocks_held", short, Semantics.TRANSFORMERS, False)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_an_offload_that_leaves_admission_open_fails_under_transformers() -> None:
    """transformers/admission-frozen (T9): an offload that does not freeze admission."""

    def open_after(frozen: bool, offloaded: bool, finished: bool) -> bool:
        return frozen and not finished

    caught = _runs_caught(
        spec.offload, "admission_frozen_after", open_after, Semantics.TRANSFORMERS, False
    )
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"


def test_the_oldest_starved_as_victims_fails_under_transformers() -> None:
    """transformers/offload-starved (T5) offloading the oldest starved requests, not the
    newest (kvsched's own victim is the last candidate too)."""

    def oldest(requests: list[Any], count: int) -> list[Any]:
        return requests[:count]

    caught = _runs_caught(spec.offload, "newest_starved", oldest, Semantics.TRANSFORMERS, False)
    assert caught >= 1, f"caught in {caught} of {SEEDED_RUNS} runs"
