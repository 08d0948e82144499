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
from impl.scheduler_output import SchedulerOutput
from kvsched.peers.lockstep import Lockstep
from kvsched.peers.ours import SchedulerAdapter
from spec.types import SamplingParams, SchedulerConfig
from tests.stateful.coverage import REQUIRED_EVENTS, UNDONE_VICTIM_EVENT, WATERMARK_EVENT
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

    real: SchedulerAdapter
    toy: ToyModel

    def new_lockstep(self, config: SchedulerConfig) -> Lockstep:
        """The toy samples with ``ORACLE`` through the real block tables, the spec with it
        on its own view of each request (``spec_samples``)."""
        self.toy = ToyModel(config, ORACLE)
        self.real = SchedulerAdapter(config, vocab_size=VOCAB, forward=self.forward)
        return Lockstep(self.real, config, ORACLE, spec_samples=True, vocab_size=VOCAB)

    def forward(self, out: SchedulerOutput) -> list[int]:
        fired = len(self.toy.fired)
        try:
            return self.toy.forward(out)
        finally:
            for kind in self.toy.fired[fired:]:
                self.note(f"fault: {kind}")

    def real_scheduler(self) -> Scheduler:
        return self.real.scheduler

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        return toy_solo(prompt, params, ORACLE)

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        self.toy.armed[kind] = when_preempting


def test_policy_registries_match() -> None:
    """Both sides register the same policy names (R9); the machines draw from them, so a
    new policy is picked up by the suite without any wiring."""
    assert sorted(spec.POLICIES) == sorted(impl.POLICIES)


def test_scheduler_differential() -> None:
    run_differential(
        SchedulerDifferential, REQUIRED_EVENTS | {UNDONE_VICTIM_EVENT, WATERMARK_EVENT}
    )
