"""CrossHair has teeth here, and the full check is wired up (docs/crosshair.md).

The planted-bug tests run CrossHair as a subprocess with a small budget, the way
``scripts/crosshair_check`` runs it; together they take a few seconds. The full check
(minutes) is ``scripts/crosshair_check``, which ``scripts/check`` runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from impl.policies import POLICIES as IMPL_POLICIES
from spec.invariants import state_violations
from spec.policies import POLICIES as SPEC_POLICIES
from spec.scheduler import schedule
from spec.types import (
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
)
from tests.crosshair import adapters
from tests.crosshair.planted import PLANTED, PlantedBug
from tests.crosshair.runner import (
    BUDGET_HEAVY,
    Run,
    Target,
    audit_sources,
    evaluate,
    run_planted,
)

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests/crosshair/broken_helpers.py"


def crosshair(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "crosshair", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_check_reports_the_planted_bugs_with_counterexamples() -> None:
    """``blocks_needed`` off by one and the LIFO victim taken from the wrong end, each
    under the contract of the spec function it copies: exit 1, a counterexample each."""
    result = crosshair("check", BROKEN, "--per_condition_timeout=5")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    off_by_one = [line for line in lines if "when calling blocks_needed_off_by_one(" in line]
    wrong_end = [line for line in lines if "when calling lifo_victim_wrong_end(" in line]
    assert off_by_one, result.stdout
    assert wrong_end, result.stdout
    for line in (*off_by_one, *wrong_end):
        assert ": error: false when calling " in line, line
        assert "(which returns " in line, line  # the counterexample's result


def test_diffbehavior_reports_a_planted_engine_difference() -> None:
    """An engine-style ``need`` with the held blocks rounded down differs from the spec."""
    result = crosshair(
        "diffbehavior",
        "tests.crosshair.adapters.spec_blocks_needed",
        "tests.crosshair.broken_helpers.engine_blocks_needed_floor",
        "--per_condition_timeout=5",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Given: (num_computed_tokens=" in result.stdout, result.stdout
    assert "engine_blocks_needed_floor : returns" in result.stdout, result.stdout


def test_every_contract_in_the_spec_is_a_crosshair_target() -> None:
    """The source audit finds no contract CrossHair would skip and no public function
    without one; the transitions are among the heavy (whole-state) targets."""
    audit = audit_sources()
    assert audit.problems == []
    heavy = {t.name for t in audit.targets if t.heavy}
    for name in (
        "spec.scheduler.step",
        "spec.scheduler.schedule",
        "spec.scheduler.complete_step",
        "spec.lifecycle.add_request",
        "spec.lifecycle.abort_request",
    ):
        assert name in heavy


def test_every_registered_policy_has_its_diffbehavior_pairs() -> None:
    assert set(SPEC_POLICIES) == set(IMPL_POLICIES)
    for name in SPEC_POLICIES:
        for kind in ("victim", "admit"):
            spec_fn, impl_fn = adapters.PAIRS[f"{kind}_{adapters.slug(name)}"]
            assert callable(getattr(adapters, spec_fn.rsplit(".", 1)[1]))
            assert callable(getattr(adapters, impl_fn.rsplit(".", 1)[1]))


def test_the_runner_fails_on_what_crosshair_did_not_analyse() -> None:
    """A postcondition without a report line, or one CrossHair could not get past the
    precondition of, fails the run (status 2); a counterexample fails it with 1."""
    spec_file = ROOT / "spec" / "kv.py"
    target = Target("spec.kv.f", spec_file, [10, 11, 12], heavy=False)

    def output(*lines: str, code: int = 0) -> Run:
        return Run(["crosshair"], code, "\n".join(lines), 1.0)

    ok = evaluate(
        [target],
        [
            output(
                f"{spec_file}:10: info: Confirmed over all paths.",
                f"{spec_file}:11: info: Not confirmed.",
                f"{spec_file}:12: info: Not confirmed.",
            )
        ],
    )
    assert ok.status == 0
    assert ok.tally == {"confirmed": 1, "explored": 2}
    unanalysed = evaluate(
        [target],
        [
            output(
                f"{spec_file}:10: info: Unable to meet precondition.",
                f"{spec_file}:11: info: Not confirmed.",
            )
        ],
    )
    assert unanalysed.status == 2
    assert len(unanalysed.problems) == 2  # line 10 unmet, line 12 missing
    found = evaluate(
        [target],
        [
            output(
                f"{spec_file}:10: error: false when calling f(1) (which returns 0)",
                f"{spec_file}:11: info: Not confirmed.",
                f"{spec_file}:12: info: Not confirmed.",
                code=1,
            )
        ],
    )
    assert found.status == 1
    assert found.errors == [f"{spec_file}:10: error: false when calling f(1) (which returns 0)"]
    # A counterexample is a finding even when another condition got no line (CrossHair
    # may stop a function's search at its first counterexample): 1, not 2.
    cut_short = evaluate(
        [target],
        [output(f"{spec_file}:10: error: false when calling f(1) (which returns 0)", code=1)],
    )
    assert cut_short.status == 1
    assert cut_short.tally == {"counterexample": 1, "unanalysed": 2}
    crashed = evaluate([target], [output(code=2)])
    assert crashed.status == 2
    # A callee's precondition broken inside the analysed function is reported at the
    # call's line: the (single) condition's counterexample, not "unanalysed".
    single = Target("spec.kv.g", spec_file, [20], heavy=False)
    callee = evaluate(
        [single],
        [
            output(
                f'{spec_file}:26: error: PreconditionFailed: Precondition "n >= 0" was not '
                'satisfied before calling "h" when calling g(-2)',
                code=1,
            )
        ],
    )
    assert callee.status == 1
    assert callee.tally == {"counterexample": 1}


def test_the_state_crosshair_found_is_now_invalid() -> None:
    """CrossHair's counterexample to ``head_progresses`` (docs/crosshair.md): restart
    mode, chunked prefill off, a swapped request whose swap-in exceeds the budget. It
    is never served, and it passed every rule until R6 said that only swap mode swaps.
    """
    config = SchedulerConfig(
        num_gpu_blocks=3,
        block_size=1,
        max_num_batched_tokens=1,
        max_num_seqs=1,
        enable_chunked_prefill=False,
        preemption_mode=PreemptionMode.RESTART,
        num_cpu_blocks=1,
        policy="reserve",
    )
    swapped = RequestState(
        request=Request(
            request_id="r0",
            prompt_token_ids=(0,),
            params=SamplingParams(max_tokens=3, eos_token_id=0, ignore_eos=True),
            arrival=0,
        ),
        output_token_ids=(0, 0),
        num_computed_tokens=1,
    )
    state = SchedulerState(
        config=config,
        num_free_gpu_blocks=3,
        num_free_cpu_blocks=0,
        swapped=(swapped,),
        next_arrival=1,
    )
    assert schedule(state)[1].scheduled == ()  # never served
    assert [v for v in state_violations(state) if v.startswith("R6")] == [
        "R6: request 'r0' is swapped, but restart mode never swaps"
    ]
    waiting = replace(swapped, num_computed_tokens=0)
    state = replace(state, swapped=(), waiting=(waiting,), num_free_cpu_blocks=1)
    assert schedule(state)[1].scheduled == ()  # its 3-token re-prefill exceeds the budget
    assert [v for v in state_violations(state) if v.startswith("R6")] == [
        "R6: waiting request 'r0' kept outputs, but restart mode drops them"
    ]


def test_the_planted_table_covers_every_area() -> None:
    """Every area the table is meant to cover has a bug that changes something. (That
    each still applies to the spec's source is ``scripts/check_anchors.py``'s to say: an
    edit that keeps behaviour is no failure of the suite.)"""
    assert all(bug.old != bug.new for bug in PLANTED)
    assert len({bug.name for bug in PLANTED}) == len(PLANTED) >= 12
    areas = {bug.where for bug in PLANTED}
    for area in ("phase A", "swap-in", "swap-out", "admission arithmetic", "preemption"):
        assert area in areas
    # issue 25: every profile's rules and the transitions over a prefix-cache pool
    for profile in ("vllm-v1", "nano-vllm", "vllm-v0", "transformers", "tokenspeed"):
        assert any(f"({profile})" in area for area in areas), profile
    assert "admission (caching)" in areas and "preemption (caching)" in areas
    for queue in ("waiting", "running", "swapped"):
        assert f"abort ({queue})" in areas
    # issue 20: the speculative rules, where CrossHair builds the values (a helper's own
    # contract: the symbolic builders make no state with drafts)
    assert "speculative decoding (vllm-v1)" in areas
    # Phase D: its body is complete_verified_step's (complete_step is it with runs of one).
    assert any(bug.target == "spec.scheduler.complete_verified_step" for bug in PLANTED)


def test_the_planted_stage_finds_a_bug_and_not_a_harmless_edit() -> None:
    """The stage's machinery: a planted bug in ``prefill_fit`` is reported with its
    counterexample; an edit that changes nothing the contract sees (a renamed local) is
    not, so "found" means a counterexample in the copy, not any output."""
    bug = next(b for b in PLANTED if b.name == "C-admit-free-off-by-one")
    found = run_planted(bug, BUDGET_HEAVY, timeout=120)
    assert found.found, found.line
    assert "spec/scheduler.py" in found.line and "error: false when calling" in found.line
    harmless = PlantedBug(
        name="harmless",
        where="none",
        bug="a local renamed",
        file="scheduler.py",
        old="    if n > budget or blocks_held(start + n, config.block_size) - num_hit > free:\n",
        new=(
            "    if (m := n) > budget or "
            "blocks_held(start + m, config.block_size) - num_hit > free:\n"
        ),
        target="spec.scheduler.prefill_fit",
    )
    missed = run_planted(harmless, 1.0, timeout=120)
    assert not missed.found, missed.line
