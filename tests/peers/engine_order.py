"""Scenarios that drive vLLM's scheduler as ``EngineCore`` does with async scheduling
(the config's ``async_scheduling``) or n-gram speculative decoding
(``kvsched.peers.vllm_v1.VllmOptions``) on, their traces, and (async) their lockstep
with the spec.

Each scenario is a small workload on a small pool, chosen so that one behaviour of the
peer shows in its ``EngineStep`` records: an output in flight when its request finishes,
is preempted or aborted; drafts all, none or partly accepted; a stop inside an accepted
run. ``tests/peers/test_vllm_engine_order.py`` asserts what each shows;
``scripts/vllm_engine_steps.py`` prints the traces (docs/design/async-scheduling.md cites
the source lines).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvsched.peers.lockstep import Lockstep
from kvsched.peers.vllm_v1 import EngineStep, VllmAdapter, VllmOptions
from spec.oracle import (
    ConstantOracle,
    Drafter,
    HashOracle,
    OracleDrafter,
    PromptLookupDrafter,
    TokenOracle,
)
from spec.types import SamplingParams, SchedulerConfig, SchedulerState, Semantics

ORACLE = HashOracle(vocab_size=8)
NGRAM = PromptLookupDrafter(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
SPEC = VllmOptions(speculative=NGRAM)


Arrival = tuple[int, str, tuple[int, ...], SamplingParams]  # step, id, prompt, params


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    config: SchedulerConfig
    requests: tuple[Arrival, ...]
    options: VllmOptions = field(default_factory=VllmOptions)
    oracle: TokenOracle = ORACLE
    drafter: Drafter | None = None
    aborts: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # before step n


def vllm_config(**fields: int | bool) -> SchedulerConfig:
    values: dict[str, int | bool] = {
        "num_gpu_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        **fields,
    }
    return SchedulerConfig(semantics=Semantics.VLLM_V1, **values)  # type: ignore[arg-type]


def params(max_tokens: int, eos: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, eos_token_id=eos, ignore_eos=eos is None)


def asynchronous(config: SchedulerConfig) -> SchedulerConfig:
    """``config`` with async scheduling on (vLLM's ``AsyncScheduler``, its batch queue)."""
    return replace(config, async_scheduling=True)


def drafting(config: SchedulerConfig) -> SchedulerConfig:
    """``config`` with ``SPEC``'s drafts per step (vllm-v1/spec-*)."""
    return replace(config, num_speculative_tokens=NGRAM.num_speculative_tokens)


def tight() -> SchedulerConfig:
    """Three blocks of two: r0 (3 tokens) and r1 (2) fill them; the first decode that
    needs a block preempts r1."""
    return vllm_config(num_gpu_blocks=3, block_size=2, max_num_batched_tokens=8, max_model_len=6)


TIGHT_PAIR = ((0, "r0", (1, 2, 3), params(2)), (0, "r1", (4, 5), params(3)))
ONE = ((0, "r0", (1, 2, 3), params(9)),)

SCENARIOS: dict[str, Scenario] = {
    "async-decode": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=8)),
        requests=((0, "r0", (1, 2, 3, 4, 5), params(3)), (0, "r1", (9, 8, 7), params(4, eos=3))),
    ),
    "async-eos-in-flight": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=8)),
        requests=((0, "r0", (1, 2, 3), params(5, eos=0)),),
        oracle=ConstantOracle(0),
    ),
    "async-preempt-in-flight": Scenario(config=asynchronous(tight()), requests=TIGHT_PAIR),
    "async-abort-in-flight": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=8)),
        requests=((0, "r0", (1, 2, 3), params(5)), (0, "r1", (5, 6), params(3))),
        aborts={2: ("r0",)},
    ),
    # r0 is aborted with its decode in flight and its id used again at once: the output
    # in flight is dropped, not given to the new r0 (vLLM's internal ids).
    "async-id-reused-in-flight": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=8)),
        requests=((0, "r0", (1, 2, 3), params(5)), (2, "r0", (7, 6), params(2))),
        aborts={2: ("r0",)},
    ),
    # ORACLE samples 5 after (4, 5): r1's first output is its EOS; r0's decode then needs
    # the block r1 holds.
    "async-victim-already-stopped": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=2, block_size=2, max_num_batched_tokens=8)),
        requests=((0, "r0", (1, 2), params(2)), (0, "r1", (4, 5), params(2, eos=5))),
    ),
    # ORACLE continues (1, 2, 3) with 5: r1's prompt starts with r0's first full block.
    "async-prefix-keys": Scenario(
        config=asynchronous(vllm_config(num_gpu_blocks=8, enable_prefix_caching=True)),
        requests=((0, "r0", (1, 2, 3), params(3)), (1, "r1", (1, 2, 3, 5, 9), params(2))),
    ),
    "spec-all-accepted": Scenario(
        config=drafting(vllm_config()),
        requests=ONE,
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 3),
    ),
    "spec-none-accepted": Scenario(
        config=drafting(vllm_config()),
        requests=ONE,
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 0),
    ),
    "spec-partly-accepted": Scenario(
        config=drafting(vllm_config()),
        requests=ONE,
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 1),
    ),
    # ORACLE continues (1, 2, 3) with 5, 6, 0, 4, 1, ...: the third draft of step 1 is 4.
    "spec-eos-in-run": Scenario(
        config=drafting(vllm_config()),
        requests=((0, "r0", (1, 2, 3), params(9, eos=4)),),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 3),
    ),
    "spec-max-tokens-mid-run": Scenario(
        config=drafting(vllm_config()),
        requests=((0, "r0", (1, 2, 3), params(3)),),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 3),
    ),
    "spec-max-model-len": Scenario(
        config=drafting(vllm_config(max_model_len=9)),
        requests=((0, "r0", (1, 2, 3), params(20)),),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 3),
    ),
    "spec-budget": Scenario(
        config=drafting(vllm_config(max_num_batched_tokens=6)),
        requests=((0, "r0", (1, 2), params(3)), (0, "r1", (3, 4), params(3))),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 3),
    ),
    "spec-padded-new-decode": Scenario(
        config=drafting(vllm_config()),
        requests=((0, "r0", (1, 2, 3), params(4)), (1, "r1", (7,), params(3))),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 1),
    ),
    "spec-preempt-with-drafts": Scenario(
        config=drafting(
            vllm_config(
                num_gpu_blocks=5, block_size=2, max_model_len=10, enable_prefix_caching=True
            )
        ),
        requests=((0, "r0", (1, 2, 3), params(5)), (0, "r1", (4, 5), params(5))),
        options=SPEC,
        drafter=OracleDrafter(ORACLE, 3, 1),
    ),
    "spec-prompt-lookup": Scenario(
        config=drafting(vllm_config()),
        requests=((0, "r0", (1, 2, 3, 1, 2, 3, 1, 2), params(6)),),
        options=SPEC,
    ),
}


