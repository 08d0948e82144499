"""The half that both differential state machines share.

Design card. The reference model (``SpecModel``: the pure functions of ``spec/``
behind the same verbs as the engine) and the real thing (``impl.Scheduler`` driven by
a toy model, or the whole ``impl.LLMEngine``) receive the same operations. After
every rule, small named invariants compare them; every step's plan is compared in
full and checked by ``spec.plan_violations``; ``teardown`` drains with a derived
bound and compares every output with a solo run. A failure is an
``InvariantViolation`` whose message starts with ``[invariant-name]`` (the mutation
check reports that name).

Everything a test run reaches is counted in ``COVERAGE`` (and passed to
``hypothesis.event``), and ``STATS`` counts the differential steps checked, so the
tests can assert that the ``ci`` run reaches every path and print the throughput.
"""

from __future__ import annotations

import enum
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Final, NoReturn, cast

from hypothesis import (
    HealthCheck,
    Phase,
    currently_in_test_context,
    event,
    seed,
    settings,
    target,
)
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hypothesis.vendor import pretty

import impl
import spec
from impl.block_manager import cdiv
from impl.scheduler import Scheduler
from spec.policies import lifo_victim
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    InvalidRequestError,
    PreemptionMode,
    RequestState,
    RequestTooLargeError,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)

# --- printing failures as runnable programs ---------------------------------------------


def _pretty_str_enum(obj: enum.StrEnum, printer: pretty.RepresentationPrinter, cycle: bool) -> None:
    printer.text(f"{type(obj).__name__}.{obj.name}")


# Hypothesis prints a failing run as a program; a StrEnum (PreemptionMode) inside the
# config would print as ``<PreemptionMode.SWAP: 'swap'>`` (its str branch uses repr),
# which is not Python. Print ``PreemptionMode.SWAP``, so the program can be pasted into
# a regression test as it is.
pretty.for_type_by_name("enum", "StrEnum", _pretty_str_enum)


# --- failures -----------------------------------------------------------------------------


class InvariantViolation(AssertionError):
    """A named invariant broke; the message starts with ``[name]``."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


class InjectedFault(RuntimeError):
    """Raised on purpose by a fault the machine armed (a forward or a swap copy)."""


def fail(invariant: str, message: str) -> NoReturn:
    raise InvariantViolation(invariant, message)


def require(ok: bool, invariant: str, message: str | Callable[[], str]) -> None:
    """Raise ``InvariantViolation(invariant, ...)`` unless ``ok``; a callable message is
    only built on failure (most checks run on every step)."""
    if not ok:
        raise InvariantViolation(invariant, message if isinstance(message, str) else message())


# --- coverage and throughput ----------------------------------------------------------------

#: machine name -> event label -> occurrences, over every example run in this process.
COVERAGE: Final[defaultdict[str, Counter[str]]] = defaultdict(Counter)


@dataclass
class RunStats:
    """What one machine's run checked (filled by the machine, timed by the test)."""

    examples: int = 0
    steps: int = 0  # committed differential steps (rules and drains)
    drain_steps: int = 0
    rejected_steps: int = 0  # faulted steps: rolled back and compared
    cpu_seconds: float = 0.0
    max_drain_ratio: dict[str, float] = field(default_factory=dict)  # policy -> actual/LIFO bound

    def steps_per_cpu_second(self) -> float:
        return self.steps / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


STATS: Final[defaultdict[str, RunStats]] = defaultdict(RunStats)


def reset_counters(machine: str) -> None:
    COVERAGE[machine].clear()
    STATS[machine] = RunStats()


