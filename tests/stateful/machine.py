"""``LockstepMachine``: the one state machine, for every system under test.

Design card. The spec and a system under test, the machine's *subject*
(tests/stateful/subject.py; tests/stateful/subjects/: ``impl.Scheduler`` driven by a
toy model, the whole ``impl.LLMEngine``, vLLM V1's and nano-vllm's real schedulers),
receive the same operations through ``kvsched.peers.lockstep.Lockstep``, the project's
one lockstep comparison (``kvsched conform`` uses it too): refusals, aborts, each step's
decisions and whole plan, and the states after every step and every rule, each
divergence reported as the named invariant it breaks (``compared``). Every step is also
held to ``spec.plan_violations`` and to Rule P on each side's own state; the teardown
drains within a derived bound, fails on a repeated state (a livelock), checks that every
accepted request finished and compares every output with its request run alone.

Everything is written once. A rule that needs something runs only where the subject's
``Capabilities`` have it (``needs``); a subject adds its own per-step checks and fault
snapshots through its ``Side``. A divergence that is the signature of a known peer bug
(``Subject.known_bug``) ends the example there, counted as ``known peer bug: <id>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar, Concatenate, Final, ParamSpec, TypeVar

from hypothesis import currently_in_test_context, event, settings, target
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
)

import impl
import spec
from impl.scheduler import Scheduler
from kvsched.peers.known import KnownBug
from kvsched.peers.lockstep import Advance, Diverged, Divergence, Lockstep, describe
from spec.profiles import liveness_proved, too_large
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    InvalidMaxTokensError,
    InvalidRequestError,
    PreemptionMode,
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)
from tests.drain import ProgressKey, drain_bound, progress_key
from tests.stateful import checks
from tests.stateful.coverage import RunRecord
from tests.stateful.events import (
    ASYNC_ABORT_EVENT,
    abort_label,
    prefix_events,
    profile_events,
    step_events,
)
from tests.stateful.failures import InjectedFault, InvariantViolation, fail, require
from tests.stateful.offload_reserve_events import refusal_events
from tests.stateful.sizes import SUPPRESSED
from tests.stateful.strategies import (
    BAD_REQUESTS,
    INITIAL_REQUESTS,
    NEW_REQUESTS,
    SYSTEM_PROMPT_LEN,
    BadRequest,
    NewRequest,
    fit_sizes,
    r4_caps,
    shared_prompts,
    system_prompt,
)
from tests.stateful.subject import Capabilities, Side, Subject

#: The ids of the requests added so far (live or finished), for the rules that use one.
REQUESTS: Bundle[str] = Bundle("requests")

#: ``Capabilities.first_token_of_its_own``: the n-th request's first token is
#: ``FIRST_TOKEN + n``, outside every subject's vocabulary.
FIRST_TOKEN: Final = 10_000

#: The invariant a divergence breaks, by the operation its field starts with.
DIVERGENCE_INVARIANTS: tuple[tuple[str, str], ...] = (
    ("plan", "plan_matches_spec"),
    ("finished", "plan_matches_spec"),
    ("state", "observe_matches_spec"),
    ("blocks", "observe_matches_spec"),
    ("add_request", "same_rejection"),
    ("abort_request", "same_abort"),
)


def divergence_invariant(field: str) -> str:
    return next((name for op, name in DIVERGENCE_INVARIANTS if field.startswith(op)), "lockstep")


class ExampleEnded(Exception):
    """A known peer bug was met: the example ends (every rule but ``step`` is disabled)."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


