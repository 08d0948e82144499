"""``SchedulerDifferential``: the spec against ``impl.Scheduler`` alone, with a toy model.

No torch: the real side is the engine's scheduler (queues, block manager, block
tables, swap mappings, rollback) driven by ``ToyModel``, a pure stand-in for the
model and its KV pools that reads and writes through the real block tables. The spec
samples with the same pure oracle on its own view of each prefix, so the two sides
are independent all the way to the sampled token values: a lost output, a wrong
swap copy or a block freed too early changes a token and fails
``plan_matches_spec`` (or ``kv_contents`` at the read). Much faster than the engine
machine, so it runs many more steps.
"""

from __future__ import annotations

from hypothesis import settings

import impl
import spec
from impl.scheduler import Scheduler
from spec.scheduler import oracle_tokens
from spec.types import SamplingParams, SchedulerConfig, SchedulerState, StepPlan
from tests.stateful.coverage import REQUIRED_EVENTS, UNDONE_VICTIM_EVENT
from tests.stateful.harness import run_differential
from tests.stateful.machine import DifferentialMachine
from tests.stateful.profiles import SUPPRESSED
from tests.stateful.toy import ToyModel, toy_solo

#: A small vocabulary (prompt tokens, the oracle's range), yet large enough that an EOS
#: picked among a request's solo outputs does not usually occur in its first few.
VOCAB = 64
ORACLE = spec.HashOracle(vocab_size=VOCAB, salt=7)


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class SchedulerDifferential(DifferentialMachine):
    NAME = "SchedulerDifferential"
    VOCAB = VOCAB

    scheduler: Scheduler
    toy: ToyModel

    def new_real(self, config: SchedulerConfig) -> None:
        self.scheduler = Scheduler(config, vocab_size=VOCAB)
        self.toy = ToyModel(config, ORACLE)

    def real_scheduler(self) -> Scheduler:
        return self.scheduler

    def real_step(self) -> StepPlan:
        fired = len(self.toy.fired)
        try:
            return self.scheduler.step(self.toy.forward)
        finally:
            for kind in self.toy.fired[fired:]:
                self.note(f"fault: {kind}")

    def spec_tokens(self, mid: SchedulerState, draft: StepPlan, real: StepPlan) -> dict[str, int]:
        return oracle_tokens(mid, draft, ORACLE)

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        return toy_solo(prompt, params, ORACLE)

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        self.toy.armed[kind] = when_preempting


def test_policy_registries_match() -> None:
    """Both sides register the same policy names (R9); the machines draw from them, so a
    new policy is picked up by the suite without any wiring."""
    assert sorted(spec.POLICIES) == sorted(impl.POLICIES)


def test_scheduler_differential() -> None:
    run_differential(SchedulerDifferential, REQUIRED_EVENTS | {UNDONE_VICTIM_EVENT})