def stats_dir() -> Path:
    """Where each test writes its stats for the terminal summary (tests/stateful/conftest.py)."""
    path = Path(
        os.environ.get("KVSCHED_STATEFUL_STATS")
        or Path(tempfile.gettempdir()) / f"kvsched-stateful-{os.getppid()}"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_report(machine: str, profile: str, missing: Sequence[str]) -> str:
    """Render (and save, for the terminal summary) the run's coverage and throughput."""
    stats = STATS[machine]
    coverage = COVERAGE[machine]
    lines = [
        f"{machine} [{profile}]: {stats.examples} examples, {stats.steps} differential steps "
        f"({stats.drain_steps} in drains, {stats.rejected_steps} faulted and rolled back) in "
        f"{stats.cpu_seconds:.1f} CPU s = {stats.steps_per_cpu_second():.0f} steps/CPU-s",
    ]
    if stats.max_drain_ratio:
        ratios = ", ".join(f"{k}={v:.3f}" for k, v in sorted(stats.max_drain_ratio.items()))
        lines.append(f"  max drain steps / LIFO bound: {ratios}")
    for label, count in sorted(coverage.items()):
        lines.append(f"  {count:>8}  {label}")
    if missing:
        lines.append(f"  NOT REACHED: {', '.join(missing)}")
    text = "\n".join(lines)
    record = {"machine": machine, "profile": profile, "text": text}
    (stats_dir() / f"{machine}-{os.getpid()}.json").write_text(json.dumps(record))
    return text


# --- sizes per Hypothesis profile ------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    max_examples: int
    steps: int  # stateful_step_count: rules per example (a rule may run several steps)
    #: Keep Hypothesis's target phase (hill-climbing on the teardown's target() labels).
    #: Only for long runs: with a few hundred examples it spends the budget near the
    #: examples with the most preemptions (restart-mode thrash) and starves the rest.
    targeting: bool = False


#: Per profile (tests/conftest.py) and machine. The ci sizes keep the whole stateful
#: suite around 3-5 minutes with ``pytest -n 2``; nightly is sized in
#: docs/stateful-testing.md (>= 10^6 differential steps a night).
SIZES: Final[Mapping[str, Mapping[str, Size]]] = {
    "ci": {"SchedulerDifferential": Size(2_000, 50), "EngineDifferential": Size(400, 50)},
    "dev": {"SchedulerDifferential": Size(60, 40), "EngineDifferential": Size(15, 25)},
    "nightly": {
        "SchedulerDifferential": Size(20_000, 100, targeting=True),
        "EngineDifferential": Size(6_000, 60, targeting=True),
    },
    "mutation": {"SchedulerDifferential": Size(1_000, 40), "EngineDifferential": Size(200, 30)},
}

#: Every machine sets these explicitly (formal-methods.md section 2.2: a machine's own
#: @settings otherwise brings back the 200 ms deadline and every health check).
SUPPRESSED: Final = (HealthCheck.too_slow, HealthCheck.data_too_large)


def machine_settings(machine: str) -> settings:
    """The current profile's settings, with this machine's size for that profile.

    ``KVSCHED_STATEFUL_EXAMPLES`` / ``KVSCHED_STATEFUL_STEPS`` override the size.
    """
    profile = settings.get_current_profile_name()
    size = SIZES.get(profile, SIZES["dev"])[machine]
    examples = int(os.environ.get("KVSCHED_STATEFUL_EXAMPLES") or size.max_examples)
    steps = int(os.environ.get("KVSCHED_STATEFUL_STEPS") or size.steps)
    phases = tuple(p for p in settings().phases if size.targeting or p is not Phase.target)
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        phases=phases,
        deadline=None,
        suppress_health_check=SUPPRESSED,
    )


# --- what the rules draw ---------------------------------------------------------------------

BLOCK_SIZES: Final = (1, 2, 4, 16)
POLICY_NAMES: Final = tuple(sorted(spec.POLICIES))


@st.composite
def engine_configs(draw: st.DrawFn) -> SchedulerConfig:
    """Small pools so preemption really happens; every mode, policy and block size.

    The GPU pool holds 8-64 tokens (at least two blocks); swap mode (drawn half the
    time) gets a CPU pool from none (every swap falls back to recompute) through too
    small to twice the GPU pool.
    """
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    gpu_tokens = draw(st.integers(8, 64))
    num_gpu_blocks = max(2, gpu_tokens // block_size)  # 16 x 1 block: no two requests fit
    # Swap mode drawn twice as often: it has the most paths (swap-out, fallback, swap-in).
    mode = draw(st.sampled_from((*PreemptionMode, PreemptionMode.SWAP)))
    if mode is PreemptionMode.SWAP:
        num_cpu_blocks = draw(st.integers(0, 2 * num_gpu_blocks))
    else:
        num_cpu_blocks = draw(st.sampled_from((0, num_gpu_blocks)))  # unused: must not matter
    return SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        # 1 (no two requests run together: no preemption) last, as the rare case.
        max_num_seqs=draw(st.sampled_from((2, 3, 4, 6, 8, 1))),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=mode,
        num_cpu_blocks=num_cpu_blocks,
        policy=draw(st.sampled_from(POLICY_NAMES)),
    )


@dataclass(frozen=True)
class NewRequest:
    """A request to add, in sizes; the machine derives its tokens from ``salt``.

    Unless ``oversize``, the sizes are clamped so the request fits the configuration
    (R4), so most requests are accepted and put the pools under pressure. ``eos``
    picks the EOS token among the request's own solo outputs, so EOS is really hit.
    """

    prompt_len: int
    max_tokens: int
    oversize: bool = False
    salt: int = 0
    eos: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    temperature: float = 0.0


#: temperature 0.8 draws with the request's seed (the engine's sampler is a function of
#: seed, output index and logits, so a solo run reproduces it; the toy ignores it).
NEW_REQUESTS: Final = st.builds(
    NewRequest,
    prompt_len=st.integers(1, 8) | st.integers(1, 48),
    max_tokens=st.integers(1, 24),
    oversize=st.sampled_from((False, False, False, True)),
    salt=st.integers(0, 2**16),
    eos=st.none() | st.integers(0, 24),
    ignore_eos=st.sampled_from((False, False, False, True)),
    priority=st.integers(0, 3),
    temperature=st.sampled_from((0.0, 0.0, 0.8)),
)