M = TypeVar("M", bound="LockstepMachine")
P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[Concatenate[M, P], R], ended: R) -> Callable[Concatenate[M, P], R]:
    def run(self: M, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.settled = False
        try:
            result = method(self, *args, **kwargs)
        except ExampleEnded:
            return ended  # the machine has stopped: no teardown, no more rules
        self.settled = True
        return result

    functools.update_wrapper(run, method)  # its name and doc, as Hypothesis prints them
    return run


def checked(method: Callable[Concatenate[M, P], None]) -> Callable[Concatenate[M, P], None]:
    """Wrap a rule or an invariant: the machine is unsettled while it runs. One that raises
    leaves it unsettled, and the teardown then reports that failure instead of draining a
    diverged state; one that meets a known peer bug ends the example."""
    return _guarded(method, None)


def checked_adds(
    method: Callable[Concatenate[M, P], MultipleResults[str]],
) -> Callable[Concatenate[M, P], MultipleResults[str]]:
    """``checked``, for a rule that adds requests to ``REQUESTS`` (none if the example ends)."""
    return _guarded(method, multiple())


CAPABILITY_NAMES: Final = frozenset(f.name for f in dataclasses.fields(Capabilities))


def needs(
    *capabilities: str, also: Callable[[LockstepMachine], bool] | None = None
) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """A rule's precondition: the example runs (no known peer bug met), the subject has
    every capability named, and ``also`` holds."""
    unknown = set(capabilities) - CAPABILITY_NAMES
    assert not unknown, f"no such capabilities: {sorted(unknown)}"

    def holds(machine: LockstepMachine) -> bool:
        return (
            machine.running()
            and all(getattr(machine.caps, name) for name in capabilities)
            and (also is None or also(machine))
        )

    return precondition(holds)


def find_live(state: SchedulerState, request_id: str) -> tuple[str, RequestState] | None:
    found = spec.find_request(state, request_id)
    if found is None:
        return None
    queue, index = found
    requests = {"waiting": state.waiting, "running": state.running, "swapped": state.swapped}
    return queue, requests[queue][index]


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


class LockstepMachine(RuleBasedStateMachine):
    """The spec and ``subject`` in lockstep (``machine_for`` binds a subject)."""

    subject: ClassVar[Subject]
    #: Where the run counts its coverage and steps; ``harness.run_machine`` gives each run
    #: a fresh one (a replayed regression program uses this default).
    record: ClassVar[RunRecord] = RunRecord()

    requests = REQUESTS
    config: SchedulerConfig
    side: Side
    lock: Lockstep

    def __init__(self) -> None:
        super().__init__()
        self.caps = self.subject.caps
        self.vocab = self.subject.vocab
        self.ready = False
        self.settled = True  # False while a rule or an invariant runs (see ``checked``)
        self.stopped: KnownBug | None = None
        self.next_id = 0
        self.num_added = 0  # requests given to both sides (``FIRST_TOKEN``)
        self.accepted: dict[int, Accepted] = {}  # by arrival (ids may be reused)
        self.outcomes: dict[int, FinishedRequest] = {}
        self.finished_prompts: set[tuple[int, ...]] = set()  # of outcomes, for the events
        self.preemptions = 0
        self.peak_gpu_used = 0
        self.peak_swapped = 0
        # Prefix caching: the example's system prompt, the prompts sent to share a prefix
        # (to send again), the blocks each victim gave up (for the events).
        self.system_prompt: tuple[int, ...] = ()
        self.sent: list[Accepted] = []
        self.victim_blocks: dict[int, frozenset[int]] = {}

    def running(self) -> bool:
        return self.ready and self.stopped is None

    # --- set-up ----------------------------------------------------------------------------

    @initialize(
        target=REQUESTS,
        config=st.runner().flatmap(lambda machine: machine.subject.configs),
        initial=INITIAL_REQUESTS,
    )
    @checked_adds
    def init_engine(
        self, config: SchedulerConfig, initial: list[NewRequest]
    ) -> MultipleResults[str]:
        """A fresh system under test for ``config`` and an initial load (swarm testing may
        switch every add rule off in an example; the pools still see work)."""
        require(
            sorted(spec.POLICIES) == sorted(impl.POLICIES),
            "policy_registry",
            f"spec registers {sorted(spec.POLICIES)}, impl {sorted(impl.POLICIES)}",
        )
        assert config.enable_prefix_caching == self.caps.caching, config  # the subject's draw
        assert self.caps.swap or config.preemption_mode is not PreemptionMode.SWAP, config
        self.config = config
        with self.compared("init"):
            self.side = self.subject.start(config, self.note)
        self.lock = self.side.lock
        self.ready = True
        self.record.stats.examples += 1
        self.note(f"config: semantics={config.semantics}")
        self.note(f"config: policy={config.policy}")
        self.note(f"config: mode={config.preemption_mode}")
        self.note(f"config: block_size={config.block_size}")
        self.note(f"config: chunked prefill {'on' if config.enable_chunked_prefill else 'off'}")
        if config.max_num_seqs == 1:
            self.note("config: max_num_seqs=1")
        if config.async_scheduling:
            self.note("config: async scheduling")
        if config.num_speculative_tokens:
            self.note("config: speculative decoding")
        if config.enable_prefix_caching:
            self.note("config: prefix caching on")
            self.system_prompt = system_prompt(config, self.vocab)
        return multiple(*self.add_all(initial))

    # --- rules: adds -----------------------------------------------------------------------

    @needs()
    @rule(target=REQUESTS, req=NEW_REQUESTS)
    @checked_adds
    def add_request(self, req: NewRequest) -> MultipleResults[str]:
        return multiple(*self.add_all([req]))

    @needs()
    @rule(target=REQUESTS, reqs=st.lists(NEW_REQUESTS, min_size=2, max_size=6))
    @checked_adds
    def add_burst(self, reqs: list[NewRequest]) -> MultipleResults[str]:
        return multiple(*self.add_all(reqs))

    @needs()
    @rule(target=REQUESTS, req=NEW_REQUESTS, copies=st.integers(2, 6))
    @checked_adds
    def add_identical(self, req: NewRequest, copies: int) -> MultipleResults[str]:
        """The same request several times (one prompt from many users): they advance in
        lockstep, so policies meet exact ties (same outputs, same prompt length); under
        ``first_token_of_its_own`` identical but for the first token."""
        self.note("add: identical requests")
        return multiple(*self.add_all([req] * copies))

    @needs(also=lambda machine: not machine.caps.oversize_in_every_add)
    @rule(target=REQUESTS, req=NEW_REQUESTS)
    @checked_adds
    def add_oversize(self, req: NewRequest) -> MultipleResults[str]:
        """A request not clamped to fit, where the other adds only draw fitting ones: R4
        (or vllm-v1/max-model-len) refuses it if it is too large."""
        return multiple(*self.add_all([req], oversize=True))

    @needs()
    @rule(request_id=REQUESTS, req=NEW_REQUESTS)
    @checked
    def add_with_used_id(self, request_id: str, req: NewRequest) -> None:
        """A live id is a duplicate (R4.4; tried only where the subject refuses it); a
        finished or aborted one may be reused."""
        live = spec.is_live(self.lock.state, request_id)
        if live and not self.caps.duplicate_ids:
            return
        prompt, params = self.resolve(req)
        expected = DuplicateRequestError if live else None
        if self.submit(request_id, prompt, params, expected) and not live:
            self.note("add: reused the id of a finished request")

    @needs("bad_requests")
    @rule(bad=BAD_REQUESTS)
    @checked
    def add_bad_request(self, bad: BadRequest) -> None:
        """Defects combined; both sides must raise the first in R4's order, nothing changes."""
        live = spec.live_request_ids(self.lock.state)
        duplicate = bad.duplicate and bool(live) and self.caps.duplicate_ids
        too_large = bad.too_large or not (
            bad.empty or bad.zero_max_tokens or bad.out_of_vocab or duplicate
        )
        capacity = self.config.num_gpu_blocks * self.config.block_size
        prompt_len = 0 if bad.empty else (capacity + 1 if too_large else 2)
        rng = random.Random(bad.salt)
        prompt = [rng.randrange(self.vocab) for _ in range(prompt_len)]
        if bad.out_of_vocab and prompt:
            prompt[rng.randrange(len(prompt))] = self.vocab if bad.oov_high else -1
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

    # --- rules: shared prefixes (prefix caching) -------------------------------------------

    @needs("caching")
    @rule(
        target=REQUESTS,
        req=NEW_REQUESTS,
        prefix_len=st.integers(1, SYSTEM_PROMPT_LEN),
        own=st.integers(0, 8),
        copies=st.integers(1, 4),
    )
    @checked_adds
    def add_shared_prefix(
        self, req: NewRequest, prefix_len: int, own: int, copies: int
    ) -> MultipleResults[str]:
        """``shared_prompts``: the system prompt's first ``prefix_len`` tokens, then each
        copy's ``own`` tokens of its own; none: the system prompt cut at whole blocks,
        the same prompt every copy (a hit on every block it may hit). ``req`` gives the
        parameters; ``send`` cuts each prompt to what R4 accepts."""
        prompts = shared_prompts(
            self.system_prompt,
            prefix_len + own,
            self.config.block_size,
            prefix_len=prefix_len,
            exact_blocks=own == 0,
            copies=copies,
            salt=req.salt,
            vocab=self.vocab,
        )
        self.note("add: shared prefix")
        return multiple(*self.send(prompts, req))

    @needs("caching", also=lambda machine: bool(machine.sent))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16))
    @checked_adds
    def resend(self, pick: int) -> MultipleResults[str]:
        """A prompt sent before, again, wherever its first copy is now (running, finished,
        preempted, its blocks reclaimed or not)."""
        first = self.sent[pick % len(self.sent)]
        return multiple(*self.send([first.prompt], first.params))

    @needs("caching", also=lambda machine: bool(machine.decoding()))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16))
    @checked_adds
    def resend_decoding(self, pick: int) -> MultipleResults[str]:
        """The prompt of a request now decoding, again (a second user asks the same thing
        mid-answer): the copy hits the blocks the first holds, and its decodes fill
        blocks with the keys the first's decodes gave theirs (nano-vllm/last-key-wins
        moves each key). ``resend`` alone rarely meets this: a request decodes for a few
        steps only."""
        decoding = self.decoding()
        first = decoding[pick % len(decoding)].request
        self.note("add: resent while its first copy decodes")
        return multiple(*self.send([first.prompt_token_ids], first.params))

    @needs("caching", also=lambda machine: bool(machine.sent))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16), turns=st.integers(1, 8))
    @checked_adds
    def add_next_turn(self, pick: int, turns: int) -> MultipleResults[str]:
        """A prompt sent before followed by its first ``turns`` outputs (the next turn of a
        chat): the blocks its first copy's decodes filled (and keyed) are this one's too."""
        first = self.sent[pick % len(self.sent)]
        answer = self.side.solo(first.prompt, first.params)[:turns]
        self.note("add: next turn of an earlier prompt")
        return multiple(*self.send([(*first.prompt, *answer)], first.params))

    # --- rules: aborts ---------------------------------------------------------------------

    @needs()
    @rule(request_id=consumes(REQUESTS))
    @checked
    def abort(self, request_id: str) -> None:
        """Abort an id added earlier: live in any state (R11), or finished (unknown: tried
        only where the subject refuses an unknown id)."""
        if self.caps.unknown_ids or spec.is_live(self.lock.state, request_id):
            self.abort_id(request_id)

    @needs(also=lambda machine: bool(spec.live_request_ids(machine.lock.state)))
    @rule(
        queue=st.sampled_from(("waiting", "running", "prefilling", "swapped")),
        pick=st.integers(0, 2**16),
    )
    @checked
    def abort_live(self, queue: str, pick: int) -> None:
        """Abort a live request of ``queue`` (``prefilling``: running, in the middle of a
        chunked prefill), or of the first non-empty queue."""
        state = self.lock.state
        chosen = {
            "waiting": state.waiting,
            "running": state.running,
            "prefilling": self.prefilling(),
            "swapped": state.swapped,
        }
        queues = (state.waiting, state.running, state.swapped)
        candidates = chosen[queue] or next(q for q in queues if q)
        self.abort_id(candidates[pick % len(candidates)].request_id)

    # The two states below last a step or two (a victim comes back as soon as it fits, a
    # chunked prefill ends in a few chunks): rules of their own, enabled exactly while one
    # exists, abort there far more often than a pick among all live requests.

    @needs(also=lambda machine: bool(machine.preempted_waiting()))
    @rule(pick=st.integers(0, 2**16))
    @checked
    def abort_preempted(self, pick: int) -> None:
        """Abort a request waiting after a preemption."""
        victims = self.preempted_waiting()
        self.abort_id(victims[pick % len(victims)].request_id)

    @needs(also=lambda machine: bool(machine.prefilling()))
    @rule(pick=st.integers(0, 2**16))
    @checked
    def abort_prefilling(self, pick: int) -> None:
        """Abort a running request in the middle of a chunked prefill."""
        partial = self.prefilling()
        self.abort_id(partial[pick % len(partial)].request_id)

    @needs("unknown_ids")
    @rule()
    @checked
    def abort_unknown(self) -> None:
        request_id = self.fresh_id("ghost")
        with self.compared("abort_request"):
            try:
                self.lock.abort(request_id)
            except UnknownRequestError:
                self.note("reject: UnknownRequestError")
                return
        fail("same_abort", f"abort of unknown {request_id!r} succeeded")

    # --- rules: steps ----------------------------------------------------------------------

    @rule()
    @checked
    def step(self) -> None:
        """One step (nothing once a known peer bug ended the example: the one rule always
        enabled, so that an example can always go on)."""
        if self.running():
            self.do_step()

    @needs()
    @rule(n=st.integers(2, 10))
    @checked
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.do_step()

    @needs()
    @rule(limit=st.integers(1, 40), abort_victim=st.sampled_from((True, True, False)))
    @checked
    def run_until_preemption(self, limit: int, abort_victim: bool) -> None:
        """Step until a step preempts; then maybe abort a victim at once, while it is
        swapped or waiting after the preemption (states that do not last): a swapped one
        if any, else the last."""
        for _ in range(limit):
            plan = self.do_step()
            if plan is not None and plan.preempted:
                if abort_victim:
                    swapped = [p for p in plan.preempted if p.mode is PreemptionMode.SWAP]
                    self.abort_id((swapped or list(plan.preempted))[-1].request_id)
                return

    @needs()
    @rule(limit=st.integers(1, 20))
    @checked
    def run_until_prefilling(self, limit: int) -> None:
        """Step until a running request is in the middle of a chunked prefill, then abort
        it: a chunked prefill ends in a few chunks, so ``abort_prefilling`` (enabled only
        while one lasts) is rarely drawn in time."""
        for _ in range(limit):
            self.do_step()
            partial = self.prefilling()
            if partial:
                self.abort_id(partial[-1].request_id)
                return

    # --- rules: faults (one per kind: Hypothesis picks rules evenly, and swarm testing
    # switches each on or off, where one rule drawing the kind was skewed to a few) ----------

    @needs("faults")
    @rule(when_preempting=st.booleans())
    @checked
    def inject_forward_fault(self, when_preempting: bool) -> None:
        """The next forward raises before running (``when_preempting``: the next forward
        of a step that preempts); then step."""
        self.inject("forward", when_preempting)

    @needs("faults")
    @rule(when_preempting=st.sampled_from((True, True, False)))
    @checked
    def inject_fault_after_kv_write(self, when_preempting: bool) -> None:
        """The next forward raises after writing its K/V, possibly into blocks this step's
        victims gave up: the rollback must restore them (hence mostly in a step that
        preempts)."""
        self.inject("forward after KV write", when_preempting)

    @needs("faults", also=lambda m: m.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    @checked
    def inject_swap_out_fault(self) -> None:
        """The next swap-out copy raises (before copying)."""
        self.inject("swap-out copy", when_preempting=True)

    @needs("faults", also=lambda m: m.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    @checked
    def inject_swap_in_fault(self) -> None:
        """The next swap-in copy raises (after copying into the fresh GPU blocks)."""
        self.inject("swap-in copy", when_preempting=False)

    def inject(self, kind: str, when_preempting: bool) -> None:
        """Arm a fault and step. It fires once, at the next step that can hit it (a swap
        copy needs a swap; ``when_preempting``: only in a step that preempts)."""
        self.side.arm_fault(kind, when_preempting)
        self.do_step()

    # --- invariants, after every rule ------------------------------------------------------

    @invariant()
    @needs()
    @checked
    def observe_matches_spec(self) -> None:
        if self.lock.last_observed is None:  # else nothing changed since it was compared
            with self.compared("observe", "observe_matches_spec"):
                self.lock.compare_states()

    @invariant()
    @needs()
    @checked
    def spec_state_valid(self) -> None:
        violations = spec.state_violations(self.lock.state)
        require(not violations, "spec_state_valid", "; ".join(violations))

    # Our own scheduler's pools and block tables (``Side.scheduler``).

    @invariant()
    @needs(also=lambda machine: machine.side.scheduler is not None)
    @checked
    def kv_within_capacity(self) -> None:
        checks.kv_within_capacity(self.scheduler())

    @invariant()
    @needs(also=lambda machine: machine.side.scheduler is not None)
    @checked
    def blocks_conserved(self) -> None:
        checks.blocks_conserved(self.scheduler())

    @invariant()
    @needs(also=lambda machine: machine.side.scheduler is not None)
    @checked
    def real_self_check(self) -> None:
        checks.real_self_check(self.scheduler())

    # --- teardown: a bounded drain, then what must hold once nothing is live ---------------

    def teardown(self) -> None:
        if not self.running() or not self.settled:
            return  # a rule failed (report that, not a drain of a diverged state)
        try:
            steps = self.drain()
        except ExampleEnded:
            return
        self.check_drained()
        self.target(float(self.preemptions), "preemptions")
        self.target(float(self.peak_gpu_used) / self.config.num_gpu_blocks, "peak GPU use")
        self.target(float(self.peak_swapped), "peak swapped requests")
        self.target(float(steps), "drain steps")

    def drain(self) -> int:
        """Step until nothing is live on either side, within ``drain_bound`` from the
        start and from every state on the way (the bound is a function of the state, so
        each later state is a drain of its own: a bound that undercounts a lone request's
        last steps fails there), never repeating a state; the number of (committed)
        drain steps."""
        start = self.lock.state
        bound = drain_bound(start)
        seen: set[ProgressKey] = set()
        steps = 0
        bounds_on_the_way: list[tuple[int, int]] = []  # (steps taken, the bound from there)
        while self.lock.unfinished():
            bounds_on_the_way.append((steps, drain_bound(self.lock.state)))
            if steps >= bound:
                fail(
                    "drain_bound",
                    f"{spec.num_unfinished_requests(self.lock.state)} requests still live "
                    f"after {steps} drain steps (bound {bound}, policy {self.config.policy})",
                )
            if self.do_step() is None:
                continue  # an armed fault fired: rolled back, retried (each fires once)
            steps += 1
            self.record.stats.drain_steps += 1
            # The state modulo its counters, and the token function, determine every
            # later step: a repeat is a livelock, whatever the bound says.
            key = progress_key(self.lock.state)
            if key in seen:
                fail("no_livelock", f"state repeats after {steps} drain steps")
            seen.add(key)
        for taken, later_bound in bounds_on_the_way:
            if steps - taken > later_bound:
                fail(
                    "drain_bound",
                    f"{steps - taken} steps to drain from the state after drain step {taken}"
                    f" (bound {later_bound}, policy {self.config.policy})",
                )
        with self.compared("finish"):
            self.lock.finish()
        lifo_bound = spec.drain_step_bound(start)
        policy = self.config.policy
        proved = liveness_proved(self.config)  # transformers: the ratio under its name
        if (policy != "lifo" or not proved) and lifo_bound > 0:  # the ratio for the others
            policy = policy if proved else str(self.config.semantics)
            ratio = steps / lifo_bound
            ratios = self.record.stats.max_drain_ratio
            ratios[policy] = max(ratios.get(policy, 0.0), ratio)
            if ratio > 1:
                self.note(f"drain: {policy} exceeded the LIFO bound")
        return steps

    def check_drained(self) -> None:
        """What must hold once nothing is live: every accepted request finished (or was
        aborted), the pools are whole (the spec's, and ours where the subject is our
        scheduler), every output is its request's solo output, and the side's own checks
        (``Side.check_drained``)."""
        missing = sorted(
            (a.request_id, arrival)
            for arrival, a in self.accepted.items()
            if arrival not in self.outcomes
        )
        require(not missing, "all_finished", lambda: f"accepted but never finished: {missing}")
        checks.pools_empty_after_drain(self.lock.state, self.side.scheduler)
        for arrival, finished in sorted(self.outcomes.items()):
            accepted = self.accepted[arrival]
            if not self.side.solo_holds(accepted.params):
                continue
            solo = self.side.solo(accepted.prompt, accepted.params)
            checks.outputs_match_solo(self.config, accepted.prompt, finished, solo)
        self.side.check_drained()

    # --- a differential step ---------------------------------------------------------------

    def do_step(self) -> StepPlan | None:
        """One step on both sides: the plan, or None if an injected fault rolled it back."""
        before = self.lock.state
        real_before = (self.lock.last_observed or self.lock.peer.observe()).state
        snapshot = self.side.fault_snapshot() if self.side.faults_armed() else {}
        try:
            with self.compared(f"step {before.num_steps}: the real side"):
                advance = self.lock.advance()
        except InjectedFault:
            self.check_rollback(before, snapshot)
            return None
        except ExampleEnded as ended:
            if ended.divergence.field.startswith(("state", "blocks")):
                # The plans agreed (they are compared first): count what they decided.
                mid, draft = spec.schedule(before)
                self.note_all(profile_events(before, mid, draft))
            raise
        # The plans are equal but for the fields a peer hides: check the spec's.
        checks.check_step(before, real_before, advance.plan, self.lock.state)
        self.side.after_step(advance)
        self.record_step(advance)
        return advance.plan

    def check_rollback(self, before: SchedulerState, snapshot: dict[str, object]) -> None:
        """A failed step left the real side as it was ``before`` it (and the spec, which
        never took it, agrees); what it would have decided names the fault's events."""
        with self.compared("observe", "fault_rolls_back", "after a failed step: "):
            self.lock.compare_states()
        for name, value in self.side.fault_snapshot().items():
            require(
                value == snapshot[name],
                name,
                lambda: f"after a failed step {before.num_steps}: changed",
            )
        self.record.stats.rejected_steps += 1
        _, draft = spec.schedule(before)
        if draft.preempted:
            self.note("fault: in a step that preempted")
        if any(p.mode is PreemptionMode.SWAP for p in draft.preempted):
            self.note("fault: in a step that swapped out")
        if draft.swapped_in:
            self.note("fault: in a step that swapped in")

    def record_step(self, advance: Advance) -> None:
        before, mid, plan, after = advance.before, advance.mid, advance.plan, self.lock.state
        self.record.stats.steps += 1
        self.preemptions += len(plan.preempted)
        self.note_all(step_events(self.config, before, plan, after))
        by_id = {r.request_id: r for r in (*mid.running, *mid.waiting)}
        for finished in plan.finished:
            self.record_outcome(by_id[finished.request_id].request.arrival, finished)
        self.note_all(profile_events(before, mid, plan))
        self.note_all(
            prefix_events(
                before,
                mid,
                plan,
                after,
                victim_blocks=self.victim_blocks,
                prompts_sent_before=self.finished_prompts,
            )
        )
        self.peak_gpu_used = max(
            self.peak_gpu_used, self.config.num_gpu_blocks - after.num_free_gpu_blocks
        )
        self.peak_swapped = max(self.peak_swapped, len(after.swapped))

    # --- helpers ---------------------------------------------------------------------------

    @contextmanager
    def compared(
        self, what: str, invariant: str | None = None, context: str = ""
    ) -> Iterator[None]:
        """Lockstep operations: a divergence fails the invariant its field names (or
        ``invariant``), with ``context`` before it, unless it is a known peer bug (the
        example ends); anything else raised (but an injected fault) fails ``no_crash`` as
        ``{what} raised ...``."""
        try:
            yield
        except Diverged as e:
            d = e.divergence
            bug = self.subject.known_bug(d)
            if bug is not None:
                self.stopped = bug
                self.note(f"known peer bug: {bug.id}")
                raise ExampleEnded(d) from None
            name = invariant or divergence_invariant(d.field)
            raise InvariantViolation(name, f"{context}{describe(d)}") from None
        except (InvariantViolation, InjectedFault, ExampleEnded):
            raise
        except Exception as error:
            raise InvariantViolation("no_crash", f"{what} raised {error!r}") from error

    def note(self, label: str) -> None:
        self.record.coverage[label] += 1
        if currently_in_test_context():  # a regression test replays a program without it
            event(label)

    def note_all(self, labels: Iterable[str]) -> None:
        for label in labels:
            self.note(label)

    def target(self, value: float, label: str) -> None:
        if currently_in_test_context():
            target(value, label=label)

    def fresh_id(self, prefix: str = "r") -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def scheduler(self) -> Scheduler:
        assert self.side.scheduler is not None  # the invariants' precondition
        return self.side.scheduler

    def preempted_waiting(self) -> tuple[RequestState, ...]:
        return tuple(r for r in self.lock.state.waiting if r.num_preemptions)

    def decoding(self) -> tuple[RequestState, ...]:
        return tuple(
            r
            for r in self.lock.state.running
            if r.num_computed_tokens >= len(r.request.prompt_token_ids)
        )

    def prefilling(self) -> tuple[RequestState, ...]:
        return tuple(r for r in self.lock.state.running if r.num_tokens - r.num_computed_tokens > 1)

    def resolve(
        self, req: NewRequest, *, oversize: bool = False
    ) -> tuple[tuple[int, ...], SamplingParams]:
        """Tokens (from ``salt``) and parameters of a drawn request, clamped to fit (R4)
        unless ``oversize``, or ``req.oversize`` where every add may draw one."""
        prompt_len, max_tokens = self.fit(req, oversize=oversize)
        rng = random.Random(req.salt)
        # Under speculative decoding a prompt repeats a pattern of 1-4 tokens (from its
        # salt), so that prompt lookup finds n-grams and drafts get accepted.
        period = 1 + req.salt % 4 if self.config.num_speculative_tokens else prompt_len
        pattern = [rng.randrange(self.vocab) for _ in range(min(period, prompt_len))]
        prompt = tuple(pattern[i % period] for i in range(prompt_len))
        return prompt, self.params(prompt, req, max_tokens)

    def fit(self, req: NewRequest, *, oversize: bool = False) -> tuple[int, int]:
        """``(prompt_len, max_tokens)`` of a drawn request (see ``resolve``)."""
        oversize = oversize or (req.oversize and self.caps.oversize_in_every_add)
        return fit_sizes(self.config, replace(req, oversize=oversize))

    def params(self, prompt: tuple[int, ...], req: NewRequest, max_tokens: int) -> SamplingParams:
        """``req``'s parameters for ``prompt``: its EOS is one of the request's own solo
        outputs (so it is really hit), or the engine's (``Capabilities.engine_eos``)."""
        config = self.config
        keeps_priority = self.caps.priorities or config.policy == "priority"
        params = SamplingParams(
            max_tokens=max_tokens,
            priority=req.priority if keeps_priority else 0,
            temperature=req.temperature,
            seed=req.salt,
        )
        if self.caps.engine_eos:
            # One EOS for the engine: a request without one ignores it.
            ignore = req.ignore_eos or req.eos is None
            return replace(params, eos_token_id=self.side.eos, ignore_eos=ignore)
        if req.eos is None:
            return params
        if too_large(config, len(prompt), max_tokens):
            eos = req.eos % self.vocab
        else:
            outputs = self.side.solo(prompt, params)
            eos = outputs[req.eos % len(outputs)]
        return replace(params, eos_token_id=eos, ignore_eos=req.ignore_eos)

    def add_all(self, reqs: Sequence[NewRequest], *, oversize: bool = False) -> list[str]:
        """Submit each request; the ids accepted."""
        accepted = []
        for req in reqs:
            request_id = self.fresh_id()
            prompt, params = self.resolve(req, oversize=oversize)
            if self.submit(request_id, prompt, params):
                accepted.append(request_id)
        return accepted

    def send(
        self, prompts: Iterable[tuple[int, ...]], like: NewRequest | SamplingParams
    ) -> list[str]:
        """Submit each prompt as it is (it shares a prefix on purpose), with the
        parameters of ``like`` (a drawn request, or the parameters of an earlier one),
        both cut to what R4 accepts: the prompt only past its cap, so that it keeps its
        shared blocks, the outputs first. The ids accepted (remembered, to send again)."""
        prompt_cap, total_cap = r4_caps(self.config)
        accepted = []
        for whole in prompts:
            prompt = whole[: min(c for c in (prompt_cap, total_cap, len(whole)) if c is not None)]
            wanted = like.max_tokens
            max_tokens = wanted if total_cap is None else min(wanted, total_cap - len(prompt) + 1)
            if isinstance(like, NewRequest):
                params = self.params(prompt, like, max(1, max_tokens))
            else:
                params = replace(like, max_tokens=max(1, max_tokens))
            request_id = self.fresh_id()
            if self.submit(request_id, prompt, params, shared=True):
                accepted.append(request_id)
                self.sent.append(Accepted(request_id, prompt, params))
        return accepted

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        expected: type[InvalidRequestError] | None = None,
        *,
        shared: bool = False,
    ) -> bool:
        """Add on both sides; both must accept, or both raise the same typed error
        (``expected``, where the harness knows R4's answer). ``shared``: the prompt shares
        a prefix on purpose (kept whole under ``first_token_of_its_own``)."""
        if self.caps.first_token_of_its_own and not shared and prompt:
            prompt = (FIRST_TOKEN + self.num_added, *prompt[1:])
        self.num_added += 1
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
            self.note_all(
                refusal_events(before, request_id, len(prompt), params.max_tokens, refused)
            )
            return False
        self.accepted[before.next_arrival] = Accepted(request_id, tuple(prompt), params)
        self.side.added(tuple(prompt), params)
        if params.eos_token_id is not None:
            self.note("add: with EOS (ignored)" if params.ignore_eos else "add: with EOS")
        return True

    def abort_id(self, request_id: str) -> None:
        """Abort on both sides; an unknown id must be refused by both."""
        where = find_live(self.lock.state, request_id)
        finished: FinishedRequest | None = None
        # UnknownRequestError: refused by both sides (lockstep compared).
        with self.compared("abort_request"), contextlib.suppress(UnknownRequestError):
            finished = self.lock.abort(request_id)
        if where is None:
            self.note("abort: id of a finished request")
            return
        assert finished is not None  # the spec knew it, so both sides aborted it
        queue, request = where
        self.note(abort_label(queue, request))
        if request.num_in_flight_tokens:
            self.note(ASYNC_ABORT_EVENT)
        self.record_outcome(request.request.arrival, finished)

    def record_outcome(self, arrival: int, finished: FinishedRequest) -> None:
        require(
            arrival in self.accepted and arrival not in self.outcomes,
            "reported_once",
            lambda: (
                f"{finished.request_id!r} (arrival {arrival}) finished twice or was never accepted"
            ),
        )
        self.outcomes[arrival] = finished
        self.finished_prompts.add(self.accepted[arrival].prompt)


def machine_for(subject: Subject) -> type[LockstepMachine]:
    """The machine with ``subject`` under test, named ``subject.machine`` (a failing
    program starts ``state = <that name>()``)."""
    machine = type(subject.machine, (LockstepMachine,), {"subject": subject})
    return settings(deadline=None, suppress_health_check=SUPPRESSED)(machine)


#: The names of the invariants (they show up in a printed failing program).
INVARIANT_NAMES: Final = frozenset(
    invariant.function.__name__ for invariant in LockstepMachine.setup_state().invariants
)
