"""Random scenarios for the property tests: a config, an oracle and a list of events.

A scenario is plain data, drawn by Hypothesis (``scenarios()``) or by a seeded
``random.Random`` (``random_scenario``, for the figures the report prints). ``play``
runs it through the spec and checks, at every transition, the state and step
invariants, that the inputs were not changed, and that each ``add_request`` /
``abort_request`` raised exactly what the rules predict (predicted here independently
of the spec's code).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

from hypothesis import strategies as st

from spec import (
    POLICIES,
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    HashOracle,
    InvalidMaxTokensError,
    PreemptionMode,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
    abort_request,
    add_request,
    drain_step_bound,
    has_unfinished_requests,
    init_state,
    plan_violations,
    progress_violations,
    state_violations,
    step,
)

BLOCK_SIZES = (1, 2, 4, 16)
POOL_TOKENS = (6, 40)  # GPU pools hold about this many tokens: preemption is common
MAX_PROMPT = 12
MAX_NEW = 10  # so L = P + M - 1 <= 21: most requests fit, some never do
NUM_IDS = 8  # request ids r0..r7, so ids get reused and duplicates get tried


def _rarely_zero(x: int, top: int) -> int:
    """Maps 0..4*top to 0 (once) or 1..top: an invalid value now and then."""
    return 0 if x == 0 else 1 + x % top


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_len: int
    max_tokens: int
    eos_token_id: int | None = None
    ignore_eos: bool = False
    priority: int = 0


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Step:
    pass


Event = Add | Abort | Step


@dataclass(frozen=True)
class Scenario:
    config: SchedulerConfig
    oracle: HashOracle
    events: tuple[Event, ...]


def prompt_of(event: Add, vocab_size: int) -> tuple[int, ...]:
    """The prompt token ids, derived from the id so that draws stay small."""
    seed = int(event.request_id[1:]) * 31 + event.prompt_len
    return tuple((seed + 7 * j) % vocab_size for j in range(event.prompt_len))


def params_of(event: Add) -> SamplingParams:
    return SamplingParams(
        max_tokens=event.max_tokens,
        eos_token_id=event.eos_token_id,
        ignore_eos=event.ignore_eos,
        priority=event.priority,
    )


def predicted_add_error(
    config: SchedulerConfig, live: set[str], event: Add
) -> type[Exception] | None:
    """R4, restated: which error ``add_request`` must raise, if any."""
    if event.prompt_len < 1:
        return EmptyPromptError
    if event.max_tokens < 1:
        return InvalidMaxTokensError
    if event.request_id in live:
        return DuplicateRequestError
    cached = event.prompt_len + event.max_tokens - 1
    if -(-cached // config.block_size) > config.num_gpu_blocks:
        return RequestTooLargeError
    if not config.enable_chunked_prefill:
        prefill = event.prompt_len if config.preemption_mode is PreemptionMode.RESTART else cached
        if prefill > config.max_num_batched_tokens:
            return RequestTooLargeError
    return None


# --- playing a scenario ----------------------------------------------------------------


@dataclass
class Played:
    """What a scenario did: the trace (for determinism) and the finished requests."""

    state: SchedulerState
    live: dict[str, Add] = field(default_factory=dict)  # live id -> how it was added
    trace: list[object] = field(default_factory=list)
    accepted: list[Add] = field(default_factory=list)
    reported: list[FinishedRequest] = field(default_factory=list)  # finished or aborted
    completed: list[tuple[Add, FinishedRequest]] = field(default_factory=list)  # not aborted
    steps: int = 0


def checked_step(played: Played, oracle: HashOracle) -> StepPlan:
    """One step, checking the invariants, the step and that the input is unchanged."""
    before = played.state
    snapshot = copy.deepcopy(before)
    after, plan = step(before, oracle)
    assert before == snapshot, "step changed its input"
    problems = (
        state_violations(after)
        + plan_violations(before, plan, after)
        + progress_violations(before, plan)
    )
    assert not problems, problems
    if before.config.policy == "lifo" and has_unfinished_requests(before):
        # the liveness lemma: under LIFO every step serves a head, so it schedules
        assert plan.scheduled, "a LIFO step with live requests scheduled nothing"
    for done in plan.finished:
        assert done.finish_reason is not FinishReason.ABORTED
        played.reported.append(done)
        played.completed.append((played.live.pop(done.request_id), done))
    played.state = after
    played.steps += 1
    played.trace.append(("step", plan))
    return plan


def _play_add(played: Played, config: SchedulerConfig, event: Add, vocab: int) -> None:
    expected = predicted_add_error(config, set(played.live), event)
    try:
        new = add_request(played.state, event.request_id, prompt_of(event, vocab), params_of(event))
    except Exception as error:
        assert type(error) is expected, (event, error)
        played.trace.append(("add-error", type(error).__name__, str(error)))
    else:
        assert expected is None, (event, expected)
        played.live[event.request_id] = event
        played.accepted.append(event)
        played.state = new
        played.trace.append(("add", new))


def _play_abort(played: Played, event: Abort) -> None:
    try:
        new, done = abort_request(played.state, event.request_id)
    except UnknownRequestError as error:
        assert event.request_id not in played.live
        played.trace.append(("abort-error", str(error)))
    else:
        assert event.request_id in played.live
        assert done.finish_reason is FinishReason.ABORTED
        del played.live[event.request_id]
        played.reported.append(done)
        played.state = new
        played.trace.append(("abort", new, done))


def play(scenario: Scenario) -> Played:
    """Run the events, checking every transition; do not drain."""
    played = Played(state=init_state(scenario.config))
    for event in scenario.events:
        state = played.state
        snapshot = copy.deepcopy(state)
        if isinstance(event, Add):
            _play_add(played, scenario.config, event, scenario.oracle.vocab_size)
        elif isinstance(event, Abort):
            _play_abort(played, event)
        else:
            checked_step(played, scenario.oracle)
        assert state == snapshot, f"{event} changed its input"
        problems = state_violations(played.state)
        assert not problems, (event, problems)
    return played


def drain_played(played: Played, scenario: Scenario, max_steps: int) -> int:
    """Step until nothing is live (or ``max_steps``); return the steps taken."""
    taken = 0
    while has_unfinished_requests(played.state) and taken < max_steps:
        checked_step(played, scenario.oracle)
        taken += 1
    return taken


def run_alone(config: SchedulerConfig, add: Add, oracle: HashOracle) -> FinishedRequest:
    """The same request, alone in a fresh engine with the same config."""
    state = add_request(
        init_state(config), add.request_id, prompt_of(add, oracle.vocab_size), params_of(add)
    )
    bound = drain_step_bound(state)
    for _ in range(bound):
        state, plan = step(state, oracle)
        if plan.finished:
            assert not has_unfinished_requests(state)
            return plan.finished[0]
    raise AssertionError(f"{add} did not finish alone within {bound} steps")


# --- drawing scenarios -----------------------------------------------------------------


def _ids() -> st.SearchStrategy[str]:
    return st.integers(0, NUM_IDS - 1).map(lambda i: f"r{i}")


def _adds(
    vocab_size: int, ids: st.SearchStrategy[str], *, valid: bool = False
) -> st.SearchStrategy[Add]:
    """Adds; unless ``valid``, now and then with an empty prompt or ``max_tokens`` 0."""
    low = 1 if valid else 0
    return st.builds(
        Add,
        request_id=ids,
        prompt_len=st.integers(low, 4 * MAX_PROMPT).map(lambda x: _rarely_zero(x, MAX_PROMPT)),
        max_tokens=st.integers(low, 4 * MAX_NEW).map(lambda x: _rarely_zero(x, MAX_NEW)),
        eos_token_id=st.none() | st.integers(0, vocab_size - 1),
        ignore_eos=st.booleans(),
        priority=st.integers(0, 2),
    )


def events(vocab_size: int) -> st.SearchStrategy[Event]:
    adds = _adds(vocab_size, _ids())
    aborts = st.builds(Abort, request_id=_ids())
    steps = st.just(Step())
    return st.one_of(adds, steps, adds, steps, steps, aborts)


@st.composite
def config_under_pressure(
    draw: st.DrawFn, burst: list[Add], policies: tuple[str, ...]
) -> SchedulerConfig:
    """A config whose GPU pool holds the largest request of the burst (now and then a
    little less, so that one never fits) but at most half the whole burst: preemption
    is likely."""
    cached = [a.prompt_len + a.max_tokens - 1 for a in burst]
    largest, total = max(cached), sum(cached)
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    shortfall = draw(st.integers(0, 8).map(lambda x: 3 if x == 0 else 0))
    pool_tokens = max(1, draw(st.integers(largest, max(largest, total // 2))) - shortfall)
    chunked = draw(st.booleans())
    low_budget = 1 if chunked else max(1, largest - 3)
    mode = draw(st.sampled_from(list(PreemptionMode)))
    gpu_blocks = -(-pool_tokens // block_size)
    cpu_blocks = draw(st.integers(0, 2 * gpu_blocks if mode is PreemptionMode.SWAP else 2))
    return SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=gpu_blocks,
        max_num_batched_tokens=draw(st.integers(low_budget, max(low_budget, 32))),
        max_num_seqs=draw(st.integers(2, 6)),
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_cpu_blocks=cpu_blocks,
        policy=draw(st.sampled_from(policies)),
    )


@st.composite
def scenarios(
    draw: st.DrawFn, policies: tuple[str, ...] = tuple(sorted(POLICIES)), max_events: int = 40
) -> Scenario:
    """An oracle, a burst of 2-6 adds, a config the burst overflows, then random events."""
    oracle = HashOracle(vocab_size=draw(st.integers(2, 40)), salt=draw(st.integers(0, 3)))
    burst_ids = draw(st.lists(_ids(), min_size=2, max_size=6, unique=True))
    burst = [draw(_adds(oracle.vocab_size, st.just(rid), valid=True)) for rid in burst_ids]
    config = draw(config_under_pressure(burst, policies))
    drawn = draw(st.lists(events(oracle.vocab_size), max_size=max_events))
    return Scenario(config=config, oracle=oracle, events=(*burst, *drawn))


def random_scenario(
    rng: random.Random, policy: str, num_events: int = 40, *, burst: bool = False
) -> Scenario:
    """The same distribution as ``scenarios``, from a seeded generator (for reports).

    With ``burst``, every event is an add (distinct ids): a load arriving at once.
    """
    block_size = rng.choice(BLOCK_SIZES)
    mode = rng.choice(list(PreemptionMode))
    config = SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=max(1, rng.randint(*POOL_TOKENS) // block_size),
        max_num_batched_tokens=rng.randint(1, 32),
        max_num_seqs=rng.randint(1, 6),
        enable_chunked_prefill=rng.random() < 0.5,
        preemption_mode=mode,
        num_cpu_blocks=rng.randint(0, 12 if mode is PreemptionMode.SWAP else 2),
        policy=policy,
    )
    oracle = HashOracle(vocab_size=rng.randint(2, 40), salt=rng.randint(0, 3))
    drawn: list[Event] = []
    for _ in range(num_events):
        kind = "add" if burst else rng.choice(("add", "add", "step", "step", "step", "abort"))
        rid = f"r{len(drawn)}" if burst else f"r{rng.randrange(NUM_IDS)}"
        if kind == "add":
            drawn.append(
                Add(
                    request_id=rid,
                    prompt_len=rng.randint(1, MAX_PROMPT),
                    max_tokens=rng.randint(1, MAX_NEW),
                    eos_token_id=rng.choice((None, rng.randrange(oracle.vocab_size))),
                    ignore_eos=rng.random() < 0.5,
                    priority=rng.randint(0, 2),
                )
            )
        elif kind == "abort":
            drawn.append(Abort(rid))
        else:
            drawn.append(Step())
    return Scenario(config=config, oracle=oracle, events=tuple(drawn))
