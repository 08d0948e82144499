"""The state both differential machines share, and one differential step.

Design card. The spec and the real thing (``impl.Scheduler`` driven by a toy model, or
the whole ``impl.LLMEngine``) receive the same operations (tests/stateful/rules.py)
through ``kvsched.peers.lockstep.Lockstep``, the project's one lockstep comparison
(``kvsched conform`` and the peer machines use it too): refusals, aborts, each step's
decisions and whole plan, and the states after every step and every rule
(tests/stateful/invariants.py), each divergence reported as the named invariant it
breaks (``compared``). Every step is also checked by ``spec.plan_violations``
(tests/stateful/step.py); the teardown drains with a derived bound and compares every
output with a solo run (tests/stateful/machine.py).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar, Concatenate, ParamSpec, TypeVar

from hypothesis import currently_in_test_context, event, target
from hypothesis.stateful import Bundle, RuleBasedStateMachine

from impl.scheduler import Scheduler
from kvsched.peers.lockstep import Diverged, Lockstep
from spec.profiles import too_large
from spec.types import (
    FinishedRequest,
    InvalidRequestError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)
from tests.stateful.coverage import RunRecord
from tests.stateful.failures import InjectedFault, InvariantViolation, require
from tests.stateful.strategies import NewRequest, fit_sizes

#: The ids of the requests added so far (live or finished), for the rules that use one.
REQUESTS: Bundle[str] = Bundle("requests")

M = TypeVar("M", bound="RecordedMachine")
P = ParamSpec("P")
R = TypeVar("R")


def checked(method: Callable[Concatenate[M, P], R]) -> Callable[Concatenate[M, P], R]:
    """Wrap a rule or an invariant: the machine is unsettled while it runs.

    One that raises leaves the machine unsettled, and the teardown then reports that
    failure instead of draining a diverged state.
    """

    def run(self: M, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.settled = False
        result = method(self, *args, **kwargs)
        self.settled = True
        return result

    functools.update_wrapper(run, method)  # its name and doc, as Hypothesis prints them
    return run


class RecordedMachine(RuleBasedStateMachine):
    """A machine ``harness.run_differential`` runs: named (its size in
    tests/stateful/profiles.py), with a run record, and unsettled while a rule runs."""

    NAME: ClassVar[str]
    #: Where the run counts its coverage and steps; ``run_differential`` gives each run
    #: a fresh one (a replayed regression program uses this default).
    record: ClassVar[RunRecord] = RunRecord()

    def __init__(self) -> None:
        super().__init__()
        self.settled = True  # False while a rule or an invariant runs (see ``checked``)

    def note(self, label: str) -> None:
        self.record.coverage[label] += 1
        if currently_in_test_context():  # a regression test replays a program without it
            event(label)


#: The invariant a divergence breaks, by the operation its field starts with.
DIVERGENCE_INVARIANTS: tuple[tuple[str, str], ...] = (
    ("plan", "plan_matches_spec"),
    ("state", "observe_matches_spec"),
    ("blocks", "observe_matches_spec"),
    ("add_request", "same_rejection"),
    ("abort_request", "same_abort"),
)


def divergence_invariant(field: str) -> str:
    return next((name for op, name in DIVERGENCE_INVARIANTS if field.startswith(op)), "lockstep")


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


class MachineBase(RecordedMachine):
    """The state and the operations that rules, invariants and teardown share.

    A subclass provides the real side in lockstep with the spec (``new_lockstep``,
    ``real_scheduler``), solo reference outputs (``solo``) and its faults.
    """

    NAME: ClassVar[str] = "DifferentialMachine"
    VOCAB: ClassVar[int] = 16
    requests: Bundle[str] = REQUESTS

    config: SchedulerConfig
    lock: Lockstep

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.next_id = 0
        self.accepted: dict[int, Accepted] = {}  # by arrival (ids may be reused)
        self.outcomes: dict[int, FinishedRequest] = {}
        self.preemptions = 0
        self.peak_gpu_used = 0
        self.peak_swapped = 0
        self.faults_fired = 0

    # --- hooks for the real side -------------------------------------------------------

    def new_lockstep(self, config: SchedulerConfig) -> Lockstep:
        """A fresh real side for ``config``, in lockstep with the spec (the machine's
        vocabulary given, so R4.3's refusals are compared too). Its ``step`` raises
        ``InjectedFault`` if an armed fault fired (and the step rolled back)."""
        raise NotImplementedError

    def real_scheduler(self) -> Scheduler:
        raise NotImplementedError

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        """The outputs of this request run alone (the reference for every output)."""
        raise NotImplementedError

    def after_step(self, mid: SchedulerState, plan: StepPlan) -> None:
        """Extra per-step checks of a subclass (called after the plans matched)."""

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        """Arm ``kind`` (one of ``FAULT_KINDS``, mapped to what the real side can fail)."""
        raise NotImplementedError

    def fault_snapshot(self) -> dict[str, object]:
        """What a rolled-back step must leave unchanged besides ``observe()``, by the name
        of the invariant that says so."""
        return {}

    # --- helpers -------------------------------------------------------------------------

    @contextmanager
    def compared(
        self, what: str, invariant: str | None = None, context: str = ""
    ) -> Iterator[None]:
        """Lockstep operations: a divergence fails the invariant its field names (or
        ``invariant``), with ``context`` before it; anything else raised (but an injected
        fault) fails ``no_crash`` as ``{what} raised ...``."""
        try:
            yield
        except Diverged as e:
            d = e.divergence
            name = invariant or divergence_invariant(d.field)
            raise InvariantViolation(name, f"{context}{d}") from None
        except (InvariantViolation, InjectedFault):
            raise
        except Exception as error:
            raise InvariantViolation("no_crash", f"{what} raised {error!r}") from error

    def target(self, value: float, label: str) -> None:
        if currently_in_test_context():
            target(value, label=label)

    def fresh_id(self, prefix: str = "r") -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def resolve(self, req: NewRequest) -> tuple[tuple[int, ...], SamplingParams]:
        """Tokens and parameters of a drawn request, clamped to fit unless ``oversize``."""
        config = self.config
        prompt_len, max_tokens = fit_sizes(config, req)
        rng = random.Random(req.salt)
        prompt = tuple(rng.randrange(self.VOCAB) for _ in range(prompt_len))
        params = SamplingParams(
            max_tokens=max_tokens,
            priority=req.priority,
            temperature=req.temperature,
            seed=req.salt,
        )
        if req.eos is not None:
            if too_large(config, prompt_len, max_tokens):
                eos = req.eos % self.VOCAB
            else:
                outputs = self.solo(prompt, params)
                eos = outputs[req.eos % len(outputs)]
            params = replace(params, eos_token_id=eos, ignore_eos=req.ignore_eos)
        return prompt, params

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        expected: type[InvalidRequestError] | None = None,
    ) -> bool:
        """Add on both sides; both must accept, or both raise the same typed error."""
        before = self.lock.state
        with self.compared("add_request", context=f"P={len(prompt)}, {params}: "):
            refused = self.lock.add(request_id, prompt, params)
        if expected is not None:
            require(
                type(refused) is expected,
                "rejection_order",
                lambda: f"expected {expected.__name__} (R4's order), got {refused!r}",
            )
        if refused is not None:
            require(
                self.lock.state is before,
                "rejection_changes_nothing",
                "the spec's state changed",
            )
            with self.compared("observe", "rejection_changes_nothing"):
                self.lock.compare_states()
            self.note(f"reject: {type(refused).__name__}")
            return False
        self.accepted[before.next_arrival] = Accepted(request_id, tuple(prompt), params)
        if params.eos_token_id is not None:
            self.note("add: with EOS (ignored)" if params.ignore_eos else "add: with EOS")
        return True

    def record_outcome(self, arrival: int, finished: FinishedRequest) -> None:
        require(
            arrival in self.accepted and arrival not in self.outcomes,
            "reported_once",
            lambda: (
                f"{finished.request_id!r} (arrival {arrival}) finished twice or was never accepted"
            ),
        )
        self.outcomes[arrival] = finished