def synchronous(scenario: Scenario) -> Scenario:
    """The same scenario with async scheduling and speculative decoding off."""
    config = replace(scenario.config, async_scheduling=False, num_speculative_tokens=0)
    return replace(scenario, config=config, options=VllmOptions(), drafter=None)


@dataclass(frozen=True, slots=True)
class Trace:
    steps: tuple[EngineStep, ...]
    states: tuple[SchedulerState, ...]  # the peer's state after each step (observe())
    outputs: Mapping[str, tuple[int, ...]]  # every request's outputs when it finished
    reasons: Mapping[str, str]
    adapter: VllmAdapter


def trace(scenario: Scenario, *, max_steps: int = 100) -> Trace:
    """Run ``scenario`` to the end, recording every step."""
    adapter = VllmAdapter(scenario.config, scenario.options, drafter=scenario.drafter)
    pending = sorted(scenario.requests, key=lambda arrival: arrival[0])
    steps: list[EngineStep] = []
    states: list[SchedulerState] = []
    outputs: dict[str, tuple[int, ...]] = {}
    reasons: dict[str, str] = {}
    while pending or adapter.has_unfinished_requests():
        if len(steps) >= max_steps:
            raise AssertionError(f"no drain within {max_steps} steps")
        for rid in scenario.aborts.get(len(steps), ()):  # first: an id may come back
            adapter.abort_request(rid)
        while pending and pending[0][0] <= len(steps):
            _, rid, prompt, request_params = pending.pop(0)
            adapter.add_request(rid, prompt, request_params)
        adapter.step(scenario.oracle)
        assert adapter.last_step is not None
        steps.append(adapter.last_step)
        states.append(adapter.observe().state)
        for done in adapter.last_step.finished:
            outputs[done.request_id] = done.output_token_ids
            reasons[done.request_id] = done.finish_reason.value
    return Trace(
        steps=tuple(steps), states=tuple(states), outputs=outputs, reasons=reasons, adapter=adapter
    )


def lockstep(scenario: Scenario, *, max_steps: int = 100) -> int:
    """Run ``scenario`` in lockstep with the spec (``Diverged`` at the first difference:
    decisions, applied outputs, every request's counters, the batches in flight); the
    number of steps it took."""
    adapter = VllmAdapter(scenario.config, scenario.options, drafter=scenario.drafter)
    lock = Lockstep(
        adapter, scenario.config, scenario.oracle, spec_samples=True, drafter=adapter.drafter
    )
    pending = sorted(scenario.requests, key=lambda arrival: arrival[0])
    while pending or lock.unfinished():
        if lock.steps >= max_steps:
            raise AssertionError(f"no drain within {max_steps} steps")
        for rid in scenario.aborts.get(lock.steps, ()):
            lock.abort(rid)
        while pending and pending[0][0] <= lock.steps:
            _, rid, prompt, request_params = pending.pop(0)
            lock.add(rid, prompt, request_params)
        lock.step()
    lock.finish()
    return lock.steps
