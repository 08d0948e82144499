"""The state both differential machines share, and one differential step.

Design card. The reference model (``SpecModel``) and the real thing
(``impl.Scheduler`` driven by a toy model, or the whole ``impl.LLMEngine``) receive the
same operations (tests/stateful/rules.py). After every rule, small named invariants
compare them (tests/stateful/invariants.py); every step's plan is compared in full
and checked by ``spec.plan_violations`` (``do_step`` here); the teardown drains with a
derived bound and compares every output with a solo run (tests/stateful/machine.py).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Concatenate, ParamSpec, TypeVar

from hypothesis import currently_in_test_context, event, target
from hypothesis.stateful import Bundle, RuleBasedStateMachine

from impl.scheduler import Scheduler
from spec.profiles import model_len, too_large
from spec.types import (
    FinishedRequest,
    InvalidRequestError,
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)
from tests.stateful.coverage import RunRecord
from tests.stateful.diffs import state_diff
from tests.stateful.failures import InvariantViolation, require
from tests.stateful.reference import SpecModel
from tests.stateful.strategies import NewRequest

#: The ids of the requests added so far (live or finished), for the rules that use one.
REQUESTS: Bundle[str] = Bundle("requests")

M = TypeVar("M", bound="MachineBase")
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


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


class MachineBase(RuleBasedStateMachine):
    """The state and the operations that rules, invariants and teardown share.

    A subclass provides the real side (``new_real``, ``real_*``), the tokens the spec
    is given (``spec_tokens``), solo reference outputs (``solo``) and its faults.
    """

    NAME: ClassVar[str] = "DifferentialMachine"
    VOCAB: ClassVar[int] = 16
    #: Where the run counts its coverage and steps; ``run_differential`` gives each run
    #: a fresh one (a replayed regression program uses this default).
    record: ClassVar[RunRecord] = RunRecord()
    requests: Bundle[str] = REQUESTS

    config: SchedulerConfig
    spec: SpecModel

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.settled = True  # False while a rule or an invariant runs (see ``checked``)
        self.next_id = 0
        self.accepted: dict[int, Accepted] = {}  # by arrival (ids may be reused)
        self.outcomes: dict[int, FinishedRequest] = {}
        self.preemptions = 0
        self.peak_gpu_used = 0
        self.peak_swapped = 0
        self.faults_fired = 0

    # --- hooks for the real side -------------------------------------------------------

    def new_real(self, config: SchedulerConfig) -> None:
        raise NotImplementedError

    def real_scheduler(self) -> Scheduler:
        raise NotImplementedError

    def real_add(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        self.real_scheduler().add_request(request_id, prompt, params)

    def real_abort(self, request_id: str) -> FinishedRequest:
        return self.real_scheduler().abort_request(request_id)

    def real_observe(self) -> SchedulerState:
        return self.real_scheduler().observe()

    def real_step(self) -> StepPlan:
        """One real step; ``InjectedFault`` if an armed fault fired (and it rolled back)."""
        raise NotImplementedError

    def spec_tokens(self, mid: SchedulerState, draft: StepPlan, real: StepPlan) -> dict[str, int]:
        """The sampled tokens the spec's phase D is given."""
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

    def note(self, label: str) -> None:
        self.record.coverage[label] += 1
        if currently_in_test_context():  # a regression test replays a program without it
            event(label)

    def target(self, value: float, label: str) -> None:
        if currently_in_test_context():
            target(value, label=label)

    def fresh_id(self, prefix: str = "r") -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def resolve(self, req: NewRequest) -> tuple[tuple[int, ...], SamplingParams]:
        """Tokens and parameters of a drawn request, clamped to fit unless ``oversize``."""
        config = self.config
        prompt_len, max_tokens = req.prompt_len, req.max_tokens
        length = model_len(config)
        if length is not None:
            # vllm-v1/max-model-len: the prompt must be shorter; max_tokens is not capped,
            # so requests also stop at max_model_len.
            if not req.oversize:
                prompt_len = min(prompt_len, length - 1)
        elif not req.oversize:
            cap = config.num_gpu_blocks * config.block_size  # L = P + M - 1 <= cap (R4)
            if not config.enable_chunked_prefill:
                if config.preemption_mode is PreemptionMode.RESTART:
                    prompt_len = min(prompt_len, config.max_num_batched_tokens)
                else:
                    cap = min(cap, config.max_num_batched_tokens)
            if prompt_len + max_tokens - 1 > cap:
                # Scale both down, keeping the output share: decodes that grow past the
                # pool are what forces preemptions (a pool-sized prompt with one output
                # never grows).
                prompt_len = max(1, prompt_len * cap // (prompt_len + max_tokens))
                max_tokens = min(max_tokens, cap - prompt_len + 1)
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
        before = self.spec.state
        spec_error: InvalidRequestError | None = None
        real_error: InvalidRequestError | None = None
        try:
            self.spec.add_request(request_id, prompt, params)
        except InvalidRequestError as error:
            spec_error = error
        try:
            self.real_add(request_id, prompt, params)
        except InvalidRequestError as error:
            real_error = error
        except Exception as error:
            raise InvariantViolation("no_crash", f"add_request raised {error!r}") from error
        require(
            type(spec_error) is type(real_error),
            "same_rejection",
            lambda: (
                f"add_request({request_id!r}, P={len(prompt)}, {params}): spec raised "
                f"{spec_error!r}, real raised {real_error!r}"
            ),
        )
        if expected is not None:
            require(
                type(spec_error) is expected,
                "rejection_order",
                lambda: f"expected {expected.__name__} (R4's order), got {spec_error!r}",
            )
        if spec_error is not None:
            observed = self.real_observe()
            require(
                self.spec.state is before and observed == before,
                "rejection_changes_nothing",
                lambda: state_diff(observed, before),
            )
            self.note(f"reject: {type(spec_error).__name__}")
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