@dataclass(frozen=True)
class BadRequest:
    """A request with one or more R4 defects; the first in R4's order must be raised."""

    empty: bool = False
    zero_max_tokens: bool = False
    out_of_vocab: bool = False
    duplicate: bool = False
    too_large: bool = False
    oov_high: bool = False  # the bad token is vocab_size (else -1)
    salt: int = 0


def _has_defect(bad: BadRequest) -> bool:
    return bad.empty or bad.zero_max_tokens or bad.out_of_vocab or bad.duplicate or bad.too_large


BAD_REQUESTS: Final = st.builds(
    BadRequest,
    empty=st.booleans(),
    zero_max_tokens=st.booleans(),
    out_of_vocab=st.booleans(),
    duplicate=st.booleans(),
    too_large=st.booleans(),
    oov_high=st.booleans(),
    salt=st.integers(0, 2**16),
).filter(_has_defect)


#: Faults a rule can arm: the next forward raises before running, or after writing K/V
#: into the cache; the next swap-out / swap-in copy raises.
FAULT_KINDS: Final = ("forward", "forward after KV write", "swap-out copy", "swap-in copy")


# --- the reference model -------------------------------------------------------------------


class SpecModel:
    """The spec behind the engine's verbs: add, abort, observe, and a step in two halves.

    ``schedule()`` decides (phases A-C) without changing anything; ``commit`` applies
    the sampled tokens (phase D) and only then advances the state, so a step whose
    real counterpart failed is simply never committed. R4's vocabulary check (the
    engine's, check 3) is done here with the machine's vocabulary.
    """

    def __init__(self, config: SchedulerConfig, vocab_size: int) -> None:
        self.state = spec.init_state(config)
        self.vocab_size = vocab_size

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        if (
            len(prompt) >= 1
            and params.max_tokens >= 1
            and any(not 0 <= token < self.vocab_size for token in prompt)
        ):
            raise TokenOutOfVocabError(f"request {request_id!r}: a token is outside the vocab")
        self.state = spec.add_request(self.state, request_id, prompt, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        self.state, finished = spec.abort_request(self.state, request_id)
        return finished

    def observe(self) -> SchedulerState:
        return self.state

    def schedule(self) -> tuple[SchedulerState, StepPlan]:
        return spec.schedule(self.state)

    def commit(self, mid: SchedulerState, draft: StepPlan, tokens: Mapping[str, int]) -> StepPlan:
        self.state, plan = spec.complete_step(mid, draft, tokens)
        return plan


# --- the machine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


def _where(state: SchedulerState, request_id: str) -> tuple[str, RequestState] | None:
    found = spec.find_request(state, request_id)
    if found is None:
        return None
    queue, index = found
    requests = {"waiting": state.waiting, "running": state.running, "swapped": state.swapped}
    return queue, requests[queue][index]


def _abort_label(queue: str, request: RequestState) -> str:
    if queue == "running":
        if request.num_tokens - request.num_computed_tokens > 1:
            return "abort: running mid-prefill"
        return "abort: running (decoding)"
    if queue == "waiting" and request.num_preemptions > 0:
        return "abort: waiting after a preemption"
    return f"abort: {queue}"


_DECISIONS: Final = ("step", "scheduled", "preempted", "swapped_in")


_ALL_FIELDS: Final = (*_DECISIONS, "sampled", "finished")


def _plan_diff(real: StepPlan, reference: StepPlan, fields: Sequence[str] = _ALL_FIELDS) -> str:
    parts = []
    for name in fields:
        a, b = getattr(real, name), getattr(reference, name)
        if a != b:
            parts.append(f"{name}: real {a!r} != spec {b!r}")
    return "; ".join(parts) or "(equal)"


def _state_diff(real: SchedulerState, reference: SchedulerState) -> str:
    parts = []
    for name in (
        "num_free_gpu_blocks",
        "num_free_cpu_blocks",
        "waiting",
        "running",
        "swapped",
        "next_arrival",
        "num_steps",
        "config",
    ):
        a, b = getattr(real, name), getattr(reference, name)
        if a != b:
            parts.append(f"{name}: real {a!r} != spec {b!r}")
    return "; ".join(parts) or "(equal)"


#: Policies the LIFO liveness proof covers (docs/semantics.md, "Why every accepted
#: request finishes"): ``lifo``, and ``reserve``, whose gate never refuses an empty engine.
LIFO_PROOF_POLICIES: Final = frozenset({"lifo", "reserve"})


def lifo_proof_applies(policy: str) -> bool:
    """The proof needs LIFO victims; checked on the spec's policy, not just the name."""
    return policy in LIFO_PROOF_POLICIES and spec.POLICIES[policy].select_victim is lifo_victim


ProgressKey = tuple[int, int, tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...]]


