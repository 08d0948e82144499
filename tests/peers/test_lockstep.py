"""The lockstep driver and the protocol, with our scheduler (no peer needed)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

import impl.policies
import spec
from kvsched.peers.lockstep import Diverged, Lockstep, run_workload
from kvsched.peers.ours import SchedulerAdapter
from kvsched.peers.protocol import Hidden, Observation, decisions, make_plan
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle, TokenOracle
from spec.types import (
    ConfigError,
    FinishedRequest,
    FinishReason,
    Preemption,
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
    UnknownRequestError,
)
from tests.cli.helpers import Invoke, WriteWorkload

ORACLE = HashOracle(vocab_size=8)


def _preempting() -> list[WorkloadRequest]:
    """Three requests of 3 + 6 tokens in 6 blocks of 2: someone must be preempted."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    return [
        WorkloadRequest(request_id=f"p{i}", prompt=(i + 1, 5, 6), params=params) for i in range(3)
    ]


def _workload(n: int = 6) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(
            request_id=f"r{i}",
            prompt=tuple(range(1 + i, 4 + 2 * i)),
            params=SamplingParams(max_tokens=3 + i % 4, eos_token_id=3, ignore_eos=i % 2 == 0),
            arrival_step=i // 2,
        )
        for i in range(n)
    ]


#: Each config's run of ``_workload()``: steps, preemptions, requests refused (spec figures).
AGREED_RUNS = {
    SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=6, max_num_seqs=2): (
        19,
        1,
        0,
    ),
    SchedulerConfig(num_gpu_blocks=20, block_size=1, max_num_batched_tokens=4): (14, 0, 0),
    SchedulerConfig(
        num_gpu_blocks=4, block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False
    ): (13, 1, 0),
    SchedulerConfig(
        num_gpu_blocks=5,
        block_size=2,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=3,
        policy="priority",
    ): (13, 1, 2),
}


@pytest.mark.parametrize(
    "config", list(AGREED_RUNS), ids=["chunked-tight", "block1", "no-chunking", "swap-priority"]
)
def test_our_scheduler_agrees_with_the_spec(config: SchedulerConfig) -> None:
    """Agreement, and on the run the spec defines (steps, preemptions, refusals): an
    engine and a spec that changed together still read differently here."""
    report = run_workload(SchedulerAdapter(config), config, _workload(), ORACLE)
    assert report.divergence is None, report.divergence
    assert (report.steps, report.preemptions, report.num_rejected) == AGREED_RUNS[config]


def test_aborts_in_every_state_and_id_reuse() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=4,
        block_size=2,
        max_num_batched_tokens=4,
        preemption_mode=PreemptionMode.SWAP,
        num_cpu_blocks=2,
    )
    lock = Lockstep(SchedulerAdapter(config), config, ORACLE)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(4):
        lock.add(f"r{i}", (1 + i, 2, 3), params)
    seen: set[str] = set()
    for _ in range(40):
        if not lock.unfinished():
            break
        state = lock.state
        for queue in ("waiting", "running", "swapped"):
            requests = getattr(state, queue)
            if requests and queue not in seen:
                seen.add(queue)
                victim = requests[-1].request_id
                lock.abort(victim)
                lock.add(victim, (7, 7), params)  # the id is free again
                lock.compare_states()
                break
        else:
            lock.step()
    lock.finish()
    assert seen == {"waiting", "running", "swapped"}


class _WrongVictim(SchedulerAdapter):
    """Reports the first victim under another name: lockstep must name that field."""

    def step(self, next_token: TokenOracle) -> StepPlan:
        plan = super().step(next_token)
        if not plan.preempted:
            return plan
        first = replace(plan.preempted[0], request_id="nobody")
        return replace(plan, preempted=(first, *plan.preempted[1:]))


def test_a_wrong_plan_is_the_first_divergence() -> None:
    config = SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=8)
    report = run_workload(_WrongVictim(config), config, _preempting(), ORACLE)
    d = report.divergence
    assert d is not None
    assert d.field == "plan.preempted[0].request_id"
    assert d.engine_value == "nobody"
    assert d.spec_state is not None and d.engine_state is not None


