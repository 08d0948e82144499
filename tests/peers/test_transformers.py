"""transformers' continuous batching (5.19.0) through the protocol, held to the spec.

The adapter drives transformers' own ``ContinuousBatchProcessor`` loop with an oracle
model runner (``kvsched/peers/transformers_cb.py``). Under the ``transformers`` profile
it agrees with the spec through offloads, soft resets, aborts and id reuse; its three
known bugs (docs/peers.md T10-T12) fail on the pinned version with ``xfail(strict)``,
each through the standalone script maintainers can run
(``tests/peers/repros/transformers_cb_bugs.py``), and lockstep classifies each
divergence by its signature.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvsched.peers import make_peer
from kvsched.peers.known import T10, T11, T12, KnownBug, classify, installed_version
from kvsched.peers.lockstep import Diverged, Lockstep, run_workload
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, Semantics
from tests.peers.conftest import require_peer

ORACLE = HashOracle(vocab_size=8)
REPRO = Path(__file__).parent / "repros" / "transformers_cb_bugs.py"


def config(**fields: object) -> SchedulerConfig:
    defaults: dict[str, object] = {
        "num_gpu_blocks": 6,
        "block_size": 4,
        "max_num_batched_tokens": 8,
        "max_num_seqs": 4,
        "semantics": Semantics.TRANSFORMERS,
    }
    return SchedulerConfig(**{**defaults, **fields})  # type: ignore[arg-type]


def request(rid: str, prompt_len: int, max_tokens: int, arrival: int = 0) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=rid,
        prompt=tuple(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_step=arrival,
    )


#: Three requests in 6 blocks of 4: at step 4 "r1" is starved and offloaded while "r0"
#: decodes (outside the safety margin "r2", prefilling, is not reached).
PRESSURE = [request("r0", 8, 8), request("r1", 6, 8), request("r2", 10, 6)]


@pytest.mark.parametrize(
    ("mode", "num_cpu_blocks"),
    [(PreemptionMode.RECOMPUTE, 0), (PreemptionMode.SWAP, 6), (PreemptionMode.SWAP, 1)],
    ids=["soft-reset", "cpu-offload", "cpu-pool-too-small"],
)
def test_transformers_agrees_through_offloads(mode: PreemptionMode, num_cpu_blocks: int) -> None:
    require_peer("transformers")
    c = config(preemption_mode=mode, num_cpu_blocks=num_cpu_blocks)
    report = run_workload(make_peer("transformers", c), c, PRESSURE, ORACLE)
    assert report.divergence is None, report.divergence
    assert report.preemptions >= 2


def test_aborts_in_every_state_and_id_reuse() -> None:
    """Abort waiting, running and offloaded (swapped) requests; re-add the ids."""
    require_peer("transformers")
    c = config(preemption_mode=PreemptionMode.SWAP, num_cpu_blocks=6)
    lock = Lockstep(make_peer("transformers", c), c, ORACLE)
    for r in (*PRESSURE, request("r3", 3, 2)):
        lock.add(r.request_id, r.prompt, r.params)
    lock.abort("r3")  # waiting
    lock.compare_states()
    while not lock.state.swapped:
        lock.step()
    lock.abort(lock.state.swapped[0].request_id)  # offloaded to the CPU pool
    lock.compare_states()
    lock.step()
    lock.abort(lock.state.running[-1].request_id)  # running
    lock.compare_states()
    while lock.unfinished():
        lock.step()
    lock.add("r3", (9, 9, 9), SamplingParams(max_tokens=3))  # the id is free again
    while lock.unfinished():
        lock.step()
    lock.finish()


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("transformers_cb_bugs", REPRO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_pinned_version(bug: KnownBug) -> pytest.MarkDecorator:
    return pytest.mark.xfail(
        bug.covers(installed_version(bug)),
        reason=f"{bug.id} on {bug.versions}: {bug.summary}",
        raises=AssertionError,
        strict=True,
    )


@on_pinned_version(T10)
def test_t10_an_offloaded_request_runs_again_after_the_running_ones_are_cancelled() -> None:
    require_peer("transformers")
    _script().frozen_after_cancel()


@on_pinned_version(T11)
def test_t11_a_victim_that_does_not_fit_the_cpu_pool_is_soft_reset() -> None:
    require_peer("transformers")
    _script().cpu_pool_pop()


@on_pinned_version(T12)
def test_t12_a_request_that_can_never_fit_is_refused_or_harmless() -> None:
    require_peer("transformers")
    _script().oversize_request()


def _t10(lock: Lockstep) -> None:
    for r in PRESSURE:
        lock.add(r.request_id, r.prompt, r.params)
    while not lock.state.admission_frozen:
        lock.step()
    for running in lock.state.running:  # every running request is cancelled
        lock.abort(running.request_id)
    lock.compare_states()
    while lock.unfinished():
        lock.step()


def _t11(lock: Lockstep) -> None:
    arrivals = {1: [request("r2", 8, 5)], 2: [request("r0", 6, 5), request("r1", 3, 3)]}
    while lock.steps < 3 or lock.unfinished():
        for r in arrivals.get(lock.steps, []):
            lock.add(r.request_id, r.prompt, r.params)
        lock.step()


def _t12(lock: Lockstep) -> None:
    r = request("big", 7, 4)
    lock.add(r.request_id, r.prompt, r.params)


@pytest.mark.parametrize(
    ("bug", "cfg", "run"),
    [
        (T10, config(), _t10),
        (
            T11,
            config(
                num_gpu_blocks=3,
                max_num_batched_tokens=5,
                preemption_mode=PreemptionMode.SWAP,
                num_cpu_blocks=1,
            ),
            _t11,
        ),
        (T12, config(num_gpu_blocks=2, max_num_batched_tokens=16), _t12),
    ],
    ids=["T10", "T11", "T12"],
)
def test_lockstep_recognises_the_bug(
    bug: KnownBug, cfg: SchedulerConfig, run: Callable[[Lockstep], None]
) -> None:
    """On the pinned version the lockstep run diverges with the bug's signature."""
    require_peer("transformers")
    if not bug.covers(installed_version(bug)):
        pytest.skip(f"{bug.id} was confirmed on {bug.versions}")
    lock = Lockstep(make_peer("transformers", cfg), cfg, ORACLE)
    with pytest.raises(Diverged) as e:
        run(lock)
    assert classify("transformers", e.value.divergence) is bug, e.value.divergence