def _progress_key(state: SchedulerState) -> ProgressKey:
    """The state without its counters (``num_steps``, each ``num_preemptions``), which no
    scheduling decision reads: a preemption livelock repeats it, though the counters
    grow. Requests are named by arrival (unique); prompt and params come with it."""
    queues = tuple(
        tuple((r.request.arrival, r.num_computed_tokens, r.output_token_ids) for r in queue)
        for queue in (state.waiting, state.running, state.swapped)
    )
    return state.num_free_gpu_blocks, state.num_free_cpu_blocks, queues


class DifferentialMachine(RuleBasedStateMachine):
    """Rules, invariants and teardown shared by both machines (see the module doc).

    A subclass provides the real side (``new_real``, ``real_*``), the tokens the spec
    is given (``spec_tokens``), solo reference outputs (``solo``) and its faults.
    """

    NAME: ClassVar[str] = "DifferentialMachine"
    VOCAB: ClassVar[int] = 16
    requests: Bundle[str] = Bundle("requests")

    config: SchedulerConfig
    spec: SpecModel

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
        self.stats = STATS[self.NAME]

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
        COVERAGE[self.NAME][label] += 1
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
        if not req.oversize:
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
            if spec.never_fits(config, prompt_len, max_tokens):
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
                lambda: _state_diff(observed, before),
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

    # --- rules -----------------------------------------------------------------------------

    @initialize(
        target=requests,
        config=engine_configs(),
        initial=st.lists(NEW_REQUESTS, min_size=1, max_size=8),
    )
    def init_engine(
        self, config: SchedulerConfig, initial: list[NewRequest]
    ) -> MultipleResults[str]:
        """A fresh engine for ``config`` and an initial load (swarm testing may switch
        every add rule off in an example; the pools still see work)."""
        require(
            sorted(spec.POLICIES) == sorted(impl.POLICIES),
            "policy_registry",
            f"spec registers {sorted(spec.POLICIES)}, impl {sorted(impl.POLICIES)}",
        )
        self.config = config
        self.spec = SpecModel(config, self.VOCAB)
        self.new_real(config)
        self.ready = True
        self.stats.examples += 1
        self.note(f"config: policy={config.policy}")
        self.note(f"config: mode={config.preemption_mode}")
        self.note(f"config: block_size={config.block_size}")
        self.note(f"config: chunked prefill {'on' if config.enable_chunked_prefill else 'off'}")
        return multiple(*self.add_all(initial))

    @rule(target=requests, req=NEW_REQUESTS)
    def add_request(self, req: NewRequest) -> str | MultipleResults[str]:
        request_id = self.fresh_id()
        prompt, params = self.resolve(req)
        return request_id if self.submit(request_id, prompt, params) else multiple()

    @rule(target=requests, reqs=st.lists(NEW_REQUESTS, min_size=2, max_size=6))
    def add_burst(self, reqs: list[NewRequest]) -> MultipleResults[str]:
        return multiple(*self.add_all(reqs))

    def add_all(self, reqs: list[NewRequest]) -> list[str]:
        accepted = []
        for req in reqs:
            request_id = self.fresh_id()
            prompt, params = self.resolve(req)
            if self.submit(request_id, prompt, params):
                accepted.append(request_id)
        return accepted

    @rule(target=requests, req=NEW_REQUESTS, copies=st.integers(2, 6))
    def add_identical(self, req: NewRequest, copies: int) -> MultipleResults[str]:
        """The same request several times (one prompt from many users): they advance in
        lockstep, so policies meet exact ties (same outputs, same prompt length)."""
        return multiple(*self.add_all([req] * copies))

    @rule(request_id=requests, req=NEW_REQUESTS)
    def add_with_used_id(self, request_id: str, req: NewRequest) -> None:
        """A live id is a duplicate (R4.4); a finished or aborted one may be reused."""
        live = spec.is_live(self.spec.state, request_id)
        prompt, params = self.resolve(req)
        expected = DuplicateRequestError if live else None
        if self.submit(request_id, prompt, params, expected) and not live:
            self.note("add: reused the id of a finished request")

    @rule(bad=BAD_REQUESTS)
    def add_bad_request(self, bad: BadRequest) -> None:
        """Defects combined; both sides must raise the first in R4's order, nothing changes."""
        live = spec.live_request_ids(self.spec.state)
        duplicate = bad.duplicate and bool(live)
        too_large = bad.too_large or not (
            bad.empty or bad.zero_max_tokens or bad.out_of_vocab or duplicate
        )
        capacity = self.config.num_gpu_blocks * self.config.block_size
        prompt_len = 0 if bad.empty else (capacity + 1 if too_large else 2)
        rng = random.Random(bad.salt)
        prompt = [rng.randrange(self.VOCAB) for _ in range(prompt_len)]
        if bad.out_of_vocab and prompt:
            prompt[rng.randrange(len(prompt))] = self.VOCAB if bad.oov_high else -1
        request_id = live[bad.salt % len(live)] if duplicate else self.fresh_id("bad")
        params = SamplingParams(max_tokens=0 if bad.zero_max_tokens else 2)
        expected: type[InvalidRequestError]
        if bad.empty:
            expected = EmptyPromptError
        elif bad.zero_max_tokens:
            expected = InvalidMaxTokensError
        elif bad.out_of_vocab:
            expected = TokenOutOfVocabError
        elif duplicate:
            expected = DuplicateRequestError
        else:
            expected = RequestTooLargeError
        accepted = self.submit(request_id, prompt, params, expected)
        require(not accepted, "same_rejection", lambda: f"a bad request {bad} was accepted")

    @rule(request_id=consumes(requests))
    def abort(self, request_id: str) -> None:
        """Abort an id added earlier: live in any state (R11), or finished (unknown)."""
        self.abort_id(request_id)

    @precondition(lambda self: self.ready and spec.has_unfinished_requests(self.spec.state))
    @rule(
        queue=st.sampled_from(("waiting", "running", "prefilling", "swapped")),
        pick=st.integers(0, 2**16),
    )
    def abort_live(self, queue: str, pick: int) -> None:
        """Abort a live request of ``queue`` (``prefilling``: running, in the middle of a
        chunked prefill), or of the first non-empty queue."""
        state = self.spec.state
        queues = (state.waiting, state.running, state.swapped)
        chosen = {
            "waiting": state.waiting,
            "running": state.running,
            "prefilling": tuple(
                r for r in state.running if r.num_tokens - r.num_computed_tokens > 1
            ),
            "swapped": state.swapped,
        }
        candidates = chosen[queue] or next(q for q in queues if q)
        self.abort_id(candidates[pick % len(candidates)].request_id)

    def abort_id(self, request_id: str) -> None:
        before = self.spec.state
        where = _where(before, request_id)
        spec_result: FinishedRequest | UnknownRequestError
        real_result: FinishedRequest | UnknownRequestError
        try:
            spec_result = self.spec.abort_request(request_id)
        except UnknownRequestError as error:
            spec_result = error
        try:
            real_result = self.real_abort(request_id)
        except UnknownRequestError as error:
            real_result = error
        except Exception as error:
            raise InvariantViolation("no_crash", f"abort_request raised {error!r}") from error
        if where is None:
            require(
                isinstance(spec_result, UnknownRequestError)
                and isinstance(real_result, UnknownRequestError),
                "same_abort",
                lambda: (
                    f"abort of the finished {request_id!r}: spec {spec_result!r}, "
                    f"real {real_result!r}"
                ),
            )
            self.note("abort: id of a finished request")
            return
        require(
            spec_result == real_result,
            "same_abort",
            lambda: f"abort({request_id!r}): spec {spec_result!r}, real {real_result!r}",
        )
        assert isinstance(spec_result, FinishedRequest)
        queue, request = where
        self.note(_abort_label(queue, request))
        self.record_outcome(request.request.arrival, spec_result)

    @rule()
    def abort_unknown(self) -> None:
        request_id = self.fresh_id("ghost")
        for side in (self.spec.abort_request, self.real_abort):
            try:
                side(request_id)
            except UnknownRequestError:
                continue
            raise InvariantViolation("same_abort", f"abort of unknown {request_id!r} succeeded")
        self.note("reject: UnknownRequestError")

    @rule()
    def step(self) -> None:
        self.do_step()

    @rule(n=st.integers(2, 10))
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.do_step()

    @rule(limit=st.integers(1, 40), abort_victim=st.booleans())
    def run_until_preemption(self, limit: int, abort_victim: bool) -> None:
        """Step until a step preempts; then maybe abort a victim at once, while it is
        swapped or waiting after the preemption (states that do not last): a swapped
        one if any, else the last."""
        for _ in range(limit):
            plan = self.do_step()
            if plan is not None and plan.preempted:
                if abort_victim:
                    swapped = [p for p in plan.preempted if p.mode is PreemptionMode.SWAP]
                    self.abort_id((swapped or list(plan.preempted))[-1].request_id)
                return

    # One rule per fault kind: Hypothesis picks rules evenly (and swarm testing switches
    # each on or off), where one rule drawing the kind was skewed to a few kinds.

    @rule(when_preempting=st.booleans())
    def inject_forward_fault(self, when_preempting: bool) -> None:
        """The next forward raises before running (``when_preempting``: the next forward
        of a step that preempts); then step."""
        self.inject("forward", when_preempting)

    @rule(when_preempting=st.sampled_from((True, True, False)))
    def inject_fault_after_kv_write(self, when_preempting: bool) -> None:
        """The next forward raises after writing its K/V, possibly into blocks this step's
        victims gave up: the rollback must restore them (hence mostly in a step that
        preempts)."""
        self.inject("forward after KV write", when_preempting)

    @precondition(lambda self: self.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    def inject_swap_out_fault(self) -> None:
        """The next swap-out copy raises (before copying)."""
        self.inject("swap-out copy", when_preempting=True)

    @precondition(lambda self: self.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    def inject_swap_in_fault(self) -> None:
        """The next swap-in copy raises (after copying into the fresh GPU blocks)."""
        self.inject("swap-in copy", when_preempting=False)

    def inject(self, kind: str, when_preempting: bool) -> None:
        """Arm a fault and step. It fires once, at the next step that can hit it (a swap
        copy needs a swap; ``when_preempting``: only in a step that preempts)."""
        self.arm_fault(kind, when_preempting)
        self.do_step()

    # --- invariants (after every rule) -------------------------------------------------------

    @invariant()
    def observe_matches_spec(self) -> None:
        if self.ready:
            observed = self.real_observe()
            require(
                observed == self.spec.state,
                "observe_matches_spec",
                lambda: _state_diff(observed, self.spec.state),
            )

    @invariant()
    def spec_state_valid(self) -> None:
        if self.ready:
            violations = spec.state_violations(self.spec.state)
            require(not violations, "spec_state_valid", "; ".join(violations))

    @invariant()
    def kv_within_capacity(self) -> None:
        """No OOM: used <= capacity on both real pools."""
        if self.ready:
            scheduler = self.real_scheduler()
            for name, pool in (("GPU", scheduler.gpu), ("CPU", scheduler.cpu)):
                if not 0 <= pool.num_used_blocks <= pool.num_blocks:
                    fail(
                        "kv_within_capacity",
                        f"{name} uses {pool.num_used_blocks} of {pool.num_blocks} blocks",
                    )

    @invariant()
    def blocks_conserved(self) -> None:
        """free + owned == total on both pools, owned counted from the real block tables."""
        if not self.ready:
            return
        scheduler = self.real_scheduler()
        pools = (
            ("GPU", scheduler.gpu, [seq.block_table for seq in scheduler.running]),
            ("CPU", scheduler.cpu, [seq.cpu_block_table for seq in scheduler.swapped]),
        )
        for name, pool, tables in pools:
            owned = [block for table in tables for block in table]
            if len(set(owned)) != len(owned):
                fail("blocks_conserved", f"{name} block owned twice: {tables}")
            if pool.num_free_blocks + len(owned) != pool.num_blocks:
                fail(
                    "blocks_conserved",
                    f"{name}: free {pool.num_free_blocks} + owned {len(owned)} "
                    f"!= {pool.num_blocks}",
                )
            try:
                pool.check()
            except impl.BlockAllocationError as error:
                raise InvariantViolation("blocks_conserved", f"{name}: {error}") from error
        bs = self.config.block_size
        for seq in scheduler.running:
            if len(seq.block_table) != cdiv(seq.num_computed, bs):
                fail(
                    "blocks_conserved",
                    f"{seq!r} has {len(seq.block_table)} GPU blocks for {seq.num_computed} tokens",
                )

    @invariant()
    def real_self_check(self) -> None:
        if self.ready:
            try:
                self.real_scheduler().check_invariants()
            except AssertionError as error:
                raise InvariantViolation("real_self_check", repr(error)) from error

    # --- a differential step ----------------------------------------------------------------

    def do_step(self) -> StepPlan | None:
        """One step on both sides: its plan, or None if an injected fault rolled it back."""
        before = self.spec.state
        mid, draft = self.spec.schedule()
        snapshot = self.fault_snapshot()
        try:
            plan = self.real_step()
        except InjectedFault:
            observed = self.real_observe()
            require(
                observed == before,
                "fault_rolls_back",
                lambda: f"after a failed step {before.num_steps}: {_state_diff(observed, before)}",
            )
            for invariant, value in self.fault_snapshot().items():
                require(
                    value == snapshot[invariant],
                    invariant,
                    lambda: f"after a failed step {before.num_steps}: changed",
                )
            self.faults_fired += 1
            self.stats.rejected_steps += 1
            if draft.preempted:
                self.note("fault: in a step that preempted")
            if any(p.mode is PreemptionMode.SWAP for p in draft.preempted):
                self.note("fault: in a step that swapped out")
            if draft.swapped_in:
                self.note("fault: in a step that swapped in")
            return None
        except InvariantViolation:
            raise
        except Exception as error:
            raise InvariantViolation(
                "no_crash", f"step {before.num_steps}: the real side raised {error!r}"
            ) from error
        decided = (plan.step, plan.scheduled, plan.preempted, plan.swapped_in)
        require(
            decided == (draft.step, draft.scheduled, draft.preempted, draft.swapped_in),
            "plan_matches_spec",
            lambda: f"step {before.num_steps}: {_plan_diff(plan, draft, _DECISIONS)}",
        )
        tokens = self.spec_tokens(mid, draft, plan)
        try:
            reference = self.spec.commit(mid, draft, tokens)
        except SampledTokensError as error:
            raise InvariantViolation("plan_matches_spec", str(error)) from error
        require(
            plan == reference,
            "plan_matches_spec",
            lambda: f"step {before.num_steps}: {_plan_diff(plan, reference)}",
        )
        after = self.spec.state
        violations = spec.plan_violations(before, plan, after)
        if violations:
            fail("plan_valid", f"step {before.num_steps}: {'; '.join(violations)}")
        require(
            bool(plan.scheduled or plan.preempted) or not spec.has_unfinished_requests(before),
            "step_progress",
            lambda: f"step {before.num_steps} did nothing with requests live",
        )
        self.after_step(mid, plan)
        self.record_step(before, mid, plan)
        return plan

    def record_step(self, before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> None:
        config = self.config
        self.stats.steps += 1
        index = {r.request_id: r for r in (*before.waiting, *before.running, *before.swapped)}
        for preemption in plan.preempted:
            self.preemptions += 1
            self.note(f"preempt: {preemption.mode}")
            if (
                config.preemption_mode is PreemptionMode.SWAP
                and preemption.mode is PreemptionMode.RECOMPUTE
            ):
                self.note("preempt: swap fell back to recompute (CPU pool full)")
        if len(plan.preempted) > 1:
            self.note("preempt: several victims in one step")
        if plan.preempted and before.waiting:
            self.note("admission held back by a preemption")
        if plan.swapped_in:
            self.note("swap-in")
        for chunk in plan.scheduled:
            request = index[chunk.request_id]
            if chunk.start + chunk.num_tokens < request.num_tokens:
                self.note("chunked prefill: partial chunk")
            elif chunk.start > 0 and chunk.num_tokens > 1:
                self.note("chunked prefill: last chunk of a resumed prefill")
            if chunk.start == 0 and request.output_token_ids and chunk.num_tokens > 1:
                self.note("re-prefill of prompt + kept outputs")
        by_id = {r.request_id: r for r in mid.running}
        for sampled in plan.sampled:
            params = by_id[sampled.request_id].request.params
            if params.ignore_eos and sampled.token_id == params.eos_token_id:
                self.note("finish: EOS sampled but ignored")
        for finished in plan.finished:
            self.note(f"finish: {finished.finish_reason}")
            self.record_outcome(by_id[finished.request_id].request.arrival, finished)
        after = self.spec.state
        if len(after.running) == config.max_num_seqs and after.waiting:
            self.note("max_num_seqs reached with requests waiting")
        self.peak_gpu_used = max(
            self.peak_gpu_used, config.num_gpu_blocks - after.num_free_gpu_blocks
        )
        self.peak_swapped = max(self.peak_swapped, len(after.swapped))

    # --- teardown: bounded drain, completion, solo outputs -------------------------------------

    def drain_bound(self, state: SchedulerState) -> int:
        """Steps the drain may take.

        ``lifo``, and ``reserve`` (LIFO victims, a gate that never refuses an empty
        engine: docs/semantics.md): ``spec.drain_step_bound``, proven in spec.liveness.
        Other policies may preempt the head of ``running``, so that proof does not carry
        over; they get a documented generous bound, ``(n + 1) * lifo_bound + n`` for
        ``n`` live requests (as if every request could lose all its progress once per
        other request), and the run records the largest ratio actually seen
        (docs/stateful-testing.md).
        """
        bound = spec.drain_step_bound(state)
        if lifo_proof_applies(state.config.policy):
            return bound
        n = spec.num_unfinished_requests(state)
        return (n + 1) * bound + n

    def teardown(self) -> None:
        if not self.ready or sys.exc_info()[0] is not None:
            return  # a rule failed: report that, not a drain of a diverged state
        start = self.spec.state
        bound = self.drain_bound(start)
        lifo_bound = spec.drain_step_bound(start)
        seen: set[ProgressKey] = set()
        steps = 0
        while spec.has_unfinished_requests(self.spec.state):
            if steps >= bound:
                fail(
                    "drain_bound",
                    f"{spec.num_unfinished_requests(self.spec.state)} requests still live "
                    f"after {steps} drain steps (bound {bound}, policy {self.config.policy})",
                )
            if self.do_step() is None:
                continue  # an armed fault fired: rolled back, retried (each fires once)
            steps += 1
            self.stats.drain_steps += 1
            # The state modulo its counters, and the token function, determine every
            # later step: a repeat is a livelock, whatever the bound says.
            key = _progress_key(self.spec.state)
            if key in seen:
                fail("no_livelock", f"state repeats after {steps} drain steps")
            seen.add(key)
        if self.config.policy != "lifo" and lifo_bound > 0:  # the ratio for the others
            policy = self.config.policy
            ratio = steps / lifo_bound
            self.stats.max_drain_ratio[policy] = max(
                self.stats.max_drain_ratio.get(policy, 0.0), ratio
            )
            if ratio > 1:
                self.note(f"drain: {policy} exceeded the LIFO bound")
        self.check_drained()
        self.target(float(self.preemptions), "preemptions")
        self.target(float(self.peak_gpu_used) / self.config.num_gpu_blocks, "peak GPU use")
        self.target(float(self.peak_swapped), "peak swapped requests")
        self.target(float(steps), "drain steps")

    def check_drained(self) -> None:
        missing = sorted(
            (a.request_id, arrival)
            for arrival, a in self.accepted.items()
            if arrival not in self.outcomes
        )
        require(not missing, "all_finished", lambda: f"accepted but never finished: {missing}")
        scheduler = self.real_scheduler()
        require(
            not scheduler.has_unfinished_requests()
            and scheduler.gpu.num_free_blocks == scheduler.gpu.num_blocks
            and scheduler.cpu.num_free_blocks == scheduler.cpu.num_blocks,
            "pools_empty_after_drain",
            f"GPU free {scheduler.gpu.num_free_blocks}/{scheduler.gpu.num_blocks}, CPU free "
            f"{scheduler.cpu.num_free_blocks}/{scheduler.cpu.num_blocks}, "
            f"{scheduler.num_unfinished_requests} live",
        )
        for arrival, finished in sorted(self.outcomes.items()):
            accepted = self.accepted[arrival]
            solo = self.solo(accepted.prompt, accepted.params)
            outputs = finished.output_token_ids
            if finished.finish_reason is FinishReason.ABORTED:
                ok = outputs == solo[: len(outputs)]
            else:
                ok = outputs == solo
            if not ok:
                fail(
                    "outputs_match_solo",
                    f"{accepted.request_id!r} ({finished.finish_reason}, "
                    f"{finished.num_preemptions} preemptions) produced {outputs}, alone {solo}",
                )


# --- running a machine as a test ------------------------------------------------------------

#: Paths every machine must reach in a ``ci`` (and ``nightly``) run; a subclass adds
#: its fault kinds.
REQUIRED_EVENTS: Final = frozenset(
    {
        *(f"config: policy={name}" for name in POLICY_NAMES),
        *(f"config: mode={mode}" for mode in PreemptionMode),
        *(f"config: block_size={bs}" for bs in BLOCK_SIZES),
        "config: chunked prefill on",
        "config: chunked prefill off",
        *(f"preempt: {mode}" for mode in PreemptionMode),
        "preempt: swap fell back to recompute (CPU pool full)",
        "preempt: several victims in one step",
        "admission held back by a preemption",
        "swap-in",
        "chunked prefill: partial chunk",
        "chunked prefill: last chunk of a resumed prefill",
        "re-prefill of prompt + kept outputs",
        "max_num_seqs reached with requests waiting",
        "finish: stop",
        "finish: length",
        "finish: EOS sampled but ignored",
        "add: with EOS",
        "add: reused the id of a finished request",
        "abort: waiting",
        "abort: waiting after a preemption",
        "abort: running mid-prefill",
        "abort: running (decoding)",
        "abort: swapped",
        "abort: id of a finished request",
        *(
            f"reject: {error.__name__}"
            for error in (
                EmptyPromptError,
                InvalidMaxTokensError,
                TokenOutOfVocabError,
                DuplicateRequestError,
                RequestTooLargeError,
                UnknownRequestError,
            )
        ),
        "fault: in a step that preempted",
        *(f"fault: {kind}" for kind in FAULT_KINDS),
    }
)

#: Profiles whose runs are sized to reach every required path (asserted).
COVERAGE_PROFILES: Final = frozenset({"ci", "nightly"})


def run_differential(machine: type[DifferentialMachine], required: Collection[str]) -> str:
    """Run ``machine`` under the current profile; report; assert coverage under ci/nightly.

    ``KVSCHED_STATEFUL_SEED=<n>`` runs another fixed stream of examples (``@seed``).

    The counters are reset first and read in the same process right after the run, so
    the coverage check does not depend on test order or on pytest-xdist.
    """
    name = machine.NAME
    reset_counters(name)
    profile = settings.get_current_profile_name()
    chosen_seed = os.environ.get("KVSCHED_STATEFUL_SEED")
    if chosen_seed:  # @seed wins over derandomize: another fixed stream of examples
        subclass = type(machine.__name__, (machine,), {"__module__": machine.__module__})
        machine = seed(int(chosen_seed))(cast(type[DifferentialMachine], subclass))
        profile = f"{profile}, seed {chosen_seed}"
    start = time.process_time()
    try:
        run_state_machine_as_test(machine, settings=machine_settings(name))
    finally:
        STATS[name].cpu_seconds = time.process_time() - start
    missing = sorted(set(required) - set(COVERAGE[name]))
    report = write_report(name, profile, missing)
    print(report)
    if profile in COVERAGE_PROFILES:
        assert not missing, f"{name} never reached: {missing}"
    return report