class _HidesPreemptions(SchedulerAdapter):
    def observe(self) -> Observation:
        o = super().observe()
        state = replace(
            o.state, running=tuple(replace(r, num_preemptions=0) for r in o.state.running)
        )
        return replace(o, state=state, hidden=frozenset({Hidden.NUM_PREEMPTIONS}))


def test_hidden_fields_are_masked_on_both_sides() -> None:
    config = SchedulerConfig(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=8)
    report = run_workload(_HidesPreemptions(config), config, _preempting(), ORACLE)
    assert report.ok and report.preemptions > 0 and report.num_rejected == 0


class _LiesAboutBlocks(SchedulerAdapter):
    def observe(self) -> Observation:
        o = super().observe()
        return replace(o, blocks={rid: n + 1 for rid, n in o.blocks.items()})


def test_block_counts_are_compared() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    report = run_workload(_LiesAboutBlocks(config), config, _workload(2), ORACLE)
    assert report.divergence is not None
    assert report.divergence.field.startswith("blocks[")


def test_an_unknown_semantics_profile_is_refused() -> None:
    with pytest.raises(ConfigError, match="vllm-v1"):
        SchedulerConfig(num_gpu_blocks=8, semantics="vllm-v2")  # type: ignore[arg-type]


@pytest.mark.parametrize("semantics", list(Semantics))
def test_our_scheduler_follows_every_profile(semantics: Semantics) -> None:
    """The config's profile is the one both sides run (ours implements every one)."""
    config = SchedulerConfig(
        num_gpu_blocks=6,
        block_size=4 if semantics is Semantics.TRANSFORMERS else 2,  # its page_size >= 4
        max_num_batched_tokens=8,
        max_num_seqs=4,
        enable_chunked_prefill=semantics not in (Semantics.NANO_VLLM, Semantics.VLLM_V0),
        semantics=semantics,
    )
    report = run_workload(SchedulerAdapter(config), config, _workload(4), ORACLE)
    assert report.divergence is None, report.divergence
    steps = {"kvsched": 9, "vllm-v1": 9, "nano-vllm": 4, "vllm-v0": 9, "transformers": 6}
    assert report.steps == {**steps, "tokenspeed": 13}[semantics]


def test_plans_are_built_and_read_in_one_place() -> None:
    plan = make_plan(
        3,
        scheduled=[("a", 0, 4)],
        preempted=[Preemption(request_id="b", mode=PreemptionMode.RECOMPUTE)],
        sampled=[("a", 7)],
    )
    assert plan.scheduled[0].num_tokens == 4 and plan.sampled[0].token_id == 7
    assert decisions(plan) == replace(plan, sampled_ids=(), sampled_token_ids=())


