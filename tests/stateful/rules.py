"""The rules: what the machines do to both sides (add, abort, step, inject faults)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import MultipleResults, consumes, initialize, multiple, precondition, rule

import impl
import spec
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
    TokenOutOfVocabError,
    UnknownRequestError,
)
from tests.stateful.base import REQUESTS, checked
from tests.stateful.failures import fail, require
from tests.stateful.step import Stepping
from tests.stateful.strategies import (
    BAD_REQUESTS,
    INITIAL_REQUESTS,
    NEW_REQUESTS,
    BadRequest,
    NewRequest,
    engine_configs,
)


def find_live(state: SchedulerState, request_id: str) -> tuple[str, RequestState] | None:
    found = spec.find_request(state, request_id)
    if found is None:
        return None
    queue, index = found
    requests = {"waiting": state.waiting, "running": state.running, "swapped": state.swapped}
    return queue, requests[queue][index]


def abort_label(queue: str, request: RequestState) -> str:
    if queue == "running":
        if request.num_tokens - request.num_computed_tokens > 1:
            return "abort: running mid-prefill"
        return "abort: running (decoding)"
    if queue == "waiting" and request.num_preemptions > 0:
        return "abort: waiting after a preemption"
    return f"abort: {queue}"


def init_rule(configs: st.SearchStrategy[SchedulerConfig]) -> Callable[..., MultipleResults[str]]:
    """The ``@initialize`` rule of a machine: a config from ``configs`` and an initial load
    (``start_engine``)."""

    @initialize(target=REQUESTS, config=configs, initial=INITIAL_REQUESTS)
    @checked
    def init_engine(
        self: Rules, config: SchedulerConfig, initial: list[NewRequest]
    ) -> MultipleResults[str]:
        return self.start_engine(config, initial)

    return init_engine  # type: ignore[return-value]  # @initialize widens what it wraps


class Rules(Stepping):
    # --- rules -----------------------------------------------------------------------------

    init_engine = init_rule(engine_configs())

    def start_engine(
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
        with self.compared("init"):
            self.lock = self.new_lockstep(config)
        self.ready = True
        self.record.stats.examples += 1
        self.note(f"config: semantics={config.semantics}")
        self.note(f"config: policy={config.policy}")
        self.note(f"config: mode={config.preemption_mode}")
        self.note(f"config: block_size={config.block_size}")
        self.note(f"config: chunked prefill {'on' if config.enable_chunked_prefill else 'off'}")
        return multiple(*self.add_all(initial))

    @rule(target=REQUESTS, req=NEW_REQUESTS)
    @checked
    def add_request(self, req: NewRequest) -> str | MultipleResults[str]:
        request_id = self.fresh_id()
        prompt, params = self.resolve(req)
        return request_id if self.submit(request_id, prompt, params) else multiple()

    @rule(target=REQUESTS, reqs=st.lists(NEW_REQUESTS, min_size=2, max_size=6))
    @checked
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

    @rule(target=REQUESTS, req=NEW_REQUESTS, copies=st.integers(2, 6))
    @checked
    def add_identical(self, req: NewRequest, copies: int) -> MultipleResults[str]:
        """The same request several times (one prompt from many users): they advance in
        lockstep, so policies meet exact ties (same outputs, same prompt length)."""
        return multiple(*self.add_all([req] * copies))

    @rule(request_id=REQUESTS, req=NEW_REQUESTS)
    @checked
    def add_with_used_id(self, request_id: str, req: NewRequest) -> None:
        """A live id is a duplicate (R4.4); a finished or aborted one may be reused."""
        live = spec.is_live(self.lock.state, request_id)
        prompt, params = self.resolve(req)
        expected = DuplicateRequestError if live else None
        if self.submit(request_id, prompt, params, expected) and not live:
            self.note("add: reused the id of a finished request")

    @rule(bad=BAD_REQUESTS)
    @checked
    def add_bad_request(self, bad: BadRequest) -> None:
        """Defects combined; both sides must raise the first in R4's order, nothing changes."""
        live = spec.live_request_ids(self.lock.state)
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

    @rule(request_id=consumes(REQUESTS))
    @checked
    def abort(self, request_id: str) -> None:
        """Abort an id added earlier: live in any state (R11), or finished (unknown)."""
        self.abort_id(request_id)

    @precondition(lambda self: self.ready and spec.has_unfinished_requests(self.lock.state))
    @rule(
        queue=st.sampled_from(("waiting", "running", "prefilling", "swapped")),
        pick=st.integers(0, 2**16),
    )
    @checked
    def abort_live(self, queue: str, pick: int) -> None:
        """Abort a live request of ``queue`` (``prefilling``: running, in the middle of a
        chunked prefill), or of the first non-empty queue."""
        state = self.lock.state
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
        self.record_outcome(request.request.arrival, finished)

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

    @rule()
    @checked
    def step(self) -> None:
        self.do_step()

    @rule(n=st.integers(2, 10))
    @checked
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.do_step()

    @rule(limit=st.integers(1, 40), abort_victim=st.booleans())
    @checked
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
    @checked
    def inject_forward_fault(self, when_preempting: bool) -> None:
        """The next forward raises before running (``when_preempting``: the next forward
        of a step that preempts); then step."""
        self.inject("forward", when_preempting)

    @rule(when_preempting=st.sampled_from((True, True, False)))
    @checked
    def inject_fault_after_kv_write(self, when_preempting: bool) -> None:
        """The next forward raises after writing its K/V, possibly into blocks this step's
        victims gave up: the rollback must restore them (hence mostly in a step that
        preempts)."""
        self.inject("forward after KV write", when_preempting)

    @precondition(lambda self: self.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    @checked
    def inject_swap_out_fault(self) -> None:
        """The next swap-out copy raises (before copying)."""
        self.inject("swap-out copy", when_preempting=True)

    @precondition(lambda self: self.config.preemption_mode is PreemptionMode.SWAP)
    @rule()
    @checked
    def inject_swap_in_fault(self) -> None:
        """The next swap-in copy raises (after copying into the fresh GPU blocks)."""
        self.inject("swap-in copy", when_preempting=False)

    def inject(self, kind: str, when_preempting: bool) -> None:
        """Arm a fault and step. It fires once, at the next step that can hit it (a swap
        copy needs a swap; ``when_preempting``: only in a step that preempts)."""
        self.arm_fault(kind, when_preempting)
        self.do_step()