def test_spec_and_kvsched_do_not_import_peers() -> None:
    code = (
        "import sys, spec, kvsched, kvsched.cli, kvsched.peers, kvsched.peers.lockstep; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'nanovllm')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_divergence_carries_both_states() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    lock = Lockstep(_LiesAboutBlocks(config), config, ORACLE)
    lock.add("r0", (1, 2, 3), SamplingParams(max_tokens=2))
    with pytest.raises(Diverged) as e:
        lock.compare_states()
    d = e.value.divergence
    assert d.spec_state == lock.state
    assert d.engine_state is not None and d.engine_state.blocks == {"r0": 1}
    assert spec.blocks_owned(lock.state, "r0") == (0, 0)


def test_conform_shows_both_states_on_request(
    invoke: Invoke, write_workload: WriteWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--show-states``: the verdict line, then the spec's and the engine's states."""
    monkeypatch.setattr(
        impl.policies.LifoPolicy, "select_victim", lambda self, running, start: start
    )
    lines = [
        {"id": f"r{i}", "prompt": [i + 1, 2, 3], "max_tokens": 6, "ignore_eos": True}
        for i in range(3)
    ]
    result = invoke(
        "conform", str(write_workload(lines)), "--device", "cpu", "--num-gpu-blocks", "6",
        "--block-size", "2", "--show-states",
    )  # fmt: skip
    out = result.out.splitlines()
    assert result.code == 1 and out[0].startswith("conform: DIVERGED at step ")
    assert out[1].startswith("  spec state:    SchedulerState(")
    assert out[2].startswith("  engine state:  SchedulerState(")
    assert out[3].startswith("  engine blocks: {")


# --- the hooks a driver with checks of its own uses (the stateful suite) -------------------


class _SamplesWrong(SchedulerAdapter):
    """Samples one more than the oracle: what a lost output or a wrong K/V read looks like."""

    def step(self, next_token: TokenOracle) -> StepPlan:
        return super().step(lambda tokens: (next_token(tokens) + 1) % 8)


def test_spec_samples_with_the_oracle_on_its_own_view() -> None:
    """``spec_samples``: a wrong token diverges at once; without it the spec takes the
    engine's tokens and the run agrees."""
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    trusting = Lockstep(_SamplesWrong(config), config, ORACLE)
    trusting.add("r0", (1, 2, 3), params)
    trusting.step()
    lock = Lockstep(_SamplesWrong(config), config, ORACLE, spec_samples=True)
    lock.add("r0", (1, 2, 3), params)
    with pytest.raises(Diverged) as e:
        lock.step()
    assert e.value.divergence.field == "plan.sampled[0].token_id"


def test_vocab_size_compares_the_engines_vocabulary_check() -> None:
    """With ``vocab_size`` the spec side makes R4.3's check: an engine whose vocabulary
    differs diverges; without it a refusal for a token is the engine's alone."""
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    params = SamplingParams(max_tokens=2)
    lock = Lockstep(SchedulerAdapter(config, vocab_size=8), config, ORACLE, vocab_size=8)
    assert type(lock.add("r0", (1, 9), params)).__name__ == "TokenOutOfVocabError"
    assert type(lock.add("r1", (), params)).__name__ == "EmptyPromptError"  # R4's order
    assert lock.add("r2", (1, 7), params) is None
    narrow = Lockstep(SchedulerAdapter(config, vocab_size=4), config, ORACLE, vocab_size=8)
    with pytest.raises(Diverged) as e:
        narrow.add("r0", (1, 7), params)
    assert e.value.divergence.field == "add_request('r0')"
    trusting = Lockstep(SchedulerAdapter(config, vocab_size=4), config, ORACLE)
    assert trusting.add("r0", (1, 7), params) is not None and trusting.rejected == 1


class _AbortsLoosely(SchedulerAdapter):
    """Accepts an abort of an id it does not know, and reports an aborted request's
    outputs wrongly."""

    def abort_request(self, request_id: str) -> FinishedRequest:
        if request_id not in self.scheduler.requests:
            return FinishedRequest(
                request_id=request_id,
                output_token_ids=(),
                finish_reason=FinishReason.ABORTED,
                num_preemptions=0,
            )
        return replace(super().abort_request(request_id), output_token_ids=(0,))


def test_aborts_compare_refusals_and_the_aborted_request() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    lock = Lockstep(SchedulerAdapter(config), config, ORACLE)
    lock.add("r0", (1, 2), params)
    lock.step()
    assert lock.abort("r0").output_token_ids == (ORACLE((1, 2)),)
    with pytest.raises(UnknownRequestError):
        lock.abort("r0")  # both refuse it now
    loose = Lockstep(_AbortsLoosely(config), config, ORACLE)
    with pytest.raises(Diverged) as e:
        loose.abort("ghost")
    assert e.value.divergence.engine_value == "accepted"
    loose.add("r0", (1, 2), params)
    loose.step()
    with pytest.raises(Diverged) as e:
        loose.abort("r0")
    assert e.value.divergence.field == "abort_request('r0').output_token_ids[0]"


def _last_observed(lock: Lockstep) -> SchedulerState | None:
    return None if lock.last_observed is None else lock.last_observed.state


def test_advance_gives_the_steps_states_and_last_observed_tracks_changes() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, block_size=2)
    lock = Lockstep(SchedulerAdapter(config), config, ORACLE)
    assert _last_observed(lock) == lock.state
    lock.add("r0", (1, 2, 3), SamplingParams(max_tokens=2))
    assert _last_observed(lock) is None  # the add changed the engine since the comparison
    before = lock.state
    advance = lock.advance()
    assert advance.before is before
    assert (advance.mid, advance.decided) == spec.schedule(before)
    assert advance.plan == advance.engine_plan and advance.plan.step == 0
    assert _last_observed(lock) == lock.state
